"""Self-describing model artifacts: ``model.safetensors`` (weights) + ``model.json`` (metadata).

The metadata holds everything needed to rebuild and use the model with no other flag: model
name and arguments, class names, input normalisation, dataset, strategy, rounds and metrics.
Weights never go through pickle. Files are written atomically (temporary file + rename), so an
interrupted run leaves the previous round's model intact.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from fedavg.config.values import finite_number
from fedavg.data.text import save_for
from fedavg.run.output import START  # noqa: F401  (re-exported beside WEIGHTS and META)
from fedavg.util.atomic import atomic_write
from fedavg.util.errors import UserError

WEIGHTS = "model.safetensors"
META = "model.json"
FORMAT = "fedavg-model/1"


def plain(value: Any) -> Any:
    """Return ``value`` with every NaN or infinite float (in dicts and lists) as ``None``.

    (Python's ``NaN`` and ``Infinity`` are no JSON: strict readers, ``jq`` among them,
    refuse them.)
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically; NaN and infinities as ``null``."""

    def _write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(plain(obj), fh, indent=2, sort_keys=False, allow_nan=False)
            fh.write("\n")

    atomic_write(Path(path), _write)


def storable(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return tensors safetensors can store: detached, on the CPU, contiguous, none shared.

    A model with tied weights (two names, one storage, e.g. an embedding and an output
    layer) has a state dict that safetensors refuses; every later name of a storage already
    seen gets its own copy. Loading it back into the model ties them again.
    """
    out, seen = {}, set()
    for key, value in state_dict.items():
        tensor = value.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def tensor_digest(tensors: Mapping[str, torch.Tensor], text: str = "") -> str:
    """Return the checksum of saved models and checkpoints (SHA-256, hex).

    It covers ``text`` and every tensor's name, dtype, shape and bytes: a flipped bit shows.
    """
    import hashlib

    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return h.hexdigest()


