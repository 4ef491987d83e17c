"""Load a dataset by name, local path or Hugging Face hub id into plain arrays.

Every source becomes a :class:`LoadedData`: per split, inputs ``x`` of shape ``(N, C, H, W)``
(images, ``uint8`` or ``float32``) or ``(N, D)`` (tabular ``float32``) and labels ``y`` of
shape ``(N,)`` (``int64`` class indices), plus class names and the input normalisation
computed on train. Opening sources and reading their columns lives in
:mod:`fedavg.data.sources`; its public names are importable from here too. No Flower import.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedavg.data import columns
from fedavg.data.columns import IMAGE_NAMES, LABEL_NAMES, detect_columns, is_text, text_or_table
from fedavg.data.labels import label_array, label_classes, numeric_name, similar_labels
from fedavg.data.sources import (  # noqa: F401  (digits_arrays re-exported)
    BUILTIN,
    FILE_BUILDERS,
    IMAGE_SUFFIXES,
    TEST_NAMES,
    decode_images,
    digits_arrays,
    input_array,
    looks_like_path,
    open_source,
)
from fedavg.data.text import make_tokenizer, read_texts, same_tokenization, tokenized
from fedavg.util.errors import UserError

__all__ = [
    "BUILTIN", "FILE_BUILDERS", "IMAGE_NAMES", "IMAGE_SUFFIXES", "LABEL_NAMES", "TEST_NAMES",
    "LoadedData", "Split", "check_kind", "conform", "decode_images", "holdout", "load",
    "looks_like_path", "normalize",
]

log = logging.getLogger(__name__)


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
        ``{"image": ..., "label": ...}`` column names used (``None`` for built-ins);
        ``{"text": ..., "label": ...}`` for text.
    notes : list of str
        Things the user should know (e.g. that a test hold-out was carved).
    tokenizer : fedavg.data.text.HashedTokenizer or fedavg.data.text.FileTokenizer or None
        For text: what turned the text column into the ``(N, L)`` int64 ids of ``x``.
    """

    splits: dict[str, Split]
    classes: list[str]
    source: str
    columns: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tokenizer: Any = None

    def copy(self) -> LoadedData:
        """Return a copy to take splits from and add notes to; the arrays are shared."""
        return dataclasses.replace(self, splits=dict(self.splits), notes=list(self.notes))

    @property
    def kind(self) -> str:
        """``text``, ``image`` (``(C, H, W)`` inputs) or ``tabular`` (``(D,)``)."""
        if self.tokenizer is not None:
            return "text"
        return "image" if self.train.x.ndim == 4 else "tabular"

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
            ``kind`` (:attr:`kind`), ``shape`` (sample shape), ``dtype``; for images and
            tabular data ``scale`` (1/255 for ``uint8``) and ``mean``/``std`` per channel
            or per feature, after scaling; for text the ``tokenizer``'s settings
            (:mod:`fedavg.data.text`), ``vocab_size`` and ``pad_id``.
        """
        x = self.train.x
        if self.tokenizer is not None:
            return {"kind": "text", "shape": list(x.shape[1:]), "dtype": str(x.dtype),
                    "tokenizer": self.tokenizer.spec(),
                    "vocab_size": int(self.tokenizer.vocab_size),
                    "pad_id": int(self.tokenizer.pad_id)}
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
            "kind": self.kind,
            "shape": list(x.shape[1:]),
            "dtype": str(x.dtype),
            "scale": scale,
            "mean": [round(float(v), 6) for v in mean],
            "std": [round(float(v), 6) for v in std],
        }


def normalize(x: "torch.Tensor", spec: dict[str, Any]) -> "torch.Tensor":  # noqa: F821
    """Turn raw inputs into model inputs: ``(x * scale - mean) / std`` per channel/feature.

    Token ids (``kind`` ``text``) pass through as ``int64``.

    Parameters
    ----------
    x : torch.Tensor
        ``(N, C, H, W)`` or ``(N, D)`` raw batch, any numeric dtype; ``(N, L)`` ids.
    spec : dict
        :meth:`LoadedData.input_spec`.

    Returns
    -------
    torch.Tensor
        ``float32`` tensor of the same shape (``int64`` for text).
    """
    import torch

    if spec.get("kind") == "text":
        return x.to(torch.int64)

    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = torch.tensor(spec["mean"], dtype=torch.float32, device=x.device).view(shape)
    std = torch.tensor(spec["std"], dtype=torch.float32, device=x.device).view(shape)
    return (x.to(torch.float32) * float(spec["scale"]) - mean) / std


def data_settings(d) -> dict:
    """Return the settings :func:`load` takes besides the dataset, from a run's ``DataConfig``."""
    return {"image_column": d.image_column, "label_column": d.label_column,
            "partition_by": d.partition_by if d.partitioner == "natural" else None,
            "seed": d.seed, "test_fraction": d.test_fraction, "text_column": d.text_column,
            "tokenizer": d.tokenizer, "max_tokens": d.max_tokens, "hash_buckets": d.hash_buckets}


