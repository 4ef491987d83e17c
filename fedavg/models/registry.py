"""Build models by name: ``build_model``, ``resolve_model`` and the ``ModelSpec`` of a run.

Builders register with ``@register_model(name)`` (:mod:`fedavg.models.register`, re-exported
here).

Every builder takes ``input_shape`` (``(C, H, W)`` or ``(D,)``) and ``num_classes`` and
returns a ``torch.nn.Module`` mapping a normalised ``(N, *input_shape)`` float batch to
``(N, num_classes)`` logits. Names holding a ``:`` (``torchvision:NAME``, ``hf:PATH``,
``module:function``, ``file.py:function``) are built by :mod:`fedavg.models.sources`.
Builder arguments (``--model-arg``) are checked against the builder's signature first.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedavg.models import images as _images  # noqa: F401  (registers the built-in builders)
from fedavg.models import pretrained as pretrained_models
from fedavg.models import sources as model_sources
from fedavg.models import text as _text  # noqa: F401
from fedavg.models.lora import LoraSpec, wrap
from fedavg.models.register import _MODELS, INPUT_KINDS, register_model  # noqa: F401
from fedavg.models.sources import (
    DATA_ARGS,
    canonical,
    check_output,
    source_kind,
    source_notes,
    stored_args,
)
from fedavg.util.errors import UserError, first_line

#: What ``--model auto`` (the default) picks, as ``fedavg models`` and the docs say it.
AUTO_CHOICE = ("fasttext for text, mlp for tabular or < 16x16 inputs, cnn for grey images, "
               "cnn-cifar for colour")


def available_models() -> dict[str, str]:
    """Return the registered model names and their one-line descriptions."""
    return {name: desc for name, (_, desc, _) in sorted(_MODELS.items())}


def resolve_model(name: str, input_shape: tuple[int, ...], kind: str | None = None) -> str:
    """Pick a model for ``auto``; otherwise check that ``name`` is registered and fits.

    ``auto``: ``fasttext`` for text, ``mlp`` for tabular inputs and images smaller than
    16x16 (e.g. 8x8 digits), ``cnn`` for one-channel images (28x28 MNIST), ``cnn-cifar``
    for colour images. A name holding a ``:`` is returned as the spec stores it (a file or
    ``hf:`` folder made absolute, see :func:`fedavg.models.sources.canonical`).

    Parameters
    ----------
    name : str
        Registered name or ``auto``.
    input_shape : tuple of int
        One sample's shape.
    kind : str, optional
        One of :data:`INPUT_KINDS`; default ``image`` for 3-d shapes, else ``tabular``.

    Raises
    ------
    UserError
        Unknown name, listing the registered ones; a model that does not take this kind
        of input, listing those that do.
    """
    kind = kind or ("image" if len(input_shape) == 3 else "tabular")
    if name == "auto":
        if kind == "text":
            return "fasttext"
        if len(input_shape) != 3 or min(input_shape[1:]) < 16:
            return "mlp"
        return "cnn" if input_shape[0] == 1 else "cnn-cifar"
    if ":" in name:
        return canonical(name)
    if name not in _MODELS:
        if name.endswith(".py"):
            raise UserError(f"--model {name}: name the builder function in it too, "
                            f"{name}:FUNCTION (e.g. {name}:build)")
        raise UserError(f"unknown model {name!r}; choose auto or one of: {', '.join(_MODELS)}; "
                        "or torchvision:NAME, hf:PATH, FILE.py:FUNCTION (see fedavg models)")
    if kind not in _MODELS[name][2]:
        fits = [n for n, (_, _, kinds) in _MODELS.items() if kind in kinds]
        raise UserError(f"model {name!r} takes {' or '.join(_MODELS[name][2])} inputs, and "
                        f"this data is {kind}: use --model auto or one of {', '.join(fits)}")
    return name


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, **args
) -> nn.Module:
    """Build a model: registered, ``torchvision:NAME``, ``hf:PATH`` or your own code.

    Parameters
    ----------
    name : str
        Registered name (``auto`` is resolved by :func:`resolve_model`), or a name holding
        a ``:`` (see :mod:`fedavg.models.sources`).
    input_shape : tuple of int
        ``(C, H, W)``, ``(D,)``, or ``(L,)`` token ids.
    num_classes : int
        Output width.
    **args
        Builder-specific arguments (stored in ``model.json``); for text data also
        ``vocab_size`` and ``pad_id`` (:data:`fedavg.models.sources.DATA_ARGS`), passed only
        to builders that take them.

    Raises
    ------
    UserError
        Unknown model, an argument the builder does not take, or an input shape the model
        cannot take.
    """
    return make_model(name, input_shape, num_classes, args)


def make_model(name: str, input_shape: tuple[int, ...], num_classes: int,
               args: dict[str, Any] | None = None, *, initial: bool = False,
               pretrained: str | None = None) -> nn.Module:
    """Build a model as :func:`build_model` does, with its arguments in ``args``.

    ``initial``: the run's initial model, the only one that loads weights (torchvision's
    pretrained weights with ``pretrained``: ``default`` or a file; an ``hf:`` folder's; a
    pretrained model's package); user-code models ignore both.
    """
    shape, args = tuple(int(s) for s in input_shape), dict(args or {})
    try:
        if ":" in name:
            return model_sources.build(name, shape, int(num_classes), args, initial=initial,
                                       pretrained=pretrained)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a library's own check of a builder argument
        given = {k: v for k, v in args.items() if k != "hf_config"}  # not its whole config
        raise UserError(f"model {name!r} cannot be built with {given}: "
                        f"{type(exc).__name__}: {first_line(exc)}") from None
    name = resolve_model(name, shape, _kind(name, args))
    fn = _MODELS[name][0]
    what = f"model {name!r}"
    kwargs = _takes(name, fn, what).kwargs(what, args)
    _check_sizes(fn, what, kwargs)
    own = {"initial": initial} if name in pretrained_models.PRETRAINED else {}
    try:
        return fn(shape, int(num_classes), **kwargs, **own)
    except (ValueError, RuntimeError, MemoryError) as exc:
        if too_big := _allocation_failed(exc):
            raise UserError(f"model {name!r}" + (f" with {kwargs}" if kwargs else "")
                            + f" is too big to build: {too_big}; choose "
                            + ("smaller --model-arg values" if kwargs else "a smaller model")
                            ) from None
        raise UserError(f"model {name!r} cannot take inputs of shape {shape}"
                        + (f" with {kwargs}" if kwargs else "")
                        + f": {first_line(exc)}") from None
    except (TypeError, ArithmeticError, AssertionError) as exc:  # a bad builder argument
        raise UserError(f"model {name!r} cannot be built with {kwargs}: "
                        f"{type(exc).__name__}: {first_line(exc)}") from None



def _allocation_failed(exc: BaseException) -> str | None:
    """Say how much memory a failed tensor allocation asked for; ``None`` for other errors."""
    text = str(exc)
    if not (isinstance(exc, MemoryError) or "can't allocate memory" in text
            or "out of memory" in text.lower() or "not enough memory" in text):
        return None
    asked = re.search(r"allocate (\d+) bytes", text)
    return (f"one of its tensors needs {int(asked.group(1)) / 2**30:,.1f} GiB" if asked
            else "not enough memory for its weights")


def base_sha256(name: str, pretrained: str | None = None) -> str | None:
    """Return the SHA-256 of the pretrained weights model ``name`` starts from, if any.

    A registered pretrained model's weights file, an ``hf:`` folder's
    ``model.safetensors``, or a torchvision model's ``--pretrained PATH``; ``None`` for a
    model that starts from random weights (or torchvision's downloaded ones).

    Raises
    ------
    UserError
        The weights package is not installed, or the folder's weights are pickled.
    """
    if name in pretrained_models.PRETRAINED:
        return pretrained_models.weights_sha256(name)
    if model_sources.source_kind(name) == "hf":
        weights = model_sources.hf_weights_file(name)
        return None if weights is None else pretrained_models.file_sha256(str(weights))
    if model_sources.source_kind(name) == "torchvision" and pretrained not in (None, "default"):
        from pathlib import Path

        return pretrained_models.file_sha256(str(Path(pretrained).expanduser().resolve()))
    return None


def check_model_args(name: str, args: dict[str, Any]) -> None:
    """Refuse, before any data is loaded, builder arguments that model ``name`` cannot take.

    Checks registered models and user code (``module:function`` / ``file.py:function``, which
    it imports). ``auto`` depends on the data, and ``torchvision:`` / ``hf:`` models are
    checked when they are built.

    Raises
    ------
    UserError
        An unknown model, an argument the builder does not take (naming those it takes), a
        required one missing, or a size argument below 1.
    """
    kind = model_sources.source_kind(name)
    if kind == "registry" and name not in _MODELS and name != "auto":
        resolve_model(name, (1,))  # its error: unknown, with the registered names
    if kind not in ("registry", "code") or (kind == "registry" and name not in _MODELS):
        return
    fn = model_sources.user_builder(name) if kind == "code" else _MODELS[name][0]
    what = f"model {name!r}"
    data = dict.fromkeys(model_sources.DATA_ARGS, 1)  # text data gives these: not missing
    kwargs = _takes(name, fn, what).kwargs(what, {**args, **data})
    if kind == "registry":
        _check_sizes(fn, what, {k: v for k, v in kwargs.items() if k not in data})


def _takes(name: str, fn, what: str) -> model_sources.Takes:
    """Return what builder ``fn`` of ``name`` takes from ``--model-arg``.

    A pretrained model's keyword-only arguments (``initial``, a test's ``config``) are
    fedavg's alone.
    """
    takes = model_sources.Takes.of(fn, what)
    if name not in pretrained_models.PRETRAINED:
        return takes
    import inspect

    own = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    return model_sources.Takes(tuple(n for n in takes.names if n not in own), takes.any,
                               tuple(n for n in takes.required if n not in own))


def _check_sizes(fn, what: str, kwargs: dict[str, Any]) -> None:
    """Refuse a size argument (an ``int`` defaulting to >= 1: ``hidden``, ``width``) below 1.

    Raises
    ------
    UserError
        Naming the argument; a layer of 0 units trains a constant model.
    """
    import inspect

    params = inspect.signature(fn).parameters
    for key, value in kwargs.items():
        default = params[key].default if key in params else None
        if type(default) is int and default >= 1 and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{what}: --model-arg {key}={value!r} must be a whole number "
                            f">= 1 (default {default})")


def _kind(name: str, args: dict) -> str | None:
    """Return the input kind a build implies: text when a tokenizer's ``vocab_size`` is given."""
    if "vocab_size" in args:
        return "text"
    kinds = _MODELS[name][2] if name in _MODELS else ()
    return kinds[0] if len(kinds) == 1 else None