def save(directory: str | Path, state_dict: Mapping[str, torch.Tensor],
         meta: dict[str, Any]) -> Path:
    """Save weights and metadata into ``directory``.

    Parameters
    ----------
    directory : path
        Created if missing.
    state_dict : mapping of str to torch.Tensor
        Weights; tensors are made contiguous and moved to the CPU, tied ones copied
        (:func:`storable`).
    meta : dict
        JSON-serialisable metadata; must hold ``model`` (``{"name", "args"}``), ``classes``
        and ``input`` (see :meth:`fedavg.data.load.LoadedData.input_spec`).

    Returns
    -------
    pathlib.Path
        The directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = storable(state_dict)
    # pinned in model.json (safetensors writes metadata keys in no fixed order: one key only)
    meta = {"format": FORMAT, **meta,
            "weights_sha256": tensor_digest(tensors, _pinned_settings(meta))}

    save_for(meta.get("input", {}), directory)  # a text model's tokenizer.json, first
    atomic_write(directory / WEIGHTS,
                  lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    write_json(directory / META, meta)
    return directory


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``tensors`` to the safetensors file ``path`` atomically (a model's extra record).

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    stored = storable(tensors)
    atomic_write(path, lambda tmp: save_file(stored, tmp, metadata={"format": FORMAT}))
    return path


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file of tensors saved by :func:`save_tensors`; nothing unpickled.

    Raises
    ------
    UserError
        The file is missing or not a readable safetensors file, naming it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({str(exc).splitlines()[0] if str(exc) else exc})"
                        ) from None


MEMBER_PREFIX = "member."


def save_ensemble(directory: str | Path, members: list[Mapping[str, torch.Tensor]],
                  weights: list[float], meta: dict[str, Any]) -> Path:
    """Save an output ensemble as ONE artifact.

    Member ``i``'s tensors are stored under ``member.<i>.<key>`` in ``model.safetensors``;
    ``model.json`` gets ``kind: "ensemble"`` and ``member_weights``. :func:`fedavg.load_model`
    rebuilds it as a :class:`fedavg.models.registry.EnsembleModel`.
    """
    flat = {f"{MEMBER_PREFIX}{i}.{k}": v for i, sd in enumerate(members) for k, v in sd.items()}
    return save(directory, flat, {**meta, "kind": "ensemble", "members": len(members),
                                  "member_weights": [float(w) for w in weights]})


def split_members(state_dict: Mapping[str, torch.Tensor], count: int) -> list[dict]:
    """Inverse of :func:`save_ensemble`'s key layout: one state dict per member.

    Raises
    ------
    UserError
        Keys that do not follow the layout, or a member count that does not match.
    """
    members: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for key, value in state_dict.items():
        head, _, rest = key[len(MEMBER_PREFIX):].partition(".")
        if not key.startswith(MEMBER_PREFIX) or not head.isdigit() or int(head) >= count:
            raise UserError(f"ensemble weights have an unexpected key {key!r}; the artifact "
                            "is damaged")
        members[int(head)][rest] = value
    if any(not m for m in members):
        raise UserError("ensemble artifact lacks the weights of some members; it is damaged")
    return members


#: The kinds of input a model description may name (``input.kind``).
INPUT_KINDS = ("image", "tabular", "text")


def _meta_problem(meta: dict[str, Any]) -> str | None:
    """Return what is wrong with a model description, or ``None``."""
    model, classes, spec = meta["model"], meta["classes"], meta["input"]
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        return "'model' must be an object with a 'name'"
    if not isinstance(classes, list) or not classes or \
            not all(isinstance(c, str) for c in classes):
        return "'classes' must be a non-empty list of names"
    outputs = model.get("num_classes")
    if not isinstance(outputs, int) or isinstance(outputs, bool) or outputs < 1:
        return f"'model.num_classes' must be a whole number >= 1 (got {outputs!r})"
    if outputs != len(classes):
        return f"'classes' has {len(classes)} names, the model {outputs} outputs"
    if len(set(classes)) != len(classes):
        return "'classes' names must be distinct"
    if not isinstance(spec, dict):
        return "'input' must be an object"
    if spec.get("kind") not in (None, *INPUT_KINDS):
        return f"'input.kind' must be one of {', '.join(INPUT_KINDS)}"
    shape = spec.get("shape")
    if not isinstance(shape, list) or not shape or \
            not all(isinstance(s, int) and s > 0 for s in shape):
        return "'input.shape' must be a list of positive integers"
    problem = _text_problem(spec, model) if spec.get("kind") == "text" else \
        _scale_problem(spec)
    if problem:
        return problem
    if isinstance(model.get("input_shape"), list) and model["input_shape"] != shape:
        return (f"'model.input_shape' {model['input_shape']} differs from 'input.shape' "
                f"{shape}")
    if "dataset" in meta and not isinstance(meta["dataset"], dict):
        return "'dataset' must be an object"
    if meta.get("kind") == "ensemble":
        weights = meta.get("member_weights")
        if not isinstance(weights, list) or not weights or \
                not all(finite_number(w) and w >= 0 for w in weights) \
                or not sum(weights) > 0:
            return "'member_weights' must be a list of numbers >= 0 with a positive sum"
    return None


def _scale_problem(spec: dict[str, Any]) -> str | None:
    """Return what is wrong with an image or tabular input normalisation, or ``None``."""
    if not finite_number(spec.get("scale")) or spec["scale"] <= 0:
        return "'input.scale' must be a number > 0"
    width = spec["shape"][0]
    for key in ("mean", "std"):
        values = spec.get(key)
        if not isinstance(values, list) or len(values) != width or \
                not all(finite_number(v) for v in values):
            return f"'input.{key}' must hold {width} numbers"
    if not all(v > 0 for v in spec["std"]):
        return "'input.std' values must be > 0"
    return None


def _text_problem(spec: dict[str, Any], model: dict[str, Any]) -> str | None:
    """Return what is wrong with a text model's input description, or ``None``."""
    tok = spec.get("tokenizer")
    if len(spec["shape"]) != 1:
        return "'input.shape' of a text model must be [tokens]"
    if not isinstance(tok, dict) or tok.get("kind") not in ("hashed", "file"):
        return "'input.tokenizer' must describe a hashed or file tokenizer"
    if tok.get("max_length") != spec["shape"][0]:
        return "'input.tokenizer.max_length' differs from 'input.shape'"
    for key in ("vocab_size", "pad_id"):
        if not isinstance(spec.get(key), int) or isinstance(spec[key], bool) or spec[key] < 0:
            return f"'input.{key}' must be an integer >= 0"
    if spec["pad_id"] >= spec["vocab_size"]:
        return "'input.pad_id' must be below 'input.vocab_size'"
    if tok["kind"] == "hashed" and (tok.get("buckets") != spec["vocab_size"]
                                    or tok.get("ngrams") not in (1, 2)):
        return "'input.tokenizer' (buckets, ngrams) does not match 'input.vocab_size'"
    args = model.get("args") if isinstance(model.get("args"), dict) else {}
    for key in ("vocab_size", "pad_id"):
        if key in args and args[key] != spec[key]:
            return f"'model.args.{key}' differs from 'input.{key}'"
    return None


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _names(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def fit_problem(state: Mapping[str, torch.Tensor],
                expected: Mapping[str, torch.Tensor]) -> str | None:
    """Say why ``state`` cannot be loaded into a model whose state dict is ``expected``.

    Parameters
    ----------
    state : mapping of str to torch.Tensor
        Loaded weights.
    expected : mapping of str to torch.Tensor
        The freshly built model's ``state_dict()``.

    Returns
    -------
    str or None
        One line naming the first few missing and unexpected tensors, else the first tensor
        of another shape (its shape and the expected one) or of integer values where the
        model has floats (or the reverse); ``None`` when ``state`` fits.
    """
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} tensor(s) the model has: {_names(missing)}")
        if unexpected:
            parts.append(f"has {len(unexpected)} tensor(s) the model does not: "
                         f"{_names(unexpected)}")
        return "; ".join(parts)
    for key, want in expected.items():
        got = state[key]
        if _shape(got) != _shape(want):
            return (f"tensor {key!r} has shape {_shape(got)}, the model expects "
                    f"{_shape(want)}")
        if got.is_floating_point() != want.is_floating_point():
            return f"tensor {key!r} holds {got.dtype} values, the model expects {want.dtype}"
    return None


