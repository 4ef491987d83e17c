"""What ``fedavg predict`` is given: image files, folders of images, texts or datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from fedavg.data.columns import check_numeric, is_text
from fedavg.data.imagefolder import files_below, is_hidden
from fedavg.data.images import large_images_quiet
from fedavg.data.load import BUILTIN, FILE_BUILDERS, IMAGE_SUFFIXES, looks_like_path
from fedavg.data.sources import input_array, open_source
from fedavg.util.errors import UserError


def collect(inputs: Sequence[str]) -> list[tuple[str, Any]]:
    """Turn inputs into ``("image", path)`` and ``("dataset", source)`` items, each image once.

    A folder holding images is searched for them recursively (other files in it, and hidden
    ones such as ``._x.png`` or ``.git/``, are left aside); a saved dataset, or a folder of
    data files alone, is one dataset input.

    Raises
    ------
    UserError
        A missing path, a name too long for the file system, a file that is neither an
        image nor a dataset, a folder without images, or no inputs at all.
    """
    items: list[tuple[str, Any]] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        try:
            exists = path.exists()
        except OSError as exc:  # a name too long for the file system
            raise UserError(f"{raw[:60]}...: {exc.strerror}") from None
        if not exists:
            if raw in BUILTIN or (not looks_like_path(raw) and "/" in raw):
                items.append(("dataset", raw))
                continue
            raise UserError(f"no such file or folder: {raw}")
        if path.is_file():
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                items.append(("image", path))
            elif suffix in FILE_BUILDERS:
                items.append(("dataset", str(path)))
            else:
                raise UserError(f"{raw} is neither an image ({', '.join(sorted(IMAGE_SUFFIXES))}) "
                                "nor a dataset file")
            continue
        if not path.is_dir():  # a device, a pipe, a socket
            raise UserError(f"{raw} is not a file or folder: give image files, folders of "
                            "images, .txt files or datasets")
        files = [path / f for f in files_below(path) if not is_hidden(f)]  # ._x.png, .git/
        images = sorted(p for p in files if p.suffix.lower() in IMAGE_SUFFIXES)
        # a folder of images is predicted image by image, whatever else it holds (a
        # labels.json, an info.csv); a saved dataset, or data files alone, is a dataset
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists() or (
                not images and any(p.suffix.lower() in FILE_BUILDERS for p in files)):
            items.append(("dataset", str(path)))
            continue
        if not images:
            raise UserError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in folder {raw}")
        items.extend(("image", p) for p in images)
    if not items:
        raise UserError("nothing to predict: pass image files, folders or a dataset")
    seen: set[Path | None] = set()  # an image given itself and in a folder is predicted once
    unique = []
    for kind, item in items:
        key = item.resolve() if kind == "image" else None
        if key is not None and key in seen:
            continue
        seen.add(key)
        unique.append((kind, item))
    return unique


def check_inputs(inputs: Any) -> None:
    """Refuse ``predict`` inputs that are not a list of paths or texts.

    Raises
    ------
    TypeError
        A single path or text, or a list holding something else (arrays, images), naming it.
    """
    if isinstance(inputs, (str, Path)):
        raise TypeError(f"inputs must be a list of inputs, got the single {inputs!r}: pass "
                        f"[{str(inputs)!r}]")
    if not isinstance(inputs, Sequence) or not all(isinstance(i, (str, Path)) for i in inputs):
        odd = "" if not isinstance(inputs, Sequence) else " holding " + ", ".join(
            sorted({type(i).__name__ for i in inputs if not isinstance(i, (str, Path))}))
        raise TypeError("inputs must be a list of image or text file paths, folders, texts or "
                        f"dataset names (str), got {type(inputs).__name__}{odd}")


#: An image resized by more than this factor (height or width, up or down) gets a note.
RESIZE_NOTE_FACTOR = 2.0


def input_notes(images: Sequence[str | Path], shape: tuple[int, ...]) -> list[str]:
    """Say which images change a lot on the way into a model taking ``(C, H, W)`` inputs.

    Reads only the image headers. One line per kind of change (resized by more than
    :data:`RESIZE_NOTE_FACTOR`, colour made grey, grey made colour), naming how many
    images and one example; no line when nothing changes much.
    """
    from PIL import Image

    grey_model, (height, width) = shape[0] == 1, shape[1:]
    resized, to_grey, to_colour = [], [], []
    for path in images:
        try:
            with large_images_quiet(), Image.open(path) as img:
                w, h, img_mode = img.width, img.height, img.mode
        except Exception:  # noqa: BLE001 - decode_images reports unreadable files
            continue
        factor = max(h / height, height / h, w / width, width / w)
        if factor > RESIZE_NOTE_FACTOR:
            resized.append(f"{Path(path).name} is {w}x{h}")
        is_grey = img_mode in ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")
        if grey_model and not is_grey and img_mode != "P":
            to_grey.append(f"{Path(path).name} is {img_mode}")
        elif not grey_model and is_grey:
            to_colour.append(f"{Path(path).name} is {img_mode}")
    kind = f"{'grey' if grey_model else 'colour'} {width}x{height}"
    notes = []
    for found, change in ((resized, f"resized by more than {RESIZE_NOTE_FACTOR:g}x to the "
                                    f"model's {kind} inputs"),
                          (to_grey, "converted from colour to grey"),
                          (to_colour, "converted from grey to colour")):
        if found:
            notes.append(f"{len(found)} of {len(images)} image(s) {change} (e.g. {found[0]}); "
                         "predictions may be unreliable: use images like the training data")
    return notes


def table_rows(source: str, features: list[str]):
    """Return every row of a one-split table as ``(x, names)``; ``None`` for other data.

    Names are ``source#row<i>``, ``i`` counting data rows from 0.

    Raises
    ------
    UserError
        The table lacks one of the model's ``features`` columns.
    """
    dsdict = open_source(source)
    if len(dsdict) != 1:
        return None
    table = next(iter(dsdict.values()))
    have = table.features  # a deep copy on every access
    missing = [c for c in features if c not in have]
    if missing:
        raise UserError(f"{source} lacks the feature column(s) {', '.join(missing)} that the "
                        f"model takes ({', '.join(features)})")
    check_numeric(have, features, source)
    x = input_array(table, features, source)
    return x, [f"{source}#row{i}" for i in range(len(x))]


def text_table_rows(source: str, tokenizer: Any, column: str | None, given: bool = False):
    """Return every row of a one-split table of texts as ``(ids, names)``; ``None`` else.

    The texts are ``column``'s where the table has it (``given``: the user's
    ``--text-column``, which it must have), else its first column of text. Names are
    ``source#row<i>``. A table without labels is predicted this way.

    Raises
    ------
    UserError
        ``given`` and the table has no such column, or it holds no text.
    """
    dsdict = open_source(source)
    if len(dsdict) != 1:
        return None
    table = next(iter(dsdict.values()))
    features = table.features
    if given and column not in features:
        raise UserError(f"--text-column {column}: {source} has no such column; columns are: "
                        f"{', '.join(features)}")
    if given and not is_text(features[column]):
        raise UserError(f"--text-column {column}: it holds {features[column]}, not text")
    if column not in features or not is_text(features[column]):
        column = next((c for c, f in features.items() if is_text(f)), None)
    if column is None:
        raise UserError(f"{source} has no column of text for this text model (columns: "
                        f"{', '.join(features)})")
    texts = ["" if t is None else str(t) for t in table[column]]
    return tokenizer.encode(texts), [f"{source}#row{i}" for i in range(len(texts))]
