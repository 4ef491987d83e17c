"""Load a dataset by name, local path or Hugging Face hub id into plain arrays.

Every source becomes a :class:`LoadedData`: per split, inputs ``x`` of shape ``(N, C, H, W)``
(images, ``uint8`` or ``float32``) or ``(N, D)`` (tabular ``float32``) and labels ``y`` of
shape ``(N,)`` (``int64`` class indices), plus class names and the input normalisation
computed on train. No Flower import here.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedavg.errors import UserError

log = logging.getLogger(__name__)

BUILTIN = ("digits",)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
}
IMAGE_NAMES = ("image", "img", "images", "pixel_values", "pixels", "x", "features")
LABEL_NAMES = ("label", "labels", "target", "class", "y", "fine_label")
TEST_NAMES = ("test", "validation", "valid", "val")


@dataclass
class Split:
    """One split as arrays.

    Attributes
    ----------
    x : numpy.ndarray
        ``(N, C, H, W)`` images (``uint8`` 0-255 or ``float32``) or ``(N, D)`` ``float32``.
    y : numpy.ndarray
        ``(N,)`` ``int64`` class indices into ``LoadedData.classes``.
    groups : numpy.ndarray or None
        ``(N,)`` values of the ``partition_by`` column, when asked for.
    """

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class LoadedData:
    """A dataset ready for partitioning and training.

    Attributes
    ----------
    splits : dict of str to Split
        Always has ``train`` and ``test`` (``test`` may be a seeded hold-out of train).
    classes : list of str
        Class names, index = label.
    source : str
        What the user asked for (name, path or hub id).
    columns : dict
        ``{"image": ..., "label": ...}`` column names used (``None`` for built-ins).
    notes : list of str
        Things the user should know (e.g. that a test hold-out was carved).
    """

    splits: dict[str, Split]
    classes: list[str]
    source: str
    columns: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def train(self) -> Split:
        """The training split."""
        return self.splits["train"]

    @property
    def test(self) -> Split:
        """The test split (or the seeded hold-out)."""
        return self.splits["test"]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample: ``(C, H, W)`` or ``(D,)``."""
        return tuple(self.train.x.shape[1:])

    def input_spec(self) -> dict[str, Any]:
        """Input normalisation measured on train, as stored in ``model.json``.

        Returns
        -------
        dict
            ``shape`` (sample shape), ``dtype``, ``scale`` (1/255 for ``uint8``), and
            ``mean``/``std`` per channel (images) or per feature (tabular), after scaling.
        """
        x = self.train.x
        scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
        axes = (0, 2, 3) if x.ndim == 4 else (0,)
        mean = np.zeros(x.shape[1], dtype=np.float64)
        sq = np.zeros(x.shape[1], dtype=np.float64)
        step = 4096  # stream to keep memory flat on large sets
        for start in range(0, len(x), step):
            chunk = x[start : start + step].astype(np.float64) * scale
            mean += chunk.sum(axis=axes)
            sq += (chunk**2).sum(axis=axes)
        count = len(x) * (int(np.prod(x.shape[2:])) if x.ndim == 4 else 1)
        mean /= count
        std = np.sqrt(np.maximum(sq / count - mean**2, 0.0))
        std = np.where(std < 1e-6, 1.0, std)
        return {
            "shape": list(x.shape[1:]),
            "dtype": str(x.dtype),
            "scale": scale,
            "mean": [round(float(v), 6) for v in mean],
            "std": [round(float(v), 6) for v in std],
        }


