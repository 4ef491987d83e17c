"""Shared types and the registry of merge strategies.

A strategy folds node models in one at a time (``begin`` / ``add`` / ``result``), so that a
coordinator never needs to hold every node's copy at once: peak memory is a small multiple of
one state dict, whatever the number of nodes.
"""

from __future__ import annotations

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
        The single merged model (each tensor in its original dtype).
    num_models : int
        How many node models went in.
    total_weight : float
        Sum of the weights (e.g. samples) of those models.
    """

    state_dict: dict[str, torch.Tensor]
    num_models: int
    total_weight: float
    info: dict = field(default_factory=dict)


class Strategy:
    """A merge method: fold node models in with ``add``, read the result with ``result``.

    Subclasses set ``name``, ``description`` and ``paper`` (citation with arXiv id) and
    implement ``begin``, ``add`` and ``result``.
    """

    name: str = ""
    description: str = ""
    paper: str = ""

    def begin(self, reference: StateDict) -> None:
        """Start a merge whose models must match ``reference``'s keys, shapes and dtypes."""
        raise NotImplementedError

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one node's model with ``weight`` (e.g. its number of samples)."""
        raise NotImplementedError

    def result(self) -> Merged:
        """The merged model of everything added since ``begin``."""
        raise NotImplementedError

    def merge(
        self, state_dicts: Iterable[StateDict], weights: Iterable[float],
        nodes: Iterable[str] | None = None,
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
        self.begin(sds[0])
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


def get(name: str, **kwargs) -> Strategy:
    """A new instance of the strategy registered as ``name``.

    Raises
    ------
    UnknownStrategyError
        With the list of known names.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return cls(**kwargs)


def check_compatible(reference: StateDict, state_dict: StateDict, node: str) -> None:
    """Raise :class:`MergeError` naming the key and node when ``state_dict`` does not match.

    Checks the same keys, the same shapes, the same dtypes, and finite floating values.
    """
    ref_keys, keys = set(reference), set(state_dict)
    if ref_keys != keys:
        missing, extra = sorted(ref_keys - keys), sorted(keys - ref_keys)
        detail = []
        if missing:
            detail.append(f"missing {missing[:3]}")
        if extra:
            detail.append(f"unexpected {extra[:3]}")
        raise MergeError(f"model from node {node} has other keys: {', '.join(detail)}")
    for key, ref in reference.items():
        t = state_dict[key]
        if not isinstance(t, torch.Tensor):
            raise MergeError(f"model from node {node}: {key!r} is not a tensor")
        if tuple(t.shape) != tuple(ref.shape):
            raise MergeError(
                f"model from node {node}: {key!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(ref.shape)}"
            )
        if t.dtype != ref.dtype:
            raise MergeError(
                f"model from node {node}: {key!r} has dtype {t.dtype}, expected {ref.dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise MergeError(f"model from node {node}: {key!r} has NaN or infinite values")