def load(
    dataset: str,
    *,
    image_column: str | None = None,
    label_column: str | None = None,
    partition_by: str | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    text_column: str | None = None,
    tokenizer: Any = "hashed",
    max_tokens: int = 256,
    hash_buckets: int = 131072,
    feature_columns: list[str] | None = None,
    label_hint: str | None = None,
    input_hint: str | None = None,
    hold_out: bool = True,
    labelled: bool = True,
) -> LoadedData:
    """Load ``dataset`` into arrays with ``train`` and ``test`` splits.

    Parameters
    ----------
    dataset : str
        ``digits`` (scikit-learn's 8x8 digits, offline); a local file (``.parquet``,
        ``.csv``, ``.arrow``, ``.json``) or folder (data files with split names, a
        ``save_to_disk`` folder, or an image folder with one subfolder per class); or a
        Hugging Face hub id such as ``ylecun/mnist``.
    image_column, label_column, text_column : str, optional
        Override column detection.
    partition_by : str, optional
        Keep this column's values (``Split.groups``) for natural partitioning.
    seed, test_fraction : int, float
        Seed and share of train held out as test when the dataset has no test split.
    tokenizer : str or tokenizer
        For text: ``hashed``, a tokenizer path (:func:`fedavg.data.text.make_tokenizer`), or a
        tokenizer object (a saved run's, :func:`fedavg.data.text.from_spec`).
    max_tokens, hash_buckets : int
        Tokens per text; ids of the hashed tokenizer.
    feature_columns, label_hint, input_hint : list of str, str, str, optional
        A saved model's columns, used where the data has them: a tabular model's features,
        taken by name; its label; its image or text column.
    hold_out : bool
        Without a test split, hold out ``test_fraction`` of train as test (a run's data);
        ``False``: ``test`` is the whole train split, the same object (data a saved model
        is scored on or predicts, which it never trained on).
    labelled : bool
        The labels count (a classifier's data: two classes at least); ``False`` for data
        whose labels are dropped (``--distill-data``), of any classes.

    Returns
    -------
    LoadedData

    Raises
    ------
    UserError
        Unknown name, unreadable path, hub unreachable, missing or unusable columns,
        an empty split, a single class (``labelled``).
    """
    if dataset in BUILTIN:
        for flag, col in (("--image-column", image_column), ("--label-column", label_column),
                          ("--partition-by", partition_by), ("--text-column", text_column)):
            if col is not None:
                raise UserError(f"{flag} {col}: the built-in {dataset} dataset has no columns")
        data = _load_digits()
    else:
        notes: list[str] = []
        dsdict = open_source(dataset, notes)
        text = {"column": text_column, "tokenizer": tokenizer, "max_tokens": max_tokens,
                "buckets": hash_buckets}
        data = _from_hf(dsdict, dataset, image_column, label_column, partition_by, text,
                        (feature_columns, label_hint, input_hint))
        data.notes.extend(notes)
    _test_split(data, dataset, hold_out, test_fraction, seed)
    if len(data.classes) < 2 and labelled:
        raise UserError(f"{dataset} has a single class ({data.classes}): a classifier needs at "
                        "least two; check --label-column")
    return data


def _test_split(data: LoadedData, dataset: str, hold_out: bool, test_fraction: float,
                seed: int) -> None:
    """Give ``data`` a test split if it has none: a seeded hold-out, or train itself."""
    if "test" not in data.splits and not hold_out:
        data.splits["test"] = data.splits["train"]
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


