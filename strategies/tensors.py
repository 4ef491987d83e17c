"""Tensor helpers every strategy shares: signatures, compatibility checks, integer buffers.

Pure functions over state dicts (``{name: tensor}``), no Flower import.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

StateDict = Mapping[str, torch.Tensor]
"""A model's parameters and buffers by name (``model.state_dict()``)."""


class MergeError(ValueError):
    """Node models that cannot be merged (mismatched keys, shapes, non-finite values)."""


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


def update_norm(reference: StateDict, state_dict: StateDict) -> float:
    """L2 norm of a node's update: ``sqrt(sum over float tensors of ||w - w_ref||^2)``.

    Parameters
    ----------
    reference : mapping of str to torch.Tensor
        The round's starting (global) model.
    state_dict : mapping of str to torch.Tensor
        A node's model, with ``reference``'s keys and shapes (see :func:`check_compatible`).

    Returns
    -------
    float
        The distance in parameter space; integer buffers (counters) are not counted, float
        buffers (BatchNorm statistics) are. ``inf`` when a value is not finite.
    """
    total = 0.0
    for key, ref in reference.items():
        if is_float(ref.dtype):
            diff = state_dict[key].detach().to(torch.float64) - ref.detach().to(torch.float64)
            total += float(diff.pow(2).sum())
    return total ** 0.5 if total == total else float("inf")


def clip_update(state: StateDict, reference: StateDict,
                clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """Return ``reference + u * min(1, C / ||u||)`` for ``u = state - reference``, and ``||u||``.

    The norm is over every floating tensor of ``state`` together (float32); integer tensors
    take the reference's values (a node's batch counter would tell its data's size). The
    L2 clip of node-level DP (DP-FedAvg, McMahan et al. 2018, arXiv:1710.06963), on the
    coordinator or on the node (``--dp-clip-on node``).

    Parameters
    ----------
    state, reference : dict of str to torch.Tensor
        A node's model (or the part of it it sends) and the round's, which holds every key
        of ``state`` with the same shape.
    clip : float
        ``C`` > 0.
    """
    updates = {k: state[k].detach().to(torch.float32) - reference[k].to(torch.float32)
               for k in state if reference[k].is_floating_point()}
    norm = math.sqrt(sum(float(u.square().sum()) for u in updates.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {}
    for key in state:
        ref = reference[key]
        if key in updates:
            out[key] = (ref.to(torch.float32) + scale * updates[key]).to(ref.dtype)
        else:
            out[key] = ref
    return out, norm


def first_non_finite(state_dict: StateDict) -> str | None:
    """Return the name of the first floating tensor holding NaN or Inf, or ``None``."""
    for key, t in state_dict.items():
        if is_float(t.dtype) and not bool(torch.isfinite(t).all()):
            return key
    return None