def _nonfinite(state: Mapping[str, torch.Tensor]) -> str | None:
    """Return the first floating tensor of ``state`` with NaN or Inf values, else ``None``."""
    return next((k for k, t in state.items()
                 if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)


def load(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load ``(state_dict, meta)`` saved by :func:`save`.

    Nothing is unpickled: weights come from safetensors, metadata from JSON.

    Raises
    ------
    UserError
        Missing folder or files, unreadable or corrupt weights or metadata (one line naming
        the file and the problem), or weights holding NaN or infinite values.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    if directory.is_file():
        raise UserError(f"{directory} is a file, not a model folder: pass its folder, "
                        f"{directory.parent} (a run's --output folder)")
    if not directory.is_dir():
        raise UserError(f"no such model folder: {directory} (pass a run's --output folder)")
    weights, meta_path = directory / WEIGHTS, directory / META
    for path in (weights, meta_path):
        if not path.is_file():
            raise UserError(f"{directory} has no {path.name}: is it a fedavg run's output folder?")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{meta_path} is not valid JSON ({exc}); the artifact is damaged") from None
    problem = _format_problem(meta)
    if problem:
        raise UserError(f"{meta_path} {problem}")
    for key in ("model", "classes", "input"):
        if key not in meta:
            raise UserError(f"{meta_path} lacks {key!r}; the artifact is damaged")
    problem = _meta_problem(meta)
    if problem:
        raise UserError(f"{meta_path}: {problem}; the artifact is damaged")
    try:
        state_dict = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"{weights} is not a readable safetensors file ({first[:160]}); the artifact is "
            "damaged: re-run or use another checkpoint"
        ) from None
    pinned = meta.get("weights_sha256")  # none in models saved before it was
    # (a LoRA model saved before its settings were pinned has the digest of its weights alone)
    if pinned is not None and pinned != tensor_digest(state_dict, _pinned_settings(meta)) \
            and not (_pinned_settings(meta) and pinned == tensor_digest(state_dict)):
        edited = (", or its LoRA settings (model.lora) were edited" if _pinned_settings(meta)
                  else "")
        raise UserError(f"{weights} does not match the SHA-256 that {meta_path} records: it "
                        f"is damaged, or another run's model file{edited}: put back this "
                        "run's, or re-run")
    bad = _nonfinite(state_dict)
    if bad is not None:
        raise UserError(f"{weights}: tensor {bad!r} holds NaN or infinite values (training "
                        "diverged or the file is damaged); re-train, e.g. with a lower --lr, "
                        "or use another checkpoint")
    return state_dict, meta


def _pinned_settings(meta: Mapping[str, Any]) -> str:
    """Return the settings a model's weights digest also covers (``""``: none).

    A LoRA model's adapter settings (rank, alpha, targets, merge, base) change what its
    weights compute: an edited alpha must not evaluate silently.
    """
    model = meta.get("model")
    lora = model.get("lora") if isinstance(model, Mapping) else None
    return "" if not lora else "lora:" + json.dumps(lora, sort_keys=True, default=str)


def _format_problem(meta) -> str | None:
    """Say why ``meta`` is not a model description this version reads (``None``: it is)."""
    if not isinstance(meta, dict):
        return "is not a fedavg model description (a JSON object with 'format': " \
               f"{FORMAT!r})"
    fmt = meta.get("format")
    name, _, version = str(fmt).partition("/")
    if name != "fedavg-model" or not (version.isascii() and version.isdigit()) \
            or int(version) < 1:
        return f"is not a fedavg model description: its 'format' is {fmt!r}, not {FORMAT!r}"
    if int(version) > int(FORMAT.partition("/")[2]):
        return (f"is format {fmt}, written by a newer fedavg; this one reads {FORMAT}: "
                "upgrade fedavg to load it")
    return None


def save_merged(output: str | Path, merged, meta: dict[str, Any]) -> None:
    """Write a merge result (``strategies.Merged``) as a model artifact.

    A single network goes through :func:`save`, an output ensemble through
    :func:`save_ensemble`; the strategy's ``info`` is kept as ``merge_info``.
    """
    if merged.info:
        meta = {**meta, "merge_info": json.loads(json.dumps(merged.info, default=str))}
    if merged.is_ensemble:
        save_ensemble(output, merged.members, merged.member_weights, meta)
    else:
        save(output, merged.state_dict, meta)
