"""Load a saved model from its artifacts alone; evaluate it on a dataset; predict on inputs."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fedavg.data.images import fit_images, fitted_note
from fedavg.data.load import BUILTIN, check_kind, conform, decode_images, load
from fedavg.data.overlap import overlap_note
from fedavg.data.sources import saved_load_args
from fedavg.data.text import from_spec, model_tokenizer, text_inputs
from fedavg.models.evaluation import evaluate as _evaluate
from fedavg.models.evaluation import predict_proba, resolve_device
from fedavg.models.registry import EnsembleModel, ModelSpec
from fedavg.models.sources import saved_model_name
from fedavg.run import checkpoint
from fedavg.use.inputs import check_inputs, collect, input_notes, table_rows, text_table_rows
from fedavg.util.errors import NoLabelColumn, UserError


def load_model(directory: str | Path, device: str = "cpu",
               model: str | None = None) -> torch.nn.Module:
    """Rebuild the model saved in ``directory`` (a run's output folder).

    Parameters
    ----------
    directory : path
        Holds ``model.safetensors`` and ``model.json``.
    device : str
        Where to put the model.
    model : str, optional
        For a model built by your code: that code (``file.py:function``, the file where it
        is now, or ``module:function``). A saved model never makes fedavg import code by
        itself (see :func:`fedavg.models.sources.saved_model_name`).

    Returns
    -------
    torch.nn.Module
        In eval mode; maps normalised ``(N, *input_shape)`` floats to ``(N, K)`` logits.
        Its ``fedavg_meta`` attribute is the ``model.json`` content (classes, input
        normalisation, ...); :func:`fedavg.data.load.normalize` applies the normalisation.

    Raises
    ------
    UserError
        Missing or damaged artifacts, weights that do not fit the described model, or a
        model built by code that ``model`` does not name.
    """
    state, meta = checkpoint.load(directory)
    net = model_from_artifacts(state, meta, str(directory), code=model)
    net.fedavg_meta = meta
    return net.to(resolve_device(device)).eval()


def _build(spec: Any, where: str, code: str | None = None) -> torch.nn.Module:
    try:
        name = saved_model_name(str(spec["name"]), code, where)
        return ModelSpec.from_dict({**spec, "name": name}).build()
    except UserError as exc:
        raise UserError(f"{where}/{checkpoint.META}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}/model.json has an unusable model entry ({exc!r})") from None


def _fitted(spec: dict, state: dict, where: str, member: int | None = None,
            code: str | None = None) -> torch.nn.Module:
    """Build the model ``spec`` describes and load ``state``; a mismatch is one line.

    The shapes are compared on a weightless copy (meta device) first, so a tampered
    description cannot make us allocate more than the weights file holds.
    """
    with torch.device("meta"):
        skeleton = _build(spec, where, code)
    problem = checkpoint.fit_problem(state, skeleton.state_dict())
    model = None
    if problem is None:
        model = _build(spec, where, code)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # not foreseen by fit_problem: its first line
            problem = str(exc).strip().splitlines()[0][:200]
    if problem is not None:
        of = "" if member is None else f" (ensemble member {member})"
        raise UserError(f"{where}/{checkpoint.WEIGHTS}{of} does not fit the "
                        f"{spec['name']!r} model described in {checkpoint.META}: {problem}")
    return model


def model_from_artifacts(state: dict, meta: dict, where: str = "the model",
                         code: str | None = None) -> torch.nn.Module:
    """Build the network (or :class:`~fedavg.models.registry.EnsembleModel`) described by ``meta``.

    ``code``: for a model built by user code, that code as the loader named it (``--model``).

    Raises
    ------
    UserError
        A description that cannot be built, weights that do not fit it, or user code that
        ``code`` does not name.
    """
    spec = meta["model"]
    if not isinstance(spec, dict):
        raise UserError(f"{where}/model.json has an unusable model entry")
    if meta.get("kind") == "ensemble":
        weights = meta.get("member_weights")
        if not isinstance(weights, list) or not weights:
            raise UserError(f"{where}/model.json lacks member_weights; the artifact is damaged")
        try:
            states = checkpoint.split_members(state, len(weights))
        except UserError as exc:
            raise UserError(f"{where}/{checkpoint.WEIGHTS}: {exc}") from None
        members = [_fitted(spec, sd, where, member=i, code=code)
                   for i, sd in enumerate(states)]
        try:
            return EnsembleModel(members, weights)
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
    return _fitted(spec, state, where, code=code)


def evaluate_model(
    directory: str | Path,
    dataset: str | None = None,
    *,
    split: str = "test",
    image_column: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    device: str = "auto",
    batch_size: int = 512,
    model: str | None = None,
) -> dict[str, Any]:
    """Compute the accuracy and loss of a saved model on a dataset split.

    Parameters
    ----------
    directory : path
        A run's output folder.
    dataset : str, optional
        Dataset name, path or hub id; default: the one the model was trained on.
    split : str
        ``test`` (the same seeded hold-out as in training when the dataset has no test
        split), ``train`` or another split name.
    image_column, text_column, label_column : str, optional
        The input column (images or a table's feature; a text model's text) and the label
        column; default: as in training for its dataset, else detected.
    model : str, optional
        For a model built by your code: that code (see :func:`load_model`).

    Returns
    -------
    dict
        ``accuracy`` (fraction), ``loss`` (mean cross-entropy, nats), ``num_examples``,
        ``split``, ``dataset`` (a local path made absolute), ``notes`` (e.g. that samples
        of the split are also train samples: :mod:`fedavg.data.overlap`).

    Raises
    ------
    UserError
        Bad artifacts, dataset, split, columns, labels or input shapes.
    TypeError
        ``batch_size`` is not a whole number >= 1.
    """
    _check_batch_size(batch_size)
    net = load_model(directory, device="cpu", model=model)
    held = evaluation_data(net.fedavg_meta, directory, dataset, split=split,
                           image_column=image_column, text_column=text_column,
                           label_column=label_column)
    return score(net, held, device=device, batch_size=batch_size)


def evaluation_data(meta: dict[str, Any], directory: str | Path, dataset: str | None = None,
                    *, split: str = "test", image_column: str | None = None,
                    text_column: str | None = None,
                    label_column: str | None = None) -> tuple[str, Any, str, Any]:
    """Load a split for the saved model that ``meta`` describes, shaped as it reads inputs.

    Parameters
    ----------
    meta : dict
        The model's ``model.json``.
    directory : path
        Its folder (a text model's tokenizer).
    dataset, split, image_column, text_column, label_column
        As :func:`evaluate_model`.

    Returns
    -------
    tuple
        ``(source, data, split, part)``: the dataset as named, loaded
        (``fedavg.data.load.LoadedData``), the split's name, and that split checked against the
        model's inputs and classes and shaped for it (``fedavg.data.load.Split``).

    Raises
    ------
    UserError
        Bad dataset, split, columns, labels or input shapes.
    """
    ds_meta = meta.get("dataset", {})
    source = dataset or ds_meta.get("source")
    if not source:
        raise UserError("pass --dataset: the model does not record its dataset")
    args = saved_load_args(meta, source, whole=True)
    if image_column or text_column:  # the user's choice over the run's
        args.update(image_column=image_column, text_column=text_column, feature_columns=None)
    if label_column:
        args["label_column"] = label_column
    data = load(source, tokenizer=model_tokenizer(meta, directory), **args)
    if split not in data.splits:
        raise UserError(f"{source} has no split {split!r}; splits: {', '.join(data.splits)}")
    check_kind(meta["input"], data, source)
    part = conform(_model_images(data.splits[split], meta), source, meta["input"]["shape"],
                   data.classes, meta["classes"])
    return source, data, split, part


def _model_images(split, meta: dict[str, Any]):
    """``split`` with its images made the grey or colour size the model takes (if images)."""
    if meta["input"].get("dtype") != "uint8":  # float arrays: as they are, or refused
        return split
    return dataclasses.replace(split, x=fit_images(split.x, tuple(meta["input"]["shape"])))


def score(net: torch.nn.Module, held: tuple[str, Any, str, Any], device: str = "auto",
          batch_size: int = 512) -> dict[str, Any]:
    """Accuracy and loss of ``net`` (from :func:`load_model`) on :func:`evaluation_data`.

    Returns
    -------
    dict
        As :func:`evaluate_model`.
    """
    source, data, split, part = held
    res = _evaluate(net, part.x, part.y, net.fedavg_meta["input"], batch_size=batch_size,
                    device=resolve_device(device))
    whole = data.splits["test"] is data.splits["train"]  # one split, nothing held out
    leak = None if split == "train" or whole else overlap_note(data.splits[split].x,
                                                               data.train.x, split, source)
    if source not in BUILTIN and Path(source).expanduser().exists():
        source = str(Path(source).expanduser().resolve())  # one form in text and JSON
    fitted = fitted_note(data.splits[split].x.shape[1:], part.x.shape[1:],
                         f"the {split} split's inputs")
    notes = [n for n in (fitted, leak) if n]
    return {**res, "split": split, "dataset": source, "notes": notes}


def _check_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise TypeError(f"batch_size must be a whole number >= 1, got {batch_size!r}")


def predict(
    directory: str | Path,
    inputs: Sequence[str],
    *,
    split: str = "test",
    device: str = "auto",
    batch_size: int = 512,
    on_note: Callable[[str], None] | None = None,
    text: bool = False,
    model: str | None = None,
    image_column: str | None = None,
    text_column: str | None = None,
) -> list[dict[str, Any]]:
    """Predict classes for images, folders of images, texts or datasets with a saved model.

    Images are resized to the model's input size and converted to its channels; when that
    changes them a lot (more than :data:`RESIZE_NOTE_FACTOR` in height or width, or colour
    to grey and back) one summary line per kind of change goes to ``on_note`` (default: a
    ``UserWarning``), since such predictions are often wrong.

    Parameters
    ----------
    directory : path
        A run's output folder.
    inputs : sequence of str
        Image files; folders (searched recursively for images); dataset files, folders,
        names or hub ids (their ``split`` is used). For a text model: ``.txt`` files (one
        text per line) or datasets; with ``text``, the texts themselves.
    split : str
        Split of dataset inputs.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    batch_size : int
        Samples per forward pass.
    on_note : callable, optional
        Receives each note (one line each): about changed inputs, and about predictions
        from NaN or infinite model outputs.
    text : bool
        Take every input as a text to classify (a text model only).
    model : str, optional
        For a model built by your code: that code (see :func:`load_model`).
    image_column, text_column : str, optional
        The input column of dataset inputs (default: the run's, where the data has it).

    Returns
    -------
    list of dict
        One per sample: ``input``, ``prediction`` (class name), ``class_index``,
        ``confidence`` (softmax probability of the prediction).

    Raises
    ------
    UserError
        Missing inputs, undecodable images, inputs the model cannot take.
    TypeError
        ``inputs`` is a single string, or ``batch_size`` is not a whole number >= 1.
    """
    check_inputs(inputs)
    _check_batch_size(batch_size)
    net = load_model(directory, device="cpu", model=model)
    meta = net.fedavg_meta
    dev = resolve_device(device)
    columns = {"image_column": image_column, "text_column": text_column}
    note = on_note or (lambda n: warnings.warn(n, UserWarning, stacklevel=3))
    if meta["input"].get("kind") == "text":
        batches = _text_batches(inputs, text, split, meta, directory, note, columns)
    elif text:
        kind = meta["input"].get("kind", "image")
        raise UserError(f"this model takes {kind} inputs, not text: pass " + (
            "image files, folders or a dataset" if kind == "image" else "a dataset (a table)"))
    else:
        items = collect(inputs)
        _note_unused_columns(items, columns, note)
        batches = [_image_batch([p for kind, p in items if kind == "image"], meta, note)]
        batches += [_dataset_batch(source, split, meta, note, columns=columns)
                    for kind, source in items if kind == "dataset"]
    return [row for b in batches if b is not None
            for row in _rows(net, *b, meta, batch_size=batch_size, device=dev, note=note)]


def _rows(net, x, names: list[str], meta: dict[str, Any], *, batch_size: int, device,
          note: Callable[[str], None]) -> list[dict[str, Any]]:
    """:func:`predict`'s rows for one batch of inputs ``x`` named ``names``."""
    proba = predict_proba(net, x, meta["input"], batch_size=batch_size, device=device)
    conf, idx = proba.max(dim=1)
    bad = int((~torch.isfinite(proba).all(dim=1)).sum())
    if bad:
        note(f"{bad} of {len(names)} prediction(s) come from NaN or infinite model outputs "
             "(the model's weights or these inputs hold them): their class means nothing")
    return [{"input": name, "prediction": meta["classes"][int(k)], "class_index": int(k),
             "confidence": round(float(c), 6)} for name, k, c in zip(names, idx, conf)]


def _image_batch(images: list[Path], meta: dict[str, Any], on_note: Callable[[str], None]):
    """Decode image files for the model of ``meta``: ``(x, names)``, or ``None``."""
    if not images:
        return None
    shape = tuple(meta["input"]["shape"])
    if len(shape) != 3:
        raise UserError("this model takes feature vectors, not images: pass a dataset")
    for note in input_notes(images, shape):
        on_note(note)
    mode = "L" if shape[0] == 1 else "RGB"
    x = decode_images([str(p) for p in images], "the inputs", size=shape[1:], mode=mode)
    if meta["input"].get("dtype") != "uint8":  # trained on float arrays: match their range
        spec = meta["input"]  # a channel mean above 1.5: pixel values such as 0..255
        wide = max(float(m) for m in spec["mean"]) / float(spec.get("scale", 1.0)) > 1.5
        on_note(f"the model was trained on arrays of floats, not image files; the images are "
                f"given as {'0..255' if wide else '0..1'} values, the range of its training "
                "data")
        x = x.astype(np.float32) / (1.0 if wide else 255.0)
    return x, [str(p) for p in images]


def _text_batches(inputs: Sequence[str], literal: bool, split: str, meta: dict[str, Any],
                  directory: str | Path, on_note: Callable[[str], None],
                  columns: dict[str, str]) -> list:
    """Tokenize texts (and load datasets) for a text model: ``[(x, names), ...]``."""
    files = [t for t in inputs if literal and len(t) < 4096 and Path(t).expanduser().is_file()]
    if files:
        on_note(f"{files[0]} is a file, classified as the text of its name because of --text; "
                "leave --text out to classify the lines of a .txt file")
    tokenizer = from_spec(meta["input"]["tokenizer"], directory)
    items = text_inputs(inputs, literal)
    _note_unused_columns(items, columns, on_note)
    texts = [t for kind, t in items if kind == "text"]
    batches = [(tokenizer.encode(texts), texts)] if texts else []
    return batches + [_dataset_batch(source, split, meta, on_note, tokenizer, columns)
                      for kind, source in items if kind == "dataset"]


def _note_unused_columns(items: list, columns: dict[str, str | None],
                         on_note: Callable[[str], None]) -> None:
    """Say so when an input column is given but no input is a dataset (nothing uses it)."""
    given = [f"--{name.replace('_', '-')}" for name, value in columns.items() if value]
    if given and not any(kind == "dataset" for kind, _ in items):
        on_note(f"{' and '.join(given)} only chooses the input column of dataset inputs; "
                "none of these inputs is one, so it is not used")


def _dataset_batch(source: str, split: str, meta: dict[str, Any],
                   on_note: Callable[[str], None], tokenizer: Any = "hashed",
                   columns: dict[str, str] | None = None):
    """Load the ``split`` of a dataset, checked against the model's inputs: ``(x, names)``.

    A single table (one file, one split) given to a tabular model, or to a text model and
    without a label column, is predicted whole, row by row. ``columns``: the user's input
    column, if any.
    """
    args = saved_load_args(meta, source, whole=True)
    if columns and any(columns.values()):  # the user's choice over the run's
        args.update(columns, feature_columns=None)
    features = args.get("feature_columns")
    if features and (rows := table_rows(source, features)) is not None:
        return rows
    try:
        data = load(source, tokenizer=tokenizer, **args)
    except NoLabelColumn:
        if meta["input"].get("kind") == "text" and (rows := text_table_rows(
                source, tokenizer, args.get("text_column") or args.get("input_hint"),
                given=bool(columns and columns.get("text_column")))) is not None:
            return rows  # a single table of texts without labels: every row
        raise UserError(f"{source}: a dataset input needs a label column (its {split} split "
                        "is predicted); give unlabelled inputs as image files or folders, or "
                        "as a .txt file of texts, one per line") from None
    if split not in data.splits:
        raise UserError(f"{source} has no split {split!r}; splits: {', '.join(data.splits)}")
    check_kind(meta["input"], data, source)
    part = conform(_model_images(data.splits[split], meta), source, meta["input"]["shape"])
    if note := fitted_note(data.splits[split].x.shape[1:], part.x.shape[1:],
                           f"{source}'s {split} inputs"):
        on_note(note)
    if data.splits["test"] is data.splits["train"]:  # one split, used whole: rows in order
        return part.x, [f"{source}#row{i}" for i in range(len(part))]
    return part.x, [f"{source}#{split}[{i}]" for i in range(len(part))]
