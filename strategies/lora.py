"""Exact merging of LoRA adapters: the average of the nodes' products, not of their factors.

LoRA (Hu et al. 2021, arXiv:2106.09685) adapts a frozen weight ``W`` (``(out, in)``, or a
convolution's ``(out, in, kh, kw)``) by ``s * B @ A`` with ``A`` ``(r, in...)``, ``B``
``(out, r)`` and ``s = alpha / r``. Averaging ``A`` and ``B`` separately, as most federated
LoRA toolkits do, is not the average of the nodes' updates:
``(B1 + B2)(A1 + A2) / 4 != (B1 A1 + B2 A2) / 2`` (FLoRA, Wang et al. 2024,
arXiv:2409.05976; FedEx-LoRA, Singhal et al. 2024, arXiv:2410.09432).

The exact merge here folds each node's product into the adapted weight before any strategy
sees it (:func:`fold_reply`): node ``k``'s model is ``W + s B_k A_k`` with its ``A``/``B``
set back to the round's, so a weighted average of node models is exactly
``W + sum_k w_k s B_k A_k`` and every parameter-merging strategy works unchanged. The
round's adapters start from ``B = 0`` (LoRA's initialisation), so the merged model's ``A``
and ``B`` are the round's again: each round's adapters start afresh on the updated ``W``.

Keys follow ``peft``: a layer ``P`` holds ``P.base_layer.weight``, ``P.lora_A.default.weight``
and ``P.lora_B.default.weight``. Pure tensor math, no Flower import.
"""

from __future__ import annotations

from typing import Mapping

import torch

from strategies.tensors import MergeError, StateDict

ADAPTER = "default"


def layer_keys(prefix: str) -> tuple[str, str, str]:
    """Return the keys ``(W, A, B)`` of adapted layer ``prefix`` in a state dict."""
    return (f"{prefix}.base_layer.weight", f"{prefix}.lora_A.{ADAPTER}.weight",
            f"{prefix}.lora_B.{ADAPTER}.weight")


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float, shape: torch.Size) -> torch.Tensor:
    """Return ``scaling * B @ A`` reshaped to the adapted weight's ``shape``.

    Parameters
    ----------
    a : torch.Tensor
        ``(r, in)``, or ``(r, in, kh, kw)`` for a convolution.
    b : torch.Tensor
        ``(out, r)``, or ``(out, r, 1, 1)``.
    scaling : float
        ``alpha / r``.
    shape : torch.Size
        The adapted weight's shape, ``(out, in)`` or ``(out, in, kh, kw)``.

    Raises
    ------
    MergeError
        Factors whose product does not have ``shape``.
    """
    rank = a.shape[0]
    product = b.reshape(b.shape[0], rank).float() @ a.reshape(rank, -1).float()
    if product.numel() != torch.Size(shape).numel():
        raise MergeError(f"LoRA factors {tuple(a.shape)} and {tuple(b.shape)} do not make a "
                         f"{tuple(shape)} weight")
    return (scaling * product).reshape(shape)


def fold_reply(state: StateDict, reference: StateDict,
               layers: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Return node model ``state`` with its adapters folded into the adapted weights.

    Parameters
    ----------
    state : mapping of str to torch.Tensor
        A node's reply: its ``A`` and ``B`` of each layer, the other trained tensors; the
        adapted weights ``W`` may be left out (the node did not change them).
    reference : mapping of str to torch.Tensor
        The round's model the node started from (``W``, ``A``, ``B`` of every layer).
    layers : mapping of str to float
        Adapted layer prefix -> its scaling ``alpha / r``.

    Returns
    -------
    dict of str to torch.Tensor
        ``state`` with ``W = W_ref + s B A``, and ``A``, ``B`` equal to the reference's.

    Raises
    ------
    MergeError
        The reply lacks a layer's ``A`` or ``B``.
    """
    out = dict(state)
    for prefix, scaling in layers.items():
        w, a, b = layer_keys(prefix)
        if a not in state or b not in state:
            lacking = a if a not in state else b
            raise MergeError(f"reply lacks the LoRA adapter of {prefix} ({lacking})")
        base = reference[w]
        out[w] = (base.float() + delta(state[a], state[b], scaling, base.shape)).to(base.dtype)
        out[a], out[b] = reference[a], reference[b]
    return out


def fold_into_base(state: StateDict, layers: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """Return ``state`` with ``W + s B A`` as each layer's weight and the adapters dropped.

    The keys become those of the model without adapters: ``P.base_layer.weight`` ->
    ``P.weight`` (``P.base_layer.bias`` -> ``P.bias``).
    """
    out: dict[str, torch.Tensor] = {}
    adapters = {k for prefix in layers for k in layer_keys(prefix)[1:]}
    for key, tensor in state.items():
        if key in adapters:
            continue
        out[key.replace(".base_layer.", ".")] = tensor
    for prefix, scaling in layers.items():
        w, a, b = layer_keys(prefix)
        base = state[w]
        out[f"{prefix}.weight"] = (base.float() + delta(state[a], state[b], scaling, base.shape)
                                   ).to(base.dtype)
    return out


def low_rank(delta: torch.Tensor, max_rank: int,
             rtol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Factor ``delta`` as ``P @ Q`` of at most ``max_rank`` columns, when it is that low rank.

    An exact merge of ``k`` nodes' rank-``r`` adapters changes each adapted weight by at most
    rank ``k * r`` (a sum of ``k`` products), so the change travels as two thin factors
    instead of the whole weight (FLoRA's stacking, Wang et al. 2024, arXiv:2409.05976,
    recovered here from the merged weight by an SVD, so that any linear merge qualifies).

    Parameters
    ----------
    delta : torch.Tensor
        ``(out, in)`` or ``(out, in, kh, kw)`` change of a weight.
    max_rank : int
        Columns ``P`` may have.
    rtol : float
        Largest relative Frobenius error ``||delta - P Q|| / ||delta||`` accepted.

    Returns
    -------
    (torch.Tensor, torch.Tensor) or None
        ``P`` ``(out, rho)`` and ``Q`` ``(rho, in * kh * kw)`` in ``delta``'s dtype, or ``None``
        when ``delta`` is not of rank ``max_rank`` or less (a median or an adaptive server
        step changes every entry on its own).
    """
    m = delta.reshape(delta.shape[0], -1).double()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    keep = int((s > s[0] * 1e-12).sum()) if s.numel() and s[0] > 0 else 0
    if keep > max_rank:
        keep = max_rank
    p, q = u[:, :keep] * s[:keep], vh[:keep]
    norm = float(torch.linalg.norm(m))
    if norm and float(torch.linalg.norm(m - p @ q)) > rtol * norm:
        return None
    return p.to(delta.dtype), q.to(delta.dtype)


def add_low_rank(weight: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Return ``weight + P @ Q`` (reshaped to the weight), computed the same on every copy."""
    return weight + (p @ q).reshape(weight.shape).to(weight.dtype)
