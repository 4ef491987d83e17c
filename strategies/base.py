"""Shared types and the registry of merge strategies.

A strategy folds node models in one at a time (``begin`` / ``add`` / ``result``), so that a
coordinator never needs to hold every node's copy at once: peak memory is a small multiple of
one state dict, whatever the number of nodes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

StateDict = Mapping[str, torch.Tensor]
"""A model's parameters and buffers by name (``model.state_dict()``)."""


class MergeError(ValueError):
    """Node models that cannot be merged (mismatched keys, shapes, non-finite values)."""


class UnknownStrategyError(KeyError):
    """No strategy registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class Merged:
    """Result of a merge.

    Attributes
    ----------
    state_dict : dict of str to torch.Tensor
        The single merged model (each tensor in its original dtype). For an ensemble, the
        weighted parameter average of its members (what the next round would start from).
    num_models : int
        How many node models went in.
    total_weight : float
        Sum of the weights (e.g. samples) of those models.
    members : list of dict, optional
        Set for output ensembles: the member state dicts, kept as they are.
    member_weights : list of float, optional
        Ensemble weights of ``members`` (non-negative, summing to 1).
    info : dict
        Method-specific facts for the run's metadata (e.g. the members a soup kept).
    """

    state_dict: dict[str, torch.Tensor]
    num_models: int
    total_weight: float
    members: list[dict[str, torch.Tensor]] | None = None
    member_weights: list[float] | None = None
    info: dict = field(default_factory=dict)

    @property
    def is_ensemble(self) -> bool:
        """Whether the result is an output ensemble rather than one network."""
        return self.members is not None


@dataclass
class MergeContext:
    """What data-driven merges (soups, fitted ensembles, distillation) may use.

    Everything here is plain PyTorch; ``strategies`` never sees Flower.

    Attributes
    ----------
    build_model : callable
        ``() -> torch.nn.Module``, a fresh instance of the architecture being merged.
    normalize : callable
        ``(x) -> float tensor``: raw ``(N, ...)`` inputs to model inputs.
    val_x, val_y : torch.Tensor, optional
        Held-out validation set (never the test split): ``(N, ...)`` raw inputs and
        ``(N,)`` int64 labels.
    distill_x : torch.Tensor, optional
        ``(M, ...)`` raw unlabeled inputs for distillation.
    device : torch.device
        Where to run models.
    seed : int
        Seed of any random choice.
    """

    build_model: Callable[[], torch.nn.Module]
    normalize: Callable[[torch.Tensor], torch.Tensor]
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    distill_x: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0

    @torch.no_grad()
    def probabilities(self, state_dict: StateDict, x: torch.Tensor,
                      batch_size: int = 1024) -> torch.Tensor:
        """``(N, K)`` softmax outputs of the model with ``state_dict`` on raw inputs ``x``."""
        model = self.build_model()
        model.load_state_dict(state_dict)
        model.to(self.device).eval()
        out = [torch.softmax(model(self.normalize(x[i:i + batch_size].to(self.device))).float(),
                             dim=1).cpu() for i in range(0, len(x), batch_size)]
        return torch.cat(out)

    def accuracy(self, probs: torch.Tensor) -> float:
        """Validation accuracy of ``(N, K)`` probabilities."""
        if self.val_y is None:
            raise MergeError("this merge needs a validation set")
        return float((probs.argmax(1) == self.val_y).float().mean())


class Strategy:
    """A merge method: fold node models in with ``add``, read the result with ``result``.

    Subclasses set ``name``, ``description`` and ``paper`` (citation with arXiv id) and
    implement ``begin``, ``add`` and ``result``.
    """

    name: str = ""
    description: str = ""
    paper: str = ""
    one_shot: bool = False
    """True for "train many, then merge" methods, applied once after local training."""
    needs_validation: bool = False
    """True when the merge uses ``MergeContext.val_x`` / ``val_y``."""
    needs_unlabeled: bool = False
    """True when the merge uses ``MergeContext.distill_x`` (unlabeled inputs)."""
    node_config: dict = {}
    """Extra settings sent to nodes for local training (e.g. FedProx's ``mu``)."""

    def begin(self, reference: StateDict, buffers: frozenset[str] = frozenset(),
              context: "MergeContext | None" = None) -> None:
        """Start a merge whose models must match ``reference``'s keys, shapes and dtypes.

        Parameters
        ----------
        reference : mapping of str to torch.Tensor
            The current global model (the round's starting point).
        buffers : frozenset of str
            Keys that are buffers (BatchNorm statistics), not trained parameters: server
            optimisers average them instead of stepping them.
        context : MergeContext, optional
            Data and model access for data-driven merges.
        """
        raise NotImplementedError

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one node's model with ``weight`` (e.g. its number of samples)."""
        raise NotImplementedError

    def result(self) -> Merged:
        """The merged model of everything added since ``begin``."""
        raise NotImplementedError

    def merge(
        self, state_dicts: Iterable[StateDict], weights: Iterable[float],
        nodes: Iterable[str] | None = None, *, reference: StateDict | None = None,
        buffers: frozenset[str] = frozenset(), context: "MergeContext | None" = None,
    ) -> Merged:
        """Merge a sequence of models in one call (``begin`` + ``add`` each + ``result``).

        Raises
        ------
        MergeError
            No models, or models that do not match the first one.
        """
        sds, ws = list(state_dicts), list(weights)
        names = list(nodes) if nodes is not None else [str(i) for i in range(len(sds))]
        if not sds:
            raise MergeError("nothing to merge: no node models")
        if len(ws) != len(sds):
            raise MergeError(f"{len(sds)} models but {len(ws)} weights")
        self.begin(sds[0] if reference is None else reference, buffers, context)
        for sd, w, n in zip(sds, ws, names):
            self.add(sd, w, n)
        return self.result()


_REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: register a :class:`Strategy` subclass under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> dict[str, type[Strategy]]:
    """Registered strategies by name, sorted."""
    return dict(sorted(_REGISTRY.items()))


def get(name: str, **options) -> Strategy:
    """A new instance of the strategy registered as ``name``.

    ``options`` may hold settings of any strategy (``mu``, ``beta``, ``server_lr`` ...);
    each strategy takes the ones its constructor names and ignores the rest, so one run
    config serves every method.

    Raises
    ------
    UnknownStrategyError
        With the list of known names.
    ValueError
        An option value the strategy refuses (e.g. ``beta`` outside [0, 0.5)).
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}"
        ) from None
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})


def signature(state_dict: StateDict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Keys, shapes and dtypes of a state dict: all :func:`check_compatible` needs."""
    return {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}


def is_float(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are averaged (floating point) rather than kept."""
    return dtype.is_floating_point or dtype.is_complex


def merge_integer(acc: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """Fold an integer or boolean buffer: elementwise maximum (logical or for booleans).

    Integer buffers such as BatchNorm's ``num_batches_tracked`` are counters, not weights:
    averaging them as floats would truncate and mix dtypes.
    """
    if acc is None:
        return t.clone()
    return acc | t if t.dtype == torch.bool else torch.maximum(acc, t)


def check_compatible(reference, state_dict: StateDict, node: str) -> None:
    """Raise :class:`MergeError` naming the key and node when ``state_dict`` does not match.

    ``reference`` is a state dict or its :func:`signature`. Checks the same keys, the same
    shapes, the same dtypes, and finite floating values.
    """
    reference = {k: (v if isinstance(v, tuple) else (tuple(v.shape), v.dtype))
                 for k, v in reference.items()}
    ref_keys, keys = set(reference), set(state_dict)
    if ref_keys != keys:
        missing, extra = sorted(ref_keys - keys), sorted(keys - ref_keys)
        detail = []
        if missing:
            detail.append(f"missing {missing[:3]}")
        if extra:
            detail.append(f"unexpected {extra[:3]}")
        raise MergeError(f"model from node {node} has other keys: {', '.join(detail)}")
    for key, (shape, dtype) in reference.items():
        t = state_dict[key]
        if not isinstance(t, torch.Tensor):
            raise MergeError(f"model from node {node}: {key!r} is not a tensor")
        if tuple(t.shape) != shape:
            raise MergeError(
                f"model from node {node}: {key!r} has shape {tuple(t.shape)}, "
                f"expected {shape}"
            )
        if t.dtype != dtype:
            raise MergeError(
                f"model from node {node}: {key!r} has dtype {t.dtype}, expected {dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MergeError(f"model from node {node}: {key!r} has NaN or infinite values")
