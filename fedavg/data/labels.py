"""Class labels: the classes of a train split, and every split's labels as class indices.

A split's labels are matched to the train split's classes by name: a ``ClassLabel`` column
of another split may list its classes in another order, or fewer of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedavg.util.errors import UserError


def label_classes(train_ds, label: str, split: str) -> tuple[list[str], dict[Any, int] | None]:
    """Return the class names of column ``label`` of ``train_ds`` (split ``split``).

    Returns
    -------
    classes : list of str
        A ``ClassLabel``'s names in their order, else the sorted distinct values as text
        (whole numbers stored as floats without their ``.0``).
    mapping : dict or None
        Raw value to class index; ``None`` for a ``ClassLabel`` (values are indices).

    Raises
    ------
    UserError
        Empty labels, or non-integer numbers as labels.
    """
    import datasets

    label_feature = train_ds.features[label]
    if isinstance(label_feature, datasets.ClassLabel):
        return list(label_feature.names), None
    values = np.asarray(train_ds[label], dtype=object)
    empty = _empty_rows(values)
    if empty:
        raise UserError(f"label column {label!r} has {empty} in split {split!r}: fill or "
                        "drop those rows")
    values = np.asarray(list(values))
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise UserError(f"label column {label!r} holds infinite values in split {split!r}: "
                        "fix or drop those rows")
    if values.dtype.kind == "f" and not np.all(values == np.round(values)):
        raise UserError(
            f"label column {label!r} holds non-integer numbers: fedavg trains classifiers; "
            "pass --label-column with a class column"
        )
    uniq = np.unique(values)
    # whole numbers stored as floats (a CSV column with an empty cell elsewhere, 0.0 / 1.0)
    # are the classes "0", "1", as the same labels stored as integers are
    classes = [str(int(v)) if values.dtype.kind == "f" else str(v) for v in uniq]
    mapping = {v.item() if hasattr(v, "item") else v: i for i, v in enumerate(uniq)}
    return classes, mapping


def label_array(values, mapping: dict[Any, int] | None, classes: list[str], column: str,
                split: str, names: list[str] | None = None) -> np.ndarray:
    """Turn a split's label values into ``(N,)`` ``int64`` class indices.

    ``mapping`` (from :func:`label_classes`) maps raw values; without it the values are
    indices already and must lie in ``0..len(classes) - 1``. ``names`` are the split's own
    ``ClassLabel`` names when its values are indices into them: those indices are read as
    the class names they stand for.

    Raises
    ------
    UserError
        An index out of range, or a value train does not have.
    """
    arr = np.asarray(values)
    if names is not None and (mapping is not None or list(names) != list(classes)):
        if len(arr) and (arr.min() < 0 or arr.max() >= len(names)):
            raise UserError(f"label column {column!r} in split {split!r} has values outside "
                            f"0..{len(names) - 1}")
        lookup = mapping if mapping is not None else {c: i for i, c in enumerate(classes)}
        arr = np.asarray([names[i] for i in arr], dtype=object)
        mapping = {**lookup, **{str(k): v for k, v in lookup.items()},  # names are text
                   **{c: i for i, c in enumerate(classes)}}
    if mapping is None:
        y = arr.astype(np.int64)
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise UserError(f"label column {column!r} in split {split!r} has values outside "
                            f"0..{len(classes) - 1}")
        return y
    try:
        return np.asarray([mapping[v.item() if hasattr(v, "item") else v] for v in arr],
                          dtype=np.int64)
    except KeyError as exc:
        empty = _empty_rows(arr)
        if empty:
            raise UserError(f"label column {column!r} has {empty} in split {split!r}: fill "
                            "or drop those rows") from None
        raise UserError(
            f"split {split!r} has label {exc.args[0]!r} that train does not have"
        ) from None


def _empty_rows(values) -> str:
    """Say how many of ``values`` are empty and which rows (0-based data rows), or ``""``."""
    rows = [i for i, v in enumerate(values)
            if v is None or (isinstance(v, float) and np.isnan(v))]
    if not rows:
        return ""
    shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
    return (f"{len(rows)} empty value(s) (data row{'s' if len(rows) > 1 else ''} {shown}, "
            "counting from 0)")


def numeric_name(name: str) -> float | None:
    """Return the number a class name spells (``"1"`` and ``"1.0"`` alike), else ``None``."""
    try:
        value = float(name)
    except (TypeError, ValueError):
        return None
    return value if np.isfinite(value) else None


def similar_labels(classes: list[str]) -> list[str]:
    """Return a note on classes that may be meant as one, else nothing.

    Class names that differ only in case or surrounding spaces (``"Cat"``, ``"cat "``), or
    spell one number two ways (``"1"``, ``"1.0"``): the first such group.
    """
    folded: dict[Any, list[str]] = {}
    for c in classes:
        number = numeric_name(c)
        folded.setdefault(c.strip().lower() if number is None else number, []).append(c)
    return [f"label values that differ only in case, spaces or how a number is written are "
            f"separate classes: {', '.join(map(repr, same))}"
            for same in folded.values() if len(same) > 1][:1]
