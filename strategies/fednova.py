"""FedNova: normalised averaging, Wang et al. 2020, arXiv:2007.07481.

Nodes that take different numbers of local steps (partitions of different sizes, the same
local epochs) pull a plain average towards the nodes that stepped most. FedNova averages
each node's update divided by its own step count instead and rescales by the mean count.
With momentum ``rho`` and per-step learning rates ``eta_k`` (``k = 0 .. tau_i - 1``), a
node's normalising factor is ``a_i = sum_k (eta_k / eta_0) (1 - rho^(tau_i - k)) /
(1 - rho)``: ``tau_i`` for constant-rate SGD without momentum, and the paper's ``[tau_i -
rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)`` with momentum. The server, with sample
shares ``p_i = n_i / sum_j n_j``, sets ``x+ = x - tau_eff sum_i p_i (x - y_i) / a_i``,
``tau_eff = sum_i p_i a_i`` (Flower Baselines' NIID-Bench does the same). When every
``a_i`` is equal this is FedAvg. Buffers are averaged as FedAvg does.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from strategies.base import MergeError, StateDict, is_float, register
from strategies.fedavg import FedAvg, _update_mean, check_weight
from strategies.local import NodeRule, NodeUpdate

#: Metric of a node's reply holding its normalising factor ``a_i``.
NORMALISER = "fednova-a"


def normaliser(lrs: list[float], momentum: float) -> float:
    """Return ``a_i`` of one node's steps (learning rates ``lrs``, in steps of ``lrs[0]``).

    >>> normaliser([0.1, 0.1, 0.1], 0.0)
    3.0
    """
    if not lrs or lrs[0] <= 0:
        return 0.0
    tau = len(lrs)
    if momentum == 0:
        return float(sum(lr / lrs[0] for lr in lrs))
    return float(sum(lr / lrs[0] * (1 - momentum ** (tau - k)) / (1 - momentum)
                     for k, lr in enumerate(lrs)))


class FedNovaNode(NodeRule):
    """Node side: plain local training; the reply carries ``a_i``."""

    optimizers = ("sgd",)

    def finish(self, model) -> NodeUpdate:
        """Report ``fednova-a`` (0 when no step was taken: the server leaves it out)."""
        return NodeUpdate(metrics={NORMALISER: normaliser(self.lrs, self.momentum)})


@register
class FedNova(FedAvg):
    """FedNova's server: the normalised update, rescaled by ``tau_eff``.

    Memory: FedAvg's plus two state dicts (the round's start and the mean normalised
    update).
    """

    name = "fednova"
    dp_mean = False  # see Strategy.dp_mean
    secure_sum = False  # see Strategy.secure_sum
    description = "normalised averaging: each update divided by the node's local steps"
    paper = ("Wang et al. 2020, Tackling the Objective Inconsistency Problem in "
             "Heterogeneous Federated Optimization, arXiv:2007.07481")
    node_rule = FedNovaNode

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Keep the round's start ``x`` (its trained parameters)."""
        super().begin(reference, buffers, context)
        self._start = {k: t.detach().to(torch.promote_types(t.dtype, torch.float32), copy=True)
                       for k, t in reference.items() if is_float(t.dtype) and k not in buffers}
        self._direction: dict[str, torch.Tensor] = {}
        self._tau_eff = 0.0

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Refused: FedNova needs each node's ``a_i`` (:meth:`add_reply`)."""
        raise MergeError(f"fednova needs the {NORMALISER!r} metric of node {node}'s reply; "
                         "it merges only during federated rounds")

    def add_reply(self, state_dict: StateDict, weight: float, node: str = "?", *,
                  arrays=None, metrics: Mapping[str, float] | None = None) -> None:
        """Fold in ``(x - y_i) / a_i`` with share ``n_i``; a refused reply changes nothing.

        Raises
        ------
        MergeError
            No ``fednova-a`` metric, one that is not a finite number > 0 (a node that took
            no step), or a model :meth:`FedAvg.add` refuses.
        """
        a = (metrics or {}).get(NORMALISER)
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) \
                or a <= 0:
            raise MergeError(f"reply has {NORMALISER!r} = {a!r}; need a number > 0 (the "
                             "node took no local step, or is not a fednova node)")
        weight = check_weight(weight, node)
        share = weight / (self._total + weight)
        super().add(state_dict, weight, node)  # checks keys, shapes, dtypes and NaN first
        for k, x in self._start.items():
            step = (x - state_dict[k].detach().to(x.dtype)) / float(a)
            if k not in self._direction:
                self._direction[k] = step
            else:
                _update_mean(self._direction[k], step, share)
        self._tau_eff += share * (float(a) - self._tau_eff)

    def result(self):
        """Return ``x - tau_eff * mean_p((x - y_i) / a_i)`` for parameters, FedAvg for buffers."""
        merged = super().result()
        for k, x in self._start.items():
            merged.state_dict[k] = (x - self._tau_eff * self._direction[k]).to(
                merged.state_dict[k].dtype)
        merged.info["tau_eff"] = self._tau_eff
        return merged
