"""Models from outside the registry: ``torchvision:NAME``, ``hf:PATH`` and your own code.

:func:`fedavg.models.registry.build_model` sends every model name holding a ``:`` here:

- ``torchvision:NAME``: ``torchvision.models.get_model(NAME, weights=None, num_classes=K)``,
  any classification model (``torchvision.models.list_models(module=torchvision.models)``).
  With ``--pretrained default`` the run's initial model is built with ``weights="DEFAULT"``
  (downloaded once into torch's cache), with ``--pretrained PATH`` it loads a local weights
  file (safetensors, or a state dict read with ``weights_only=True``); either way its last
  ``Linear`` is replaced by one with K outputs.
- ``hf:PATH``: a local Hugging Face ``transformers`` folder (``config.json``, optionally
  ``model.safetensors``), built by :mod:`fedavg.models.sources.hf`.
- ``package.module:function`` or ``path/to/file.py:function``: ``function(input_shape,
  num_classes, **args) -> torch.nn.Module`` from your own code.

Image models from torchvision and Hugging Face are wrapped in
:class:`~fedavg.models.sources.images.ImageAdapter`, which
repeats a 1-channel input to the 3 channels their stem takes (no new parameters) and resizes
inputs (bilinear) only when a trial forward pass at the data's size fails; what was adapted
is said in the model's ``fedavg_notes`` (shown with the run's plan, kept in ``model.json``).

Builder arguments (``--model-arg KEY=VALUE``) are checked against what the builder takes
before it is called. ``vocab_size`` and ``pad_id`` (:data:`DATA_ARGS`) describe text data;
they are passed to a builder only when it takes them.

Only the run's initial model loads weights (pretrained torchvision weights, an ``hf:``
folder's); nodes and later loads build the architecture and receive the weights as a state
dict. A node imports model code only when its operator named it (:func:`node_model_name`),
and loading a saved model only when its user did (:func:`saved_model_name`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from fedavg.models.sources.args import DATA_ARGS, Takes, first_line, parse_model_args
from fedavg.models.sources.hf import build_hf, stored_config, weights_note
from fedavg.models.sources.hf import weights_file as hf_weights_file
from fedavg.models.sources.images import ImageAdapter, adapt_images, build_torchvision, trial
from fedavg.models.sources.user_code import build_user, code_ref, user_builder
from fedavg.util.errors import UserError

__all__ = [
    "DATA_ARGS", "FORMS", "ImageAdapter", "Takes", "absolute_name", "adapt_images", "build",
    "build_torchvision", "build_user", "canonical", "check_output", "first_line",
    "hf_weights_file",
    "node_model", "node_model_name", "parse_model_args", "saved_model_name", "source_kind",
    "names_same_code", "source_notes", "stored_args", "trial", "user_builder",
]

#: ``fedavg models``: the forms beside the registered names, with an example each.
FORMS = (
    ("torchvision:NAME", "any torchvision classification model by name, head sized to the "
     "classes; --pretrained starts from its ImageNet weights (downloaded). "
     "Example: --model torchvision:mobilenet_v3_small"),
    ("hf:PATH", "a local Hugging Face transformers folder (config.json, optional "
     "model.safetensors): image or text classification; needs transformers (the [hf] extra). "
     "Example: --model hf:models/tiny-vit"),
    ("module:function", "your own builder function(input_shape, num_classes, **args) -> "
     "nn.Module, in an importable module or a .py file. Example: --model my_models.py:build "
     "--model-arg hidden=64 (fedavg node needs the same --model to run it)"),
)


def source_kind(name: str) -> str:
    """Say where model ``name`` comes from.

    Returns
    -------
    str
        ``"registry"`` (no colon), ``"torchvision"``, ``"hf"`` or ``"code"``
        (``module:function`` or ``file.py:function``).
    """
    if ":" not in name:
        return "registry"
    prefix = name.split(":", 1)[0]
    return prefix if prefix in ("torchvision", "hf") else "code"


def canonical(name: str) -> str:
    """Return ``name`` as stored in the model spec: a file or ``hf:`` folder made absolute.

    Raises
    ------
    UserError
        A ``module:function`` name that names no function, or an empty ``hf:`` path.
    """
    kind = source_kind(name)
    if kind == "hf":
        path = name[3:]
        if not path.strip():
            raise UserError("--model hf:PATH needs the model folder, e.g. hf:models/tiny-vit")
        return "hf:" + str(Path(path).expanduser().resolve())
    if kind == "code":
        where, func, is_file = code_ref(name)
        if is_file:
            return f"{Path(where).expanduser().resolve()}:{func}"
    return name


def absolute_name(name: str) -> str:
    """Like :func:`canonical` for an existing file or folder; ``name`` unchanged otherwise."""
    try:
        full = canonical(name)
    except UserError:
        return name
    path = full[3:] if source_kind(full) == "hf" else full.rpartition(":")[0]
    return full if full != name and Path(path).exists() else name


def stored_args(name: str, input_shape: tuple[int, ...], num_classes: int,
                args: Mapping[str, Any]) -> dict[str, Any]:
    """Return the builder arguments to store in the spec of model ``name``.

    An ``hf:`` model adds its whole configuration (``hf_config``), so that it can be rebuilt
    where the folder is not; the others store ``args`` as given.
    """
    if source_kind(name) == "hf":
        return stored_config(name, num_classes, args)
    return dict(args)


def source_notes(name: str, pretrained: str | None = None) -> list[str]:
    """Say which weights the run's initial model of ``name`` starts from, when not random.

    Raises
    ------
    UserError
        An ``hf:`` folder whose weights are pickled (never loaded).
    """
    kind = source_kind(name)
    if kind == "torchvision" and pretrained == "default":
        return [f"model {name}: the initial model loads torchvision's pretrained weights "
                "(DEFAULT, downloaded once), with a new last Linear layer for the classes"]
    if kind == "torchvision" and pretrained:
        return [f"model {name}: the initial model loads the weights of {pretrained}, with a "
                "new last Linear layer for the classes"]
    if kind == "hf":
        return [weights_note(name)]
    return []


def build(name: str, input_shape: tuple[int, ...], num_classes: int, args: Mapping[str, Any],
          *, initial: bool = False, pretrained: str | None = None) -> nn.Module:
    """Build a ``torchvision:``, ``hf:`` or user-code model.

    Parameters
    ----------
    name : str
        ``torchvision:NAME``, ``hf:PATH``, ``module:function`` or ``file.py:function``.
    input_shape : tuple of int
        ``(C, H, W)`` images, ``(D,)`` features or ``(L,)`` token ids.
    num_classes : int
        Output width K.
    args : mapping
        Builder arguments (and :data:`DATA_ARGS` for text).
    initial : bool
        The run's initial model: the only one that loads weights (an ``hf:`` folder's, or
        torchvision's with ``pretrained``).
    pretrained : str, optional
        With ``initial``: ``default`` (torchvision's ``weights="DEFAULT"``) or a local
        weights file.

    Returns
    -------
    torch.nn.Module
        Maps a ``(N, *input_shape)`` batch to ``(N, K)`` logits.

    Raises
    ------
    UserError
        Unknown names, missing folders or code, arguments the builder does not take, or
        inputs the model cannot take (one line each).
    """
    kind = source_kind(name)
    if kind == "torchvision":
        return build_torchvision(name[len("torchvision:"):], input_shape, num_classes, args,
                                 pretrained=pretrained if initial else None)
    if kind == "hf":
        return build_hf(name, input_shape, num_classes, args, initial=initial)
    return build_user(name, input_shape, num_classes, args)


def node_model(spec: str | None) -> str | None:
    """Check the ``--model SPEC`` a node's operator started ``fedavg node`` with.

    Returns
    -------
    str or None
        The spec with a file made absolute (the code this node may run), or ``None``.

    Raises
    ------
    UserError
        Not user code (a built-in or library model needs no opt-in), or user code that does
        not import or has no such function.
    """
    if spec is None or not spec.strip():
        return None
    spec = canonical(spec.strip())
    if source_kind(spec) != "code":  # built-in, torchvision and hf: models need no opt-in
        raise UserError(f"--model {spec}: a node's --model names model code of yours "
                        "(FILE.py:FUNCTION or MODULE:FUNCTION) that it may run; the run's "
                        "model is the coordinator's --model: leave it out here")
    user_builder(spec)
    return spec


def node_model_name(run_model: str, allowed: str | None) -> str:
    """Return the model name this node builds the run's ``run_model`` with.

    A node never imports code named over the network: a ``module:function`` model needs the
    node started with the same ``--model``; a file model the same file name and function,
    and the node loads its own copy (``allowed``). Other models need no opt-in.

    Raises
    ------
    UserError
        User code the node's operator did not name (saying how to start the node).
    """
    if source_kind(run_model) != "code":
        return run_model
    if names_same_code(allowed, run_model):
        return str(allowed)
    where, func, is_file = code_ref(run_model)
    shown = f"{Path(where).name}:{func}" if is_file else run_model
    started = f" (it was started with --model {allowed})" if allowed else ""
    raise UserError(f"the run's model {run_model} is code this node was not told to run"
                    f"{started}: start the node with --model {shown} (nodes import only "
                    "code installed on their machine)")


def saved_model_name(saved: str, allowed: str | None, where: str) -> str:
    """Return the model name a saved model (``model.json``'s ``saved``) is rebuilt with.

    Loading a folder never imports code it names by itself: a model built by user code
    needs that code named by whoever loads it (``--model`` of ``evaluate`` / ``predict`` /
    ``merge``, ``model=`` in Python), as for nodes (:func:`node_model_name`); a file that
    moved is given with its new path.

    Raises
    ------
    UserError
        User code not named, or named for a model that is not user code.
    """
    if source_kind(saved) != "code":
        if allowed is not None:
            raise UserError(f"--model names the code that builds a model, but the model in "
                            f"{where} is {saved}: leave --model out")
        return saved
    if names_same_code(allowed, saved):
        return str(allowed)
    given = f" (--model {allowed} is other code)" if allowed else ""
    raise UserError(f"the model in {where} is built by code, {saved}{given}: pass --model "
                    f"{saved} to run it, if you trust that code (a saved "
                    "model's own description never makes fedavg import code)")


def names_same_code(allowed: str | None, name: str) -> bool:
    """Whether ``allowed`` names the code of the code model ``name``.

    That is the same module and function, or a file of the same name with the same function.
    """
    if allowed is None or source_kind(allowed) != "code":
        return False
    where, func, is_file = code_ref(name)
    own, own_func, own_file = code_ref(allowed)
    return own_func == func and own_file == is_file and (
        Path(own).name == Path(where).name if is_file else own == where)


def check_output(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, what: str,
                 text: bool = False, vocab_size: int | None = None) -> None:
    """Check that ``model`` maps a ``(2, *input_shape)`` batch to ``(2, K)`` logits.

    For text (``text``), the batch is token ids: a row of 0 and, with ``vocab_size``, a row
    of the largest id, so that an embedding smaller than the vocabulary is caught here.

    Raises
    ------
    UserError
        The forward pass fails, or gives another shape or integer logits; the model has no
        trainable parameters, NaN or infinite weights, bfloat16 weights or extra state that is
        no tensor (neither can be sent), or its weights are on the meta device (outside a
        meta build).
    """
    if next((p.is_meta for p in model.parameters()), False):
        if torch.get_default_device().type == "meta":  # built for its shapes only, on purpose
            return
        raise UserError(f"model {what} has its weights on the meta device (shapes, no values): "
                        "build it on the CPU, outside `with torch.device('meta')`")
    state = model.state_dict()
    extra = next((k for k, t in state.items() if not isinstance(t, torch.Tensor)), None)
    if extra is not None:
        raise UserError(f"model {what} keeps state that is no tensor ({extra}, from "
                        "get_extra_state), which nodes cannot send: keep it in a buffer")
    bf16 = next((k for k, t in state.items() if t.dtype == torch.bfloat16), None)
    if bf16 is not None:
        raise UserError(f"model {what} has bfloat16 weights ({bf16}), which Flower's arrays "
                        "cannot carry: keep them in float32 (torch.autocast computes in "
                        "bfloat16)")
    f64 = next((k for k, t in state.items() if t.dtype == torch.float64), None)
    if f64 is not None:
        raise UserError(f"model {what} has float64 weights ({f64}), but its inputs come as "
                        "float32: build it in float32 (call .float() on it, or leave "
                        "torch's default dtype as it is)")
    odd = next((k for k, t in state.items()
                if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if odd is not None:
        raise UserError(f"model {what} starts with NaN or infinite weights ({odd}): fix how its "
                        "builder initialises them")
    dtype = torch.int64 if text else torch.float32
    batch = torch.zeros(2, *input_shape, dtype=dtype)
    if text and vocab_size:
        batch[1] = int(vocab_size) - 1
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(batch)
    except Exception as exc:  # noqa: BLE001 - the model cannot take the data
        ids = f" of token ids 0..{int(vocab_size) - 1} (the vocabulary)" if text and vocab_size \
            else ""
        raise UserError(f"model {what} fails on a batch{ids} of shape {(2, *input_shape)}: "
                        f"{first_line(exc)}") from None
    finally:
        model.train(was)
    out = getattr(out, "logits", out)
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if shape != (2, num_classes):
        raise UserError(f"model {what} maps a batch of shape {(2, *input_shape)} to {shape}; it "
                        f"must give (2, {num_classes}) logits, one per class")
    if not out.is_floating_point():
        raise UserError(f"model {what} gives {out.dtype} logits; they must be floating point "
                        "(the loss takes log-probabilities of them)")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model {what} has no trainable parameters: nodes would have nothing "
                        "to train")