def conform(split: Split, source: str, shape: tuple[int, ...] | list[int],
            split_classes: list[str] | None = None,
            classes: list[str] | None = None) -> Split:
    """Check that ``split``'s inputs have ``shape``; relabel it by class name.

    Labels go from indices into ``split_classes`` to indices into ``classes`` (they are left
    alone when either is ``None``). ``source`` names the data in messages.

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
    by_value = {numeric_name(c): i for i, c in enumerate(classes)}  # "1" and "1.0" alike
    by_value.pop(None, None)
    index.update({c: by_value[v] for c in split_classes
                  if c not in index and (v := numeric_name(c)) in by_value})
    unknown = [c for c in split_classes if c not in index]
    if unknown:
        numbers = all(numeric_name(c) is not None for c in split_classes) and not by_value
        raise UserError(f"{source} has labels the model does not know: {unknown[:5]} "
                        f"(model classes: {', '.join(list(classes)[:10])})" + (
                            "; write the labels as these class names" if numbers else ""))
    mapping = np.asarray([index[c] for c in split_classes])
    return Split(split.x, mapping[split.y], split.groups)


def check_kind(input_spec: dict[str, Any], data: LoadedData, source: str) -> None:
    """Check that ``data`` is the kind of input a model with ``input_spec`` takes.

    Images against text, text against tabular and so on; for text also that ``data`` was
    tokenized as the model's inputs were. ``source`` names the data in messages.

    Raises
    ------
    UserError
        Another kind of input, or another tokenization.
    """
    want = input_spec.get("kind") or ("image" if len(input_spec["shape"]) == 3 else "tabular")
    if want != data.kind:
        hint = {"text": "pass a dataset with a text column",
                "image": "pass a dataset of images",
                "tabular": "pass a dataset with the same feature columns"}[want]
        raise UserError(f"this model takes {want} inputs, and {source} is {data.kind}: {hint}")
    if want == "text":
        diff = same_tokenization(input_spec["tokenizer"], data.tokenizer.spec())
        if diff:
            raise UserError(f"{source} is tokenized differently from the model's inputs "
                            f"({diff}); use the run's --tokenizer and --max-tokens")


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
    images, target = digits_arrays()
    # 0..16 intensities -> 0..255 uint8 so digits are handled like any image dataset
    x = np.round(images * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    y = target.astype(np.int64)
    classes = [str(c) for c in range(10)]
    return LoadedData({"train": Split(x, y)}, classes, "digits", {"image": None, "label": None})


def _from_hf(dsdict, source, image_column, label_column, partition_by, text,
             saved=(None, None, None)) -> LoadedData:
    """Turn every split of ``dsdict`` that has the input and label columns into arrays.

    The ``train`` split (else the first one) fixes the columns and the classes; the first
    of :data:`TEST_NAMES` present becomes ``test``; other splits keep their names. ``saved``
    is a saved model's ``(feature_columns, label_hint, input_hint)`` (see :func:`load`).
    """
    names = list(dsdict.keys())
    if not names:
        raise UserError(f"dataset {source!r} has no splits")
    train_name = "train" if "train" in dsdict else names[0]
    test_name = next((n for n in TEST_NAMES if n in dsdict and n != train_name), None)
    train_ds = dsdict[train_name]
    if len(train_ds) == 0:
        raise UserError(f"split {train_name!r} of {source!r} is empty")
    image_column, text["column"] = columns.hinted_input(
        train_ds.features, saved[2], image_column, text["column"], label_column, partition_by)
    label, image = detect_columns(train_ds.features, source, image_column, label_column,
                                  partition_by, text["column"], *saved[:2])
    tokenizer, left_out = None, None
    if len(image) == 1 and is_text(train_ds.features[image[0]]) and text["column"] is None:
        image, left_out = text_or_table(train_ds, label, partition_by, source)
    image, noted = columns.table_inputs(train_ds.features, image, saved[0], label, partition_by)
    if len(image) == 1 and is_text(train_ds.features[image[0]]):
        tokenizer = text["tokenizer"]
        if isinstance(tokenizer, str):
            tokenizer = make_tokenizer(tokenizer, text["max_tokens"], text["buckets"])
    classes, mapping = label_classes(train_ds, label, train_name)
    splits: dict[str, Split] = {}
    notes: list[str] = []
    for name in [train_name] + [n for n in names if n != train_name]:  # others as train
        ds = dsdict[name]
        features = ds.features  # a deep copy on every access: seconds for a wide table
        missing = [c for c in image + [label] if c not in features]
        if missing:
            if name == train_name:
                raise UserError(f"split {name!r} lacks column(s) {missing}")
            continue
        like = None if name == train_name else splits["train"].x.shape[1:]
        if tokenizer:
            texts = read_texts(lambda: ds[image[0]], source)
            notes.extend(empty_texts_note(texts, image[0], name))
            x = tokenized(tokenizer, texts, source)
        else:
            x = input_array(ds, image, source if like is None else f"{source}'s {name} split",
                            like, notes)
        feature = features[label]
        y = label_array(ds[label], mapping, classes, label, name,
                        names=getattr(feature, "names", None) if name != train_name else None)
        groups = None
        if partition_by is not None and partition_by in features:
            groups = np.asarray([str(v) for v in ds[partition_by]])
        key = "train" if name == train_name else ("test" if name == test_name else name)
        splits[key] = Split(x, y, groups)
    notes += similar_labels(classes)
    notes += [note for note in (left_out, noted) if note]
    if tokenizer is not None:
        cols: dict[str, Any] = {"text": image[0], "label": label}
        others = [c for c, f in train_ds.features.items()
                  if is_text(f) and c not in (image[0], label, partition_by)]
        if others and text["column"] is None:
            notes.append(f"text column {image[0]!r}, chosen among the string columns; "
                         f"--text-column to take another ({', '.join(others[:5])})")
    elif len(image) == 1:
        cols = {"image": image[0], "label": label}
    else:
        cols = {"features": image, "label": label}
    return LoadedData(splits, classes, source, cols, notes=notes, tokenizer=tokenizer)


def empty_texts_note(texts: list, column: str, split: str) -> list[str]:
    """Say how many of a split's texts are empty (missing or blank); ``[]`` when none are.

    An empty text trains as a blank input with its label: mostly a data mistake.
    """
    empty = sum(1 for t in texts if t is None or not str(t).strip())
    if not empty:
        return []
    return [f"{empty} of {len(texts)} texts ({empty / len(texts):.0%}) in column {column!r} of "
            f"the {split} split are empty: they train and test as blank inputs; drop those "
            "rows if they are missing data"]
