"""Which columns of a dataset are the label and the inputs: detected, or as named.

Images (an ``Image`` or array column), text (a string column) or tabular features (every
numeric column); the label a ``ClassLabel`` or the most usual label name.
"""

from __future__ import annotations

import re

from fedavg.util.errors import NoLabelColumn, UserError

IMAGE_NAMES = ("image", "img", "images", "pixel_values", "pixels", "x", "features")
LABEL_NAMES = ("label", "labels", "target", "class", "y", "fine_label")


def _check_column(features, col: str, flag: str, source: str) -> str:
    """Return ``col`` if ``features`` has it, else a user error naming ``flag``."""
    if col not in features:
        raise UserError(f"column {col!r} ({flag}) is not in {source}; columns are: "
                        f"{', '.join(features)}")
    return col


def detect_columns(features, source: str, image_column: str | None = None,
                   label_column: str | None = None,
                   partition_by: str | None = None,
                   text_column: str | None = None,
                   feature_columns: list[str] | None = None,
                   label_hint: str | None = None) -> tuple[str, list[str]]:
    """Pick the label column and the input column(s) of the train split's ``features``.

    Columns the user named (``image_column``, ``label_column``, ``partition_by``,
    ``text_column``) are checked, the others detected: the label is a ``ClassLabel``
    column, else the column with the most usual label name (``label`` before ``y``, see
    :data:`LABEL_NAMES`); the input is one image (or array) column, else one text (string)
    column (:func:`is_text`), else every numeric column but the label and ``partition_by``
    (tabular data). ``feature_columns`` (a saved tabular model's) are taken by name, in
    their order; ``label_hint`` (a saved model's label) is the label where the data has it.
    ``source`` names the data in messages.

    Returns
    -------
    tuple of (str, list of str)
        ``(label, inputs)``.

    Raises
    ------
    UserError
        A named column that does not exist, no label or input column found, or the same
        column as both input and label.
    """
    import datasets

    columns = list(features)
    if label_column is not None:
        label = _check_column(features, label_column, "--label-column", source)
    elif label_hint is not None and label_hint in features:  # a saved model's, if there
        label = label_hint
    else:
        label = next(
            (c for c, f in features.items() if isinstance(f, datasets.ClassLabel)), None
        ) or next((c for name in LABEL_NAMES for c in columns if c.lower() == name), None)
        if label is None:
            raise NoLabelColumn(
                f"no label column found in {source}; pass --label-column (columns: "
                f"{', '.join(columns)})"
            )
    if image_column is not None and text_column is not None:
        raise UserError("pass --image-column or --text-column, not both")
    if text_column is not None:
        image = [_check_column(features, text_column, "--text-column", source)]
        if not is_text(features[text_column]):
            raise UserError(f"--text-column {text_column}: it holds {features[text_column]}, "
                            "not text")
    elif feature_columns:
        missing = [c for c in feature_columns if c not in features]
        if missing:
            raise UserError(f"{source} lacks the feature column(s) {', '.join(missing)} that "
                            f"the model takes ({', '.join(feature_columns)})")
        image = list(feature_columns)
        check_numeric(features, image, source)
    elif image_column is not None:
        image = [_check_column(features, image_column, "--image-column", source)]
        if is_text(features[image_column]):
            raise UserError(f"--image-column {image_column}: it holds text; pass --text-column "
                            f"{image_column}")
    else:
        image = _detect_inputs(features, source, label, partition_by)
    if partition_by is not None:
        _check_column(features, partition_by, "--partition-by", source)
    if label in image:
        flag = "--text-column" if text_column is not None else "--image-column"
        # a guessed label that is the named input: the data has no other label column
        error = UserError if label_column is not None else NoLabelColumn
        raise error(f"column {label!r} is both the input and the label; pass another "
                    f"{flag} or --label-column")
    return label, image


