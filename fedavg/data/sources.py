"""Open a dataset source (local file or folder, Hugging Face hub id) and read its columns.

The reading half of :mod:`fedavg.data.load`: find the ``datasets.DatasetDict`` behind a name,
detect its input and label columns, and turn columns into arrays (images ``(N, C, H, W)``
``uint8``, tabular ``(N, D)`` ``float32``, labels ``(N,)`` ``int64``). :mod:`fedavg.data.load`
assembles these into a :class:`~fedavg.data.load.LoadedData` and re-exports the public names
here. No Flower import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedavg.data.columns import is_bytes, is_image
from fedavg.data.formats import FILE_BUILDERS, IMAGE_SUFFIXES  # noqa: F401  (re-exported)
from fedavg.data.imagefolder import read_image_folder
from fedavg.data.images import decode_images
from fedavg.util.errors import UserError, first_line

BUILTIN = ("digits",)
TEST_NAMES = ("test", "validation", "valid", "val")


def looks_like_path(name: str) -> bool:
    """Tell whether ``name`` is meant as a filesystem path rather than a hub id."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or Path(name).suffix.lower() in FILE_BUILDERS
        or Path(name).suffix.lower() in IMAGE_SUFFIXES
        or "\\" in name
    )


def open_source(dataset: str, notes: list[str] | None = None):
    """Open a local path or hub id as a ``datasets.DatasetDict``.

    Parameters
    ----------
    dataset : str
        A data file (``.parquet``, ``.csv``, ``.arrow``, ``.json``), a folder (data files,
        a ``save_to_disk`` folder, an image folder) or a Hugging Face hub id.
    notes : list of str, optional
        Receives one line per kind of thing left out (an image folder's class folders
        without images, its non-image or hidden files).

    Returns
    -------
    datasets.DatasetDict

    Raises
    ------
    UserError
        Unsupported file type, unreadable data, a path that does not exist, or a hub id
        the hub cannot provide.
    """
    import datasets

    datasets.disable_progress_bars()
    _quiet_hub_logs()
    path = Path(dataset).expanduser()
    try:
        exists = path.exists()
    except OSError as exc:  # a name too long for the file system
        raise UserError(f"--dataset {dataset[:60]}...: {exc.strerror}") from None
    if exists:
        if (path / "model.json").is_file() or (path / "model.safetensors").is_file():
            raise UserError(f"{dataset} is a saved model or run folder, not a dataset: pass "
                            "the data it was trained on, or other data")
        try:
            return _open_local(path, dataset, notes if notes is not None else [])
        except UserError:
            raise
        except Exception as exc:  # datasets raises many types for unreadable data
            hint = "; save it as UTF-8" if "codec can't decode" in _reason(exc) else ""
            raise UserError(f"cannot read dataset at {path}: {_reason(exc)}{hint}") from None
    if looks_like_path(dataset):
        raise UserError(f"no such file or folder: {dataset}")
    try:
        return datasets.load_dataset(dataset)
    except Exception as exc:  # connection errors, unknown repo ids, gated repos
        raise UserError(
            f"unknown dataset {dataset!r}: not built in ({', '.join(BUILTIN)}), not a local "
            f"path, and the Hugging Face hub could not provide it ({_one_line(exc)}); "
            "give a local path or check the id and the network"
        ) from None


def _open_local(path: Path, source: str, notes: list[str]):
    """Open an existing file or folder with the ``datasets`` builder that fits it."""
    import datasets

    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise UserError(
                f"cannot read {path}: use a .parquet, .csv, .arrow or .json file, "
                "or a folder"
            )
        if path.stat().st_size == 0:
            raise UserError(f"{path} is an empty file: give a data file with samples")
        return datasets.load_dataset(builder, data_files=str(path))
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({"train": loaded})
        return loaded

    folder = read_image_folder(path, source)
    if folder is not None:  # an image folder, even with more stray files than images
        notes.extend(folder[1])
        return folder[0]
    loaded = datasets.load_dataset(str(path))
    tables = sorted(f.name for f in path.iterdir() if f.suffix.lower() in FILE_BUILDERS)
    if tables and all(ds.column_names == ["image"] for ds in loaded.values()):
        raise UserError(f"{source} holds images and tables ({', '.join(tables[:3])}) but no "
                        "labels of the images: to label them by a table, name it metadata.csv "
                        "with a file_name column (each image's path relative to it); or give "
                        "the table itself as --dataset")
    return loaded


def _quiet_hub_logs() -> None:
    """Keep the hub's retry chatter, download bars and pyarrow's warnings off the terminal."""
    import datasets

    # CRITICAL: its error lines repeat what our one-line error says
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        from huggingface_hub.utils import disable_progress_bars
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
        disable_progress_bars()  # the hub's download bars are its own, not datasets'
    except ImportError:  # pragma: no cover - comes with datasets
        pass


#: The first line of every error ``datasets`` raises while it builds a dataset.
_GENERIC = "An error occurred while generating the dataset"


def _reason(exc: BaseException) -> str:
    """Return the telling line of a ``datasets`` error (at most 300 characters).

    That is the first line past its generic first line, else its cause's.
    """
    seen: BaseException | None = exc
    while seen is not None:
        for line in str(seen).splitlines():
            if "corresponds to no data" in line:  # a split of no rows (a header-only CSV)
                return "it holds no rows"
            if line.strip() and line.strip() != _GENERIC:
                return line.strip()[:300]
        seen = seen.__cause__ or seen.__context__
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    """Shorten ``exc`` to its first line, at most 300 characters."""
    return first_line(exc, 300)


