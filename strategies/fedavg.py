"""Federated Averaging (FedAvg), McMahan et al. 2017, arXiv:1602.05629, and FedProx.

The merged model is the sample-weighted mean of the node models, parameter by parameter:
``w = sum_k n_k w_k / sum_k n_k``. It is kept as a running weighted mean (West 1979,
Updating mean and variance estimates: an improved method), ``m += (n_k / N_k) (w_k - m)``,
which does not grow with the number of nodes and stays accurate in float32; half-precision
tensors are accumulated in float32 and cast back to their own dtype. Integer and boolean
buffers (BatchNorm's ``num_batches_tracked``) are not averaged as floats: the merge keeps
their elementwise maximum (logical or for booleans).
"""

from __future__ import annotations

import math

import torch

from strategies.base import (
    Merged,
    MergeError,
    Option,
    StateDict,
    Strategy,
    check_compatible,
    is_float,
    merge_integer,
    register,
    signature,
)


def check_weight(weight, node: str) -> float:
    """``weight`` as a float, or :class:`MergeError` unless it is a finite number > 0."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not math.isfinite(weight) or weight <= 0:
        raise MergeError(f"model from node {node} has weight {weight!r}; need a number > 0")
    return float(weight)


_CHUNK = 1 << 18  # elements per step: bounds temporaries to 1-2 MiB whatever the model


def _update_mean(mean: torch.Tensor, t: torch.Tensor, share: float) -> None:
    """``mean += share * (t - mean)`` in place, chunk by chunk (``share = n_k / N_k``)."""
    flat_m, flat_t = mean.view(-1), t.reshape(-1)
    for start in range(0, flat_t.numel(), _CHUNK):
        part = flat_m[start:start + _CHUNK]
        # out of place: the caller's tensor must not change
        part.add_(torch.sub(flat_t[start:start + _CHUNK].to(mean.dtype), part), alpha=share)


@register
class FedAvg(Strategy):
    """Sample-weighted parameter average, folded in one model at a time.

    Memory: one running mean per tensor (one state dict; float32 for half precision) plus
    the model being folded in, whatever the number of nodes.
    """

    name = "fedavg"
    description = "sample-weighted average of node models, by parameter name"
    dp_mean = True
    secure_sum = True
    paper = ("McMahan et al. 2017, Communication-Efficient Learning of Deep Networks from "
             "Decentralized Data, arXiv:1602.05629")

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Start a merge of models shaped like ``reference`` (only its signature is kept)."""
        self._sig = signature(reference)
        self._acc: dict[str, torch.Tensor] = {}
        self._total = 0.0
        self._count = 0

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one model with ``weight`` samples.

        Raises
        ------
        MergeError
            Weight not finite or not > 0; keys, shapes or dtypes unlike the reference;
            NaN or infinite values. A refused model leaves the merge unchanged.
        """
        weight = check_weight(weight, node)
        check_compatible(self._sig, state_dict, node)
        share = weight / (self._total + weight)
        for key, t in state_dict.items():
            t = t.detach()
            if is_float(t.dtype):
                if key not in self._acc:
                    self._acc[key] = t.to(torch.promote_types(t.dtype, torch.float32),
                                          copy=True, memory_format=torch.contiguous_format)
                else:
                    _update_mean(self._acc[key], t, share)
            else:
                self._acc[key] = merge_integer(self._acc.get(key), t)
        self._total += weight
        self._count += 1

    def result(self) -> Merged:
        """Return the weighted mean of everything added, each tensor in its original dtype."""
        if not self._count:
            raise MergeError("nothing to merge: no node models")
        out = {}
        for key, (_, dtype) in self._sig.items():
            out[key] = self._acc.pop(key).to(dtype)  # no copy when the dtype is already right
        return Merged(out, self._count, self._total)


@register
class FedProx(FedAvg):
    """FedAvg's merge; nodes add the proximal term ``mu/2 * ||w - w_global||^2`` to their loss.

    Li et al. 2020, Federated Optimization in Heterogeneous Networks, arXiv:1812.06127.

    Parameters
    ----------
    mu : float
        Proximal coefficient (>= 0; 0 is FedAvg).
    """

    name = "fedprox"
    description = "FedAvg merge + proximal term mu/2 ||w - w_global||^2 in node training"
    paper = ("Li et al. 2020, Federated Optimization in Heterogeneous Networks, "
             "arXiv:1812.06127")

    options = (Option("mu", float, 0.01, "FedProx proximal coefficient (>= 0; 0 is FedAvg)"),)
    trains_nodes = True

    def check(self) -> None:
        """``mu`` must be >= 0; nodes receive it as their ``proximal_mu``."""
        if not self.mu >= 0:
            raise ValueError(f"--mu must be >= 0 (got {self.mu})")
        self.node_config = {"proximal_mu": self.mu}


@register
class Average(FedAvg):
    """One-shot parameter average of fully trained node models (FedAvg applied once)."""

    name = "average"
    description = "one-shot: sample-weighted parameter average of the final node models"
    paper = FedAvg.paper
    one_shot = True