def _detect_inputs(features, source: str, label: str, partition_by: str | None) -> list[str]:
    """Find an image column, or else every numeric feature column (tabular data)."""
    import datasets

    columns = list(features)
    found = next(
        (c for c, f in features.items() if is_image(f) and c != label),
        None,
    ) or next((c for c in columns if c.lower() in IMAGE_NAMES and c != label and (
        is_bytes(features[c]) or not isinstance(features[c], datasets.Value))),
        None)  # arrays or image bytes, not scalars
    if found is not None:
        return [found]
    text = next((c for c, f in features.items() if c not in (label, partition_by)
                 and is_text(f)), None)
    if text is not None:
        return [text]
    image = numeric_columns(features, label, partition_by)
    if not image:
        besides = f"the label column {label!r}" + (
            f" and the --partition-by column {partition_by!r}" if partition_by else "")
        raise UserError(
            f"no image, text or numeric feature column in {source} besides {besides}; pass "
            f"--image-column or --text-column, or another --label-column"
            f"{' or --partition-by' if partition_by else ''} (columns: {', '.join(columns)})"
        )
    return image


#: The name pandas (and so ``datasets``) gives a first column whose header cell is empty: the
#: row index ``DataFrame.to_csv(path)`` writes unless told ``index=False``. A table read back
#: with it and saved again gets another, ``Unnamed: 0.1``, before it.
SAVED_INDEX = re.compile(r"Unnamed: 0(\.\d+)?")


def table_inputs(features, inputs: list[str], named: list[str] | None, label: str,
                 partition_by: str | None) -> tuple[list[str], str | None]:
    """Return a table's detected feature columns, pandas' saved row indexes left out.

    As a feature, a row number teaches a model the file's order (often its sort by label).
    The table's leading integer columns named as :data:`SAVED_INDEX` are left out, while
    another feature remains; ``named`` (a saved model's own feature columns) are kept as
    they are. Columns a table's features cannot hold (dates, lists) are named too.

    Returns
    -------
    tuple of (list of str, str or None)
        The feature columns, and a note when any column was left out.
    """
    numeric = numeric_columns(features, label, partition_by)
    if named or not inputs or not set(inputs) <= set(numeric):
        return inputs, None  # not a table's detected features
    index = []
    for column in features:
        if not SAVED_INDEX.fullmatch(column) or column not in inputs or not str(
                getattr(features[column], "dtype", "")).startswith(("int", "uint")):
            break
        index.append(column)
    kept = [c for c in inputs if c not in index]
    kept = kept if index and kept else inputs
    notes = [] if kept is inputs else [
        f"left out {', '.join(map(repr, index))}: row numbers pandas saved as a first column "
        "with an empty header (DataFrame.to_csv without index=False), not features; give such "
        "a column a header to use it as one"]
    other = [f"{c} ({getattr(f, 'dtype', type(f).__name__)})" for c, f in features.items()
             if c not in (label, partition_by) and c not in numeric and not is_text(f)]
    if other:
        notes.append(f"column(s) {', '.join(other[:5])} left out: a table's features are "
                     "numbers (convert dates to numbers to use them)")
    return kept, "; ".join(notes) or None


def is_image(feature) -> bool:
    """Tell whether a column holds encoded images.

    An ``Image`` feature or ``{bytes, path}`` structs (images written without
    ``datasets``' metadata); raw bytes (:func:`is_bytes`) only by name or when named.
    """
    import datasets

    return isinstance(feature, datasets.Image) or (
        isinstance(feature, dict) and "bytes" in feature)


def is_bytes(feature) -> bool:
    """Tell whether a column holds raw bytes (images if it is the input, else a digest)."""
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary")


def check_numeric(features, names: list[str], source: str) -> None:
    """Refuse feature columns ``names`` that do not hold numbers (a saved tabular model's).

    Raises
    ------
    UserError
        One of them is not a numeric or bool column (say, a ``?`` made it text).
    """
    numeric = set(numeric_columns(features, "", None))
    if odd := [c for c in names if c not in numeric]:
        kind = "text" if is_text(features[odd[0]]) else str(features[odd[0]])
        raise UserError(f"column(s) {', '.join(odd)} of {source} do not hold numbers only "
                        f"({odd[0]} reads as {kind}), but the model takes them as numeric "
                        "features: fix or drop the values that are not numbers")


def hinted_input(features, hint: str | None, image_column: str | None,
                 text_column: str | None, label_column: str | None,
                 partition_by: str | None) -> tuple[str | None, str | None]:
    """Return ``(image_column, text_column)``: the given ones, else a saved model's ``hint``.

    A model's input column, recorded in its run, is taken from another dataset that has a
    column of that name and kind, and no column was named: of two text columns, the first
    is not the one the model read.
    """
    if (hint is None or hint not in features or image_column or text_column
            or hint in (label_column, partition_by)):
        return image_column, text_column
    if is_text(features[hint]):
        return None, hint
    return (hint, None) if is_image(features[hint]) else (None, None)


