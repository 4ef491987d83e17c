"""FedDyn: dynamic regularisation, Acar et al. 2021, arXiv:2111.04263.

Node ``k`` keeps ``g_k`` (the gradient of its loss at its last local model, zero at first)
and trains on ``L_k(w) - <g_k, w> + alpha/2 ||w - x||^2`` from the global model ``x``; then
``g_k <- g_k - alpha (w_k - x)``. The server keeps ``h`` (zero at first), and after a round
with the set ``P`` of replies out of the run's ``m`` nodes sets
``h <- h - alpha / m * sum_{k in P} (w_k - x)`` and ``x+ = mean_{k in P}(w_k) - h / alpha``.
As in the paper the mean is unweighted (each node counts once, whatever its samples).
Both ``g_k`` and ``h`` exist for trained parameters only; buffers are averaged as FedAvg
does.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from strategies.base import Option, StateDict, Strategy, is_float, register
from strategies.fedavg import FedAvg
from strategies.local import NodeRule, NodeUpdate, fitting, parameters, snapshot
from strategies.scaffold import load_variates


class FedDynNode(NodeRule):
    """Node side: the linear and quadratic terms; the state is ``g_k``."""

    def begin(self, model, received, state) -> None:
        """Keep ``x``; ``state`` is ``g_k`` (zero the first time)."""
        self.alpha = float(self.options["alpha_dyn"])
        self.start = snapshot(model)
        self.grad = fitting(state, self.start, "this node's FedDyn gradient state") \
            or {k: torch.zeros_like(v) for k, v in self.start.items()}

    def loss(self, model, inputs, logits) -> torch.Tensor:
        """``-<g_k, w> + alpha/2 ||w - x||^2`` over the trained parameters."""
        terms = [(-(self.grad[k] * p).sum() + 0.5 * self.alpha * ((p - self.start[k]) ** 2).sum())
                 for k, p in parameters(model).items()]
        return torch.stack(terms).sum()

    def finish(self, model) -> NodeUpdate:
        """Keep ``g_k - alpha (w_k - x)``."""
        trained = snapshot(model)
        return NodeUpdate(state={k: (self.grad[k] - self.alpha * (trained[k] - x)).cpu()
                                 for k, x in self.start.items()})


@register
class FedDyn(Strategy):
    """FedDyn's server: the unweighted mean of the node models, corrected by ``-h / alpha``.

    Parameters
    ----------
    alpha_dyn : float
        The regulariser's coefficient ``alpha`` (> 0; the paper tries 0.1, 0.01, 0.001).

    State between rounds (checkpointed): ``h``, one tensor per trained parameter.
    """

    name = "feddyn"
    description = "dynamic regulariser aligns node and global optima (unweighted mean)"
    paper = ("Acar et al. 2021, Federated Learning Based on Dynamic Regularization, "
             "arXiv:2111.04263")
    options = (Option("alpha_dyn", float, 0.01, "FedDyn regulariser coefficient alpha (> 0)"),)
    # the paper's local steps: plain SGD at lr 0.1. On digits (5 nodes, Dirichlet 0.5, 5
    # rounds, seed 1): 0.872 accuracy, against 0.527 with the run's momentum 0.9 and 0.755
    # with momentum 0 at lr 0.05
    node_defaults = {"momentum": 0.0, "lr": 0.1}
    node_rule = FedDynNode

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.h: dict[str, torch.Tensor] | None = None

    def check_setup(self, model, train) -> list[str]:
        """Note node momentum: the paper's local steps are plain SGD."""
        if train.get("optimizer", "sgd") == "sgd" and float(train.get("momentum", 0)) > 0:
            return [f"feddyn with --momentum {train['momentum']:g}: the paper's nodes take "
                    "plain SGD steps; with momentum the merged model can swing between rounds "
                    "(try --momentum 0, or a larger --alpha-dyn)"]
        return []

    def check(self) -> None:
        """``alpha_dyn`` must be > 0."""
        if not self.alpha_dyn > 0:
            raise ValueError(f"--alpha-dyn must be > 0 (got {self.alpha_dyn})")

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Keep ``x``; ``context.num_nodes`` is the run's ``m``."""
        self._start = {k: t.detach().float().clone() for k, t in reference.items()
                       if is_float(t.dtype) and k not in buffers}
        if self.h is None or sorted(self.h) != sorted(self._start):
            self.h = {k: torch.zeros_like(v) for k, v in self._start.items()}
        self._all, self._mean = FedAvg(), FedAvg()  # buffers by samples; parameters by node
        self._all.begin(reference)
        self._mean.begin(self._start)
        self._num_nodes = None if context is None else context.num_nodes

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one node model (its weight only counts for the buffers).

        Raises
        ------
        MergeError
            As :meth:`FedAvg.add`; a refused model leaves the merge unchanged.
        """
        self._all.add(state_dict, weight, node)
        self._mean.add({k: state_dict[k] for k in self._start}, 1.0, node)

    def result(self):
        """Update ``h``; return ``mean(w_k) - h / alpha`` (FedAvg for buffers)."""
        merged = self._all.result()
        mean = self._mean.result().state_dict
        count = merged.num_models
        share = count / max(self._num_nodes or count, count)
        for k, x in self._start.items():
            self.h[k] = self.h[k] - self.alpha_dyn * share * (mean[k].float() - x)
            merged.state_dict[k] = (mean[k].float() - self.h[k] / self.alpha_dyn).to(
                merged.state_dict[k].dtype)
        return merged

    def state(self) -> dict[str, Any]:
        """``h.<parameter>``: the server's state."""
        return {} if self.h is None else {f"h.{k}": v for k, v in self.h.items()}

    def load_state(self, state: Mapping[str, Any], reference: StateDict | None = None) -> None:
        """Continue with a saved ``h``.

        Raises
        ------
        MergeError
            Entries other than ``h.*``, or shapes unlike ``reference``'s.
        """
        self.h = load_variates(self.name, state, "h.", reference)