def normalize(x: "torch.Tensor", spec: dict[str, Any]) -> "torch.Tensor":  # noqa: F821
    """Turn raw inputs into model inputs: ``(x * scale - mean) / std`` per channel/feature.

    Parameters
    ----------
    x : torch.Tensor
        ``(N, C, H, W)`` or ``(N, D)`` raw batch, any numeric dtype.
    spec : dict
        :meth:`LoadedData.input_spec`.

    Returns
    -------
    torch.Tensor
        ``float32`` tensor of the same shape.
    """
    import torch

    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = torch.tensor(spec["mean"], dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(spec["std"], dtype=torch.float32, device=x.device).view(shape)
    return (x.to(torch.float32) * float(spec["scale"]) - mean) / std


def load(
    dataset: str,
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    partition_by: str | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> LoadedData:
    """Load ``dataset`` into arrays with ``train`` and ``test`` splits.

    Parameters
    ----------
    dataset : str
        ``digits`` (scikit-learn's 8x8 digits, offline); a local file (``.parquet``,
        ``.csv``, ``.arrow``, ``.json``) or folder (data files with split names, a
        ``save_to_disk`` folder, or an image folder with one subfolder per class); or a
        Hugging Face hub id such as ``ylecun/mnist``.
    image_column, label_column : str, optional
        Override column detection.
    partition_by : str, optional
        Keep this column's values (``Split.groups``) for natural partitioning.
    seed : int
        Seed of the test hold-out when the dataset has no test split.
    test_fraction : float
        Share of train held out as test in that case.

    Returns
    -------
    LoadedData

    Raises
    ------
    UserError
        Unknown name, unreadable path, hub unreachable, missing or unusable columns,
        an empty split.
    """
    if dataset in BUILTIN:
        for flag, col in (("--image-column", image_column), ("--label-column", label_column),
                          ("--partition-by", partition_by)):
            if col is not None:
                raise UserError(f"{flag} {col}: the built-in {dataset} dataset has no columns")
        data = _load_digits()
    else:
        dsdict = _open(dataset)
        data = _from_hf(dsdict, dataset, image_column, label_column, partition_by)
    if "test" not in data.splits:
        train = data.splits["train"]
        if len(train) < 2:
            raise UserError(f"dataset {dataset!r} has {len(train)} train sample(s); need >= 2")
        data.splits["train"], data.splits["test"] = holdout(train, test_fraction, seed)
        n_test = len(data.splits["test"])
        data.notes.append(
            f"no test split in {dataset}: held out {n_test} of {len(train)} train samples "
            f"({test_fraction:.0%}, seed {seed}) as test"
        )
    if len(data.classes) < 2:
        raise UserError(f"{dataset} has a single class ({data.classes}): a classifier needs at "
                        "least two; check --label-column")
    return data


def conform(split: Split, source: str, shape: tuple[int, ...] | list[int],
            split_classes: list[str] | None = None,
            classes: list[str] | None = None) -> Split:
    """Check ``split``'s inputs have ``shape`` and relabel it from ``split_classes`` to
    ``classes`` by class name (labels are left alone when either is ``None``).

    Raises
    ------
    UserError
        Other input shape, or labels that ``classes`` does not have.
    """
    if tuple(split.x.shape[1:]) != tuple(shape):
        raise UserError(f"{source} has inputs of shape {tuple(split.x.shape[1:])}, the model "
                        f"expects {tuple(shape)}")
    if split_classes is None or classes is None or list(split_classes) == list(classes):
        return split
    index = {c: i for i, c in enumerate(classes)}
    unknown = [c for c in split_classes if c not in index]
    if unknown:
        raise UserError(f"{source} has labels the model does not know: {unknown[:5]} "
                        f"(model classes: {', '.join(list(classes)[:10])})")
    mapping = np.asarray([index[c] for c in split_classes])
    return Split(split.x, mapping[split.y], split.groups)


def holdout(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """Split off a seeded random ``fraction`` of ``split``: ``(rest, held_out)``.

    At least one sample goes to each side; both keep the original order.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(split))
    n_out = min(len(split) - 1, max(1, round(len(split) * fraction)))
    return _take(split, np.sort(order[n_out:])), _take(split, np.sort(order[:n_out]))


def _take(split: Split, idx: np.ndarray) -> Split:
    groups = None if split.groups is None else split.groups[idx]
    return Split(split.x[idx], split.y[idx], groups)


def _load_digits() -> LoadedData:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # 0..16 intensities -> 0..255 uint8 so digits are handled like any image dataset
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    classes = [str(c) for c in bunch.target_names]
    return LoadedData({"train": Split(x, y)}, classes, "digits", {"image": None, "label": None})


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a filesystem path rather than a hub id."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or Path(name).suffix.lower() in FILE_BUILDERS
        or Path(name).suffix.lower() in IMAGE_SUFFIXES
        or "\\" in name
    )


def _open(dataset: str):
    """Open a local path or hub id as a ``datasets.DatasetDict``."""
    import datasets

    datasets.disable_progress_bars()
    _quiet_hub_logs()
    path = Path(dataset).expanduser()
    if path.exists():
        try:
            if path.is_file():
                builder = FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise UserError(
                        f"cannot read {path}: use a .parquet, .csv, .arrow or .json file, "
                        "or a folder"
                    )
                return datasets.load_dataset(builder, data_files=str(path))
            if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.Dataset):
                    loaded = datasets.DatasetDict({"train": loaded})
                return loaded
            return datasets.load_dataset(str(path))
        except UserError:
            raise
        except Exception as exc:  # datasets raises many types for unreadable data
            raise UserError(f"cannot read dataset at {path}: {_one_line(exc)}") from None
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


def _quiet_hub_logs() -> None:
    """Keep the hub's retry chatter and pyarrow's warnings off the user's terminal."""
    import datasets

    datasets.logging.set_verbosity_error()
    try:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - comes with datasets
        pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first[:300]


def _from_hf(dsdict, source, image_column, label_column, partition_by) -> LoadedData:
    import datasets

    names = list(dsdict.keys())
    if not names:
        raise UserError(f"dataset {source!r} has no splits")
    train_name = "train" if "train" in dsdict else names[0]
    test_name = next((n for n in TEST_NAMES if n in dsdict and n != train_name), None)
    train_ds = dsdict[train_name]
    if len(train_ds) == 0:
        raise UserError(f"split {train_name!r} of {source!r} is empty")
    features = train_ds.features
    columns = list(features)

    def check(col: str, flag: str) -> str:
        if col not in features:
            raise UserError(
                f"column {col!r} ({flag}) is not in {source}; columns are: {', '.join(columns)}"
            )
        return col

    if label_column is not None:
        label = check(label_column, "--label-column")
    else:
        label = next(
            (c for c, f in features.items() if isinstance(f, datasets.ClassLabel)), None
        ) or next((c for c in columns if c.lower() in LABEL_NAMES), None)
        if label is None:
            raise UserError(
                f"no label column found in {source}; pass --label-column (columns: "
                f"{', '.join(columns)})"
            )
    if image_column is not None:
        image = [check(image_column, "--image-column")]
    else:
        found = next(
            (c for c, f in features.items() if isinstance(f, datasets.Image) and c != label),
            None,
        ) or next((c for c in columns if c.lower() in IMAGE_NAMES and c != label), None)
        if found is not None:
            image = [found]
        else:  # tabular: every numeric column but the label and the group column
            image = [
                c
                for c, f in features.items()
                if c not in (label, partition_by)
                and isinstance(f, datasets.Value)
                and (f.dtype.startswith(("int", "uint", "float")) or f.dtype == "bool")
            ]
            if not image:
                raise UserError(
                    f"no image or numeric feature column in {source}; pass --image-column "
                    f"(columns: {', '.join(columns)})"
                )
    if partition_by is not None:
        check(partition_by, "--partition-by")
    if label in image:
        raise UserError(f"column {label!r} is both the input and the label; pass another "
                        "--image-column or --label-column")

    label_feature = features[label]
    if isinstance(label_feature, datasets.ClassLabel):
        classes = list(label_feature.names)
        mapping = None
    else:
        values = np.asarray(train_ds[label], dtype=object)
        empty = sum(v is None or (isinstance(v, float) and np.isnan(v)) for v in values)
        if empty:
            raise UserError(f"label column {label!r} has {empty} empty value(s) in split "
                            f"{train_name!r}: fill or drop those rows")
        values = np.asarray(list(values))
        if values.dtype.kind == "f" and not np.all(values == np.round(values)):
            raise UserError(
                f"label column {label!r} holds non-integer numbers: fedavg trains classifiers; "
                "pass --label-column with a class column"
            )
        uniq = np.unique(values)
        classes = [str(v) for v in uniq]
        mapping = {v.item() if hasattr(v, "item") else v: i for i, v in enumerate(uniq)}

    splits: dict[str, Split] = {}
    for name in names:
        ds = dsdict[name]
        missing = [c for c in image + [label] if c not in ds.features]
        if missing:
            if name == train_name:
                raise UserError(f"split {name!r} lacks column(s) {missing}")
            continue
        x = _inputs(ds, image, source)
        y = _labels(ds[label], mapping, classes, label, name)
        groups = None
        if partition_by is not None and partition_by in ds.features:
            groups = np.asarray([str(v) for v in ds[partition_by]])
        key = "train" if name == train_name else ("test" if name == test_name else name)
        splits[key] = Split(x, y, groups)
    if len(image) == 1:
        cols: dict[str, Any] = {"image": image[0], "label": label}
    else:
        cols = {"features": image, "label": label}
    return LoadedData(splits, classes, source, cols)


def _labels(values, mapping, classes, column, split) -> np.ndarray:
    arr = np.asarray(values)
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
        raise UserError(
            f"split {split!r} has label {exc.args[0]!r} that train does not have"
        ) from None


def _inputs(ds, columns: list[str], source: str) -> np.ndarray:
    import datasets

    if len(columns) > 1:  # tabular
        table = ds.with_format("numpy")
        x = np.stack([np.asarray(table[c], dtype=np.float32) for c in columns], axis=1)
        bad = ~np.isfinite(x).all(axis=0)
        if bad.any():
            names = [c for c, b in zip(columns, bad) if b]
            raise UserError(f"feature column(s) {names[:5]} of {source} have empty, NaN or "
                            "infinite values: fill or drop them")
        return x
    col = columns[0]
    feature = ds.features[col]
    if isinstance(feature, datasets.Image):
        raw = ds.cast_column(col, datasets.Image(decode=False))[col]
        return decode_images(raw, source)
    if isinstance(feature, dict) and "bytes" in feature:  # image structs without HF metadata
        return decode_images(ds[col], source)
    try:
        arr = np.asarray(ds.with_format("numpy")[col])
    except Exception:
        arr = np.asarray(ds[col], dtype=object)
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise UserError(
            f"column {col!r} of {source} holds {feature}, not images or numbers; "
            "pass --image-column"
        )
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
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


def decode_images(raw, source: str = "", size: tuple[int, int] | None = None,
                  mode: str | None = None) -> np.ndarray:
    """Decode images (bytes, paths or PIL images) into one ``(N, C, H, W)`` uint8 array.

    Parameters
    ----------
    raw : sequence
        Items as stored by ``datasets.Image(decode=False)`` (``{"bytes", "path"}``), file
        paths, or PIL images.
    size : (int, int), optional
        ``(H, W)`` to resize to; default the first image's size.
    mode : str, optional
        ``"L"`` or ``"RGB"``; default: grey if the first image is grey, else RGB.

    Raises
    ------
    UserError
        When an item cannot be decoded as an image.
    """
    from PIL import Image

    out = []
    for i, item in enumerate(raw):
        try:
            if isinstance(item, Image.Image):
                img = item
            elif isinstance(item, dict):
                img = Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"])
            else:
                img = Image.open(item)
            if mode is None:
                mode = "L" if img.mode in ("L", "1", "I", "I;16", "I;16B", "I;16L", "F", "LA",
                                           "P") and not (
                    img.mode == "P" and "RGB" in img.palette.mode
                ) else "RGB"
            if img.mode.startswith("I;16") or img.mode == "I":
                # 16/32-bit grey: scale to 8 bits (PIL's convert would clip at 255)
                wide = np.asarray(img, dtype=np.float64)
                top = 65535.0 if img.mode.startswith("I;16") else max(float(wide.max()), 1.0)
                img = Image.fromarray(np.clip(wide * (255.0 / top), 0, 255).astype(np.uint8))
            img = img.convert(mode)
            if size is None:
                size = (img.height, img.width)
            if (img.height, img.width) != tuple(size):
                img = img.resize((size[1], size[0]), Image.BILINEAR)
            arr = np.asarray(img, dtype=np.uint8)
        except Exception as exc:
            where = item if isinstance(item, (str, Path)) else f"row {i}"
            raise UserError(f"cannot decode image {where} of {source}: {_one_line(exc)}") from None
        out.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
    if not out:
        raise UserError(f"no images in {source}")
    return np.stack(out)
