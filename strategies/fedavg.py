"""Federated Averaging (FedAvg), McMahan et al. 2017, arXiv:1602.05629.

The merged model is the sample-weighted mean of the node models, parameter by parameter:
``w = sum_k n_k w_k / sum_k n_k``. Floating tensors are accumulated in float64 and cast back
to their own dtype. Integer and boolean buffers (BatchNorm's ``num_batches_tracked``) are not
averaged as floats: the merge keeps their elementwise maximum (logical or for booleans).
"""

from __future__ import annotations

import math

import torch

from strategies.base import Merged, MergeError, StateDict, Strategy, check_compatible, register


@register
class FedAvg(Strategy):
    """Sample-weighted parameter average, folded in one model at a time.

    Memory: one float64 accumulator per floating tensor, i.e. about twice one float32 state
    dict, whatever the number of nodes.
    """

    name = "fedavg"
    description = "sample-weighted average of node models (one-shot: 'average')"
    paper = "McMahan et al. 2017, Communication-Efficient Learning of Deep Networks from " \
            "Decentralized Data, arXiv:1602.05629"

    def begin(self, reference: StateDict) -> None:
        """Start a merge of models shaped like ``reference``."""
        self._ref = {k: v.detach() for k, v in reference.items()}
        self._acc: dict[str, torch.Tensor] = {}
        self._total = 0.0
        self._count = 0

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one model with ``weight`` samples.

        Raises
        ------
        MergeError
            Weight not finite or not > 0; keys, shapes or dtypes unlike the reference;
            NaN or infinite values.
        """
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise MergeError(f"model from node {node} has weight {weight!r}; need a number > 0")
        check_compatible(self._ref, state_dict, node)
        for key, t in state_dict.items():
            t = t.detach()
            if t.is_floating_point() or t.is_complex():
                contrib = t.to(torch.float64 if t.is_floating_point() else torch.complex128)
                contrib = contrib * float(weight)
                if key in self._acc:
                    self._acc[key] += contrib
                else:
                    self._acc[key] = contrib
            else:
                if key not in self._acc:
                    self._acc[key] = t.clone()
                elif t.dtype == torch.bool:
                    self._acc[key] = self._acc[key] | t
                else:
                    self._acc[key] = torch.maximum(self._acc[key], t)
        self._total += float(weight)
        self._count += 1

    def result(self) -> Merged:
        """The weighted mean of everything added, each tensor in its original dtype."""
        if not self._count:
            raise MergeError("nothing to merge: no node models")
        out = {}
        for key, ref in self._ref.items():
            acc = self._acc[key]
            if ref.is_floating_point() or ref.is_complex():
                out[key] = (acc / self._total).to(ref.dtype)
            else:
                out[key] = acc.to(ref.dtype)
        return Merged(out, self._count, self._total)