def input_array(ds, columns: list[str], source: str, like: tuple[int, ...] | None = None,
                notes: list[str] | None = None) -> np.ndarray:
    """Read the input ``columns`` of split ``ds`` as one array.

    ``columns`` is one image or array column, or several numeric feature columns;
    ``source`` names the data in messages. Images are decoded to the ``(C, H, W)`` of
    ``like`` (another split's images) when given, else as :func:`decode_images` chooses,
    its notes going to ``notes``.

    Returns
    -------
    numpy.ndarray
        ``(N, C, H, W)`` images (``uint8``, or ``float32`` for float arrays) or ``(N, D)``
        ``float32`` features.

    Raises
    ------
    UserError
        Empty, NaN or infinite features, undecodable images, or a column of other data.
    """
    import datasets

    if len(columns) > 1:  # tabular
        table = ds.select_columns(columns).with_format("numpy")[:]  # one batch, not rows
        x = np.stack([np.asarray(table[c], dtype=np.float32) for c in columns], axis=1)
        bad = ~np.isfinite(x).all(axis=0)
        absent = [c for c, gone in zip(columns, np.isnan(x).all(axis=0)) if gone]
        if absent and len(x):  # a split's file without the column reads as all missing
            raise UserError(f"feature column(s) {absent[:5]} of {source} have no values at all "
                            "(missing from its file?): drop them from the table, or, for a "
                            "saved model's columns, give data that has them")
        if bad.any():
            names = [c for c, b in zip(columns, bad) if b]
            raise UserError(f"feature column(s) {names[:5]} of {source} have empty, NaN or "
                            "infinite values: fill or drop them")
        return x
    col = columns[0]
    feature = ds.features[col]
    shape = {} if like is None or len(like) != 3 else \
        {"size": tuple(like[1:]), "mode": "L" if like[0] == 1 else "RGB"}
    if isinstance(feature, datasets.Image):
        raw = ds.cast_column(col, datasets.Image(decode=False))[col]
        return decode_images(raw, source, notes=notes, **shape)
    if is_image(feature) or is_bytes(feature):  # image structs without HF metadata, bytes
        return decode_images(ds[col], source, notes=notes, **shape)
    return _array_column(ds, col, feature, source)


def _array_column(ds, col: str, feature, source: str) -> np.ndarray:
    """Read a numeric column (scalars, vectors or image-like arrays) into a batch array."""
    try:
        arr = np.asarray(ds.with_format("numpy")[col])
    except Exception:
        arr = np.asarray(ds[col], dtype=object)
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise UserError(f"column {col!r} of {source} holds {feature}, not images or numbers; "
                        "pass --image-column")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        if np.isnan(arr).all():  # e.g. a CSV column of empty strings
            raise UserError(f"column {col!r} of {source} is empty: every value is missing")
        raise UserError(f"column {col!r} of {source} has NaN or infinite values")
    if arr.ndim == 1:
        return arr.astype(np.float32)[:, None]
    if arr.ndim == 2:
        return arr.astype(np.float32)
    if arr.ndim == 3:
        arr = arr[:, None]
    elif arr.ndim == 4 and arr.shape[-1] in (1, 3, 4) and arr.shape[1] not in (1, 3, 4):
        arr = arr.transpose(0, 3, 1, 2)
    return arr if arr.dtype == np.uint8 else arr.astype(np.float32)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images ``(1797, 8, 8)`` float (0..16) and labels ``(1797,)``.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``) without
    importing scikit-learn, which costs about a second (SciPy); where that file is not found,
    from :func:`sklearn.datasets.load_digits`.
    """
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = (Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
            / "digits.csv.gz") if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def same_source(given: str, recorded: str | None) -> bool:
    """Whether ``given`` names the dataset recorded as ``recorded`` (as written, or the path)."""
    if recorded is None:
        return False
    if given == recorded:
        return True
    a, b = Path(given).expanduser(), Path(recorded).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def saved_load_args(meta: dict[str, Any], source: str, whole: bool = False) -> dict[str, Any]:
    """Return :func:`fedavg.data.load.load`'s column and hold-out arguments for a saved model.

    The run's seed and test fraction (the same hold-out); the columns its run recorded: all
    of them for its own dataset; for another, as hints taken where that data has them: a
    tabular model's ``feature_columns`` (a table's column names are its schema), its label
    (``label_hint``) and its image or text column (``input_hint``); with ``whole``, no
    hold-out either: such a dataset without a test split is scored or predicted whole
    (``hold_out=False``).
    """
    ds_meta = meta.get("dataset", {})
    args: dict[str, Any] = {"seed": int(ds_meta.get("seed", 0)),
                            "test_fraction": float(ds_meta.get("test_fraction", 0.2))}
    cols = ds_meta.get("columns") or {}
    if same_source(source, ds_meta.get("source")):
        args.update(image_column=cols.get("image"), label_column=cols.get("label"),
                    text_column=cols.get("text"), feature_columns=cols.get("features"))
    else:
        args.update(hold_out=not whole, feature_columns=cols.get("features") or None,
                    label_hint=cols.get("label"), input_hint=cols.get("text") or cols.get("image"))
    return args