def numeric_columns(features, label: str, partition_by: str | None) -> list[str]:
    """Return the numeric (and bool) columns but the label and the group column: a table's."""
    import datasets

    return [c for c, f in features.items() if c not in (label, partition_by)
            and isinstance(f, datasets.Value)
            and (f.dtype.startswith(("int", "uint", "float")) or f.dtype == "bool")]


#: A detected string column beside numeric ones is a table's categories (a city, a colour),
#: not the run's text, when its values average fewer words than this and repeat (at most
#: half of them distinct) ...
TEXT_WORDS = 3.0
#: ... or, distinct or not, when they average at most this many words: ids, dates, codes.
ONE_WORD = 1.5


def text_or_table(ds, label: str, partition_by: str | None, source: str,
                  sample: int = 1000) -> tuple[list[str], str | None]:
    """Decide whether a table's string columns hold the run's text, or categories and ids.

    Without numeric columns, the text is the first string column of text (see below), else
    the one of most words per value (the first of them). Beside numeric
    columns, a string column is text unless its values are short and repeat
    (:data:`TEXT_WORDS`) or are one word each (:data:`ONE_WORD`); with no such column the
    numeric columns are the features.

    Returns
    -------
    tuple
        ``(inputs, note)``: ``[text column]`` for text, and a note naming the numeric
        columns left out, if any; else the numeric columns and a note naming the string
        columns left out.

    Raises
    ------
    UserError
        A string column holds numbers but for a few values (:func:`numbers_as_text`).
    """
    strings = [c for c, f in ds.features.items() if c not in (label, partition_by) and is_text(f)]
    values = {c: _sample(ds, c, sample) for c in strings}
    for name in strings:
        numbers_as_text(values[name], name, source)
    words = {c: sum(len(v.split()) for v in vals) / len(vals) if vals else 0.0
             for c, vals in values.items()}
    text = [c for c in strings if words[c] >= TEXT_WORDS or (
        words[c] > ONE_WORD and len(set(values[c])) > 0.5 * len(values[c]))]
    numeric = numeric_columns(ds.features, label, partition_by)
    if text or not numeric:
        chosen = text[0] if text else max(strings, key=lambda c: words[c])
        return [chosen], (f"numeric column(s) {', '.join(numeric[:5])} left out: a text model "
                          f"reads its text ({chosen!r}) only" if numeric else None)
    return numeric, (f"string column(s) {', '.join(strings)} left out: short values "
                     "(categories, ids, dates) are not features a table encodes (--text-column "
                     "to train on one as text)")


def _sample(ds, column: str, sample: int) -> list[str]:
    """Return the first ``sample`` non-empty values of ``column`` (none if not UTF-8)."""
    try:
        return [v for v in ds.select(range(min(len(ds), sample)))[column] if v and v.strip()]
    except UnicodeDecodeError:  # said where the text is read (fedavg.data.text.tokenized)
        return []


def numbers_as_text(values: list[str], column: str, source: str) -> None:
    """Refuse a text column that holds numbers but for a few values: a table's typo.

    One ``?`` or ``n/a`` among the numbers of a CSV column makes the whole column text;
    taken as the run's input, every numeric feature would be left out.

    Raises
    ------
    UserError
        Most of ``values`` (a sample of the column's non-empty values) parse as numbers.
    """

    def number(v: str) -> bool:
        try:
            float(v)
        except ValueError:
            return False
        return True

    odd = [v for v in values if not number(v)]
    if values and len(odd) < 0.5 * len(values):
        what = (f"holds numbers but also {len(odd)} other value(s) such as {odd[0]!r}, so it "
                "reads as text" if odd else f"holds numbers (its first {len(values)} values) "
                "stored as text")
        raise UserError(f"column {column!r} of {source} {what}: fix or drop the values that "
                        f"are not numbers, or pass --text-column {column} if it is text")


def is_text(feature) -> bool:
    """Tell whether a ``datasets`` feature is a text column (``string`` values)."""
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