class EnsembleModel(nn.Module):
    """Weighted output ensemble: ``log(sum_i w_i softmax(member_i(x)))``.

    The output is a log-probability, so it can stand in for logits: its softmax is the
    ensemble's probability, its argmax the prediction, and cross-entropy on it the
    ensemble's negative log-likelihood.

    Parameters
    ----------
    members : list of torch.nn.Module
        Networks with the same input and output shapes.
    weights : sequence of float
        Non-negative member weights (normalised to sum to 1).

    Raises
    ------
    ValueError
        No members, a weight count that differs from the member count, or weights that are
        negative or sum to 0.
    """

    def __init__(self, members: list[nn.Module], weights) -> None:
        super().__init__()
        w = torch.as_tensor(list(weights), dtype=torch.float32)
        if not members or len(w) != len(members) or (w < 0).any() or w.sum() <= 0:
            raise ValueError("an ensemble needs members and as many non-negative weights")
        self.members = nn.ModuleList(members)
        self.register_buffer("weights", w / w.sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, ...)`` normalised inputs -> ``(N, K)`` log-probabilities."""
        probs = sum(w * torch.softmax(m(x).float(), dim=1)
                    for w, m in zip(self.weights, self.members))
        return torch.log(probs.clamp_min(1e-12))


def with_group_norm(model: nn.Module) -> nn.Module:
    """Return ``model`` with every BatchNorm layer replaced by GroupNorm.

    Opacus's ``ModuleValidator.fix``: ``GroupNorm(min(32, C), C)`` with fresh affine
    weights (1 and 0) for a BatchNorm of ``C`` channels; the other layers are kept, weights
    included. Notes what it replaced on ``model.fedavg_notes``.
    """
    from opacus.validators import ModuleValidator

    count = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not count:
        return model
    notes = list(getattr(model, "fedavg_notes", []))
    opacus_log = logging.getLogger("opacus.validators.batch_norm")
    level = opacus_log.level
    opacus_log.setLevel(logging.WARNING)  # its note on each replaced layer
    try:
        fixed = ModuleValidator.fix(model)
    finally:
        opacus_log.setLevel(level)
    fixed.fedavg_notes = notes + [f"--group-norm: {count} BatchNorm layer(s) replaced by "
                                  "GroupNorm (min(32, channels) groups)"]
    return fixed


@dataclass
class ModelSpec:
    """How to rebuild the model: registry name, builder args, input shape, classes.

    Attributes
    ----------
    name : str
        Registered model name (``auto`` already resolved), or a ``torchvision:``, ``hf:`` or
        user-code name (a file made absolute).
    input_shape : tuple of int
        ``(C, H, W)`` or ``(D,)``.
    num_classes : int
        Output width.
    args : dict
        Builder-specific arguments (``--model-arg``; an ``hf:`` model's ``hf_config``; text
        data's ``vocab_size`` and ``pad_id``).
    pretrained : str or None
        The initial model (:meth:`build` with ``initial=True``) of a torchvision model loads
        pretrained weights: ``default`` (torchvision's) or a local file. Stored only with
        LoRA (every copy then loads the base); otherwise every other copy gets its weights
        as a state dict.
    lora : LoraSpec or None
        LoRA adapters on the frozen pretrained model (:mod:`fedavg.models.lora`): every copy
        loads the pretrained base and only the adapters, head and buffers travel.
    group_norm : bool
        Every BatchNorm layer replaced by GroupNorm of ``min(32, C)`` groups (Opacus's
        ``ModuleValidator.fix``), as built: a model DP-SGD can train.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    args: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    lora: LoraSpec | None = None
    group_norm: bool = False

    @classmethod
    def resolve(cls, name: str, input_shape: tuple[int, ...], num_classes: int,
                args: dict[str, Any] | None = None, *, pretrained: str | None = None,
                kind: str | None = None, lora: dict[str, Any] | None = None,
                group_norm: bool = False) -> "ModelSpec":
        """Return the spec of model ``name`` (``auto`` resolved, what rebuilding needs added).

        ``kind`` is the data's (:data:`INPUT_KINDS`): a registered model must take it.
        ``lora``: ``rank``, ``alpha``, ``dropout``, ``targets`` and ``merge`` of LoRA
        adapters (:class:`~fedavg.models.lora.LoraSpec`; head and default targets are found
        when the model is first built, :meth:`build`). ``group_norm``: see the class.

        Raises
        ------
        UserError
            Unknown model, a model source that cannot be read (see
            :func:`fedavg.models.sources.stored_args`), or LoRA for a model without
            pretrained weights.
        """
        shape = tuple(int(s) for s in input_shape)
        name = resolve_model(name, shape, kind)
        args = dict(args or {})
        if ":" in name:
            args = stored_args(name, shape, int(num_classes), args)
        if isinstance(pretrained, bool):  # the older flag
            pretrained = "default" if pretrained else None
        elif pretrained not in (None, "default"):  # a file: nodes with LoRA load it too
            from pathlib import Path

            pretrained = str(Path(pretrained).expanduser().resolve())
        spec = None
        if lora is not None:
            sha = base_sha256(name, pretrained) if args.get("weights") != "random" else None
            if sha is None:
                raise UserError(f"--lora-rank adapts pretrained weights every node loads from a "
                                f"file it can check, and model {name} has none here: use "
                                f"{', '.join(pretrained_models.PRETRAINED)} (without "
                                "weights=random), an hf: folder with model.safetensors, or a "
                                "torchvision model with --pretrained PATH")
            spec = LoraSpec.from_dict({**lora, "base_sha256": sha})
        if group_norm and spec is not None:
            raise UserError("--group-norm with --lora-rank: the adapted base is the pretrained "
                            "model as it is; leave one out")
        return cls(name, shape, int(num_classes), args, pretrained, spec, bool(group_norm))

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "ModelSpec":
        """Inverse of :meth:`as_dict` (the ``model`` entry of ``model.json``)."""
        lora = spec.get("lora")
        return cls(spec["name"], tuple(spec["input_shape"]), int(spec["num_classes"]),
                   dict(spec.get("args", {})), spec.get("pretrained") if lora else None,
                   lora=None if lora is None else LoraSpec.from_dict(lora),
                   group_norm=spec.get("group_norm") is True)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON and the wire (``lora`` only with adapters, ``group_norm`` set)."""
        out = {"name": self.name, "input_shape": list(self.input_shape),
               "num_classes": self.num_classes, "args": dict(self.args)}
        if self.group_norm:
            out["group_norm"] = True
        if self.lora is not None:  # every copy loads the base: where from
            out["lora"] = self.lora.as_dict()
            if self.pretrained is not None:
                out["pretrained"] = self.pretrained
        return out

    def build(self, initial: bool = False) -> nn.Module:
        """Build a fresh instance; ``initial``: the run's initial model (loads weights).

        With LoRA every copy loads the pretrained base (checked against
        ``lora.base_sha256``) and gets adapters; the first build fills in the spec's head
        and default targets.

        Raises
        ------
        UserError
            See :func:`build_model`; a base whose weights differ from the run's.
        """
        if self.lora is None:
            model = make_model(self.name, self.input_shape, self.num_classes, self.args,
                               initial=initial, pretrained=self.pretrained)
            return with_group_norm(model) if self.group_norm else model
        own = base_sha256(self.name, self.pretrained)
        if self.lora.base_sha256 and own is None:
            raise UserError(f"model {self.name}: the run's pretrained weights (SHA-256 "
                            f"{self.lora.base_sha256[:12]}) are not here: restore the weights "
                            "file the run started from")
        if self.lora.base_sha256 and own != self.lora.base_sha256:
            raise UserError(f"model {self.name}: the run's pretrained weights have SHA-256 "
                            f"{self.lora.base_sha256[:12]}, this install's {str(own)[:12]}: "
                            "install the same weights (package version) as the coordinator")
        weighted = torch.get_default_device().type != "meta"  # a meta build: shapes only
        net = make_model(self.name, self.input_shape, self.num_classes, self.args,
                         initial=weighted, pretrained=self.pretrained)
        model = wrap(net, self.lora, self.num_classes)
        self.lora = model.spec
        return model

    def check(self, model: nn.Module) -> list[str]:
        """Check ``model`` maps a ``(2, *input_shape)`` batch to ``(2, K)``; return its notes.

        The notes say how inputs are adapted and which weights the initial model loads.

        Raises
        ------
        UserError
            The forward pass fails or gives another shape; your own builder gives another
            architecture on a second call.
        """
        check_output(model, self.input_shape, self.num_classes, self.name,
                     text=DATA_ARGS[0] in self.args, vocab_size=self.args.get(DATA_ARGS[0]))
        if source_kind(self.name) == "code":  # every node builds its own copy
            again = {k: tuple(t.shape) for k, t in self.build().state_dict().items()}
            first = {k: tuple(t.shape) for k, t in model.state_dict().items()}
            if again != first:
                key = next(k for k in sorted(set(first) | set(again))
                           if first.get(k) != again.get(k))
                raise UserError(f"model {self.name} builds another model on each call "
                                f"({key}: {first.get(key)}, then {again.get(key)}): nodes "
                                "must all build the same one; make the builder deterministic")
        return [*getattr(model, "fedavg_notes", []), *source_notes(self.name, self.pretrained)]

    def build_ensemble(self, members: list[dict[str, torch.Tensor]],
                       weights: list[float]) -> nn.Module:
        """Return an :class:`EnsembleModel` of instances loaded with the ``members`` state dicts."""
        nets = []
        for state in members:
            net = self.build()
            net.load_state_dict(state)
            nets.append(net)
        return EnsembleModel(nets, weights)
