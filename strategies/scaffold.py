"""SCAFFOLD: stochastic controlled averaging, Karimireddy et al. 2020, arXiv:1910.06378.

Each node corrects every local gradient by ``c - c_i``, the server's control variate minus
its own, so that local steps follow the global rather than the local objective. After
``K`` local steps with learning rates ``eta_k`` from the global model ``x`` to ``y_i``, the
node updates its variate with the paper's option II, ``c_i+ = c_i - c + (x - y_i) / E``,
keeps ``c_i+`` until its next round and replies with ``y_i`` and ``delta_c_i = c_i+ -
c_i``. The server takes the sample-weighted mean of the ``y_i`` (global step size 1, as
Flower Baselines' NIID-Bench) and moves ``c += |S| / N * mean_w(delta_c_i)`` over the
``|S|`` replies of the round and the run's ``N`` nodes, folding the replies in partition
order (not as they arrive: the variates amplify rounding differences).

``E = sum_k eta_k (1 - rho^(K - k)) / (1 - rho)`` is how far the ``K`` steps move per unit
of mean gradient: ``K eta`` for constant-rate SGD as in the paper, and, with momentum
``rho``, up to ``1 / (1 - rho)`` times more, since the correction goes through the
momentum here. (Flower Baselines apply the correction after the momentum step and divide
by ``K eta``: the same steps without momentum, and at steady state with it.) Control
variates exist for every parameter entry of the state dict (a frozen one keeps a zero
variate); buffers are averaged as FedAvg does. ``c`` starts at zero (the paper; Flower
Baselines starts it at the initial weights).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from strategies.base import MergeError, StateDict, is_float, register
from strategies.fedavg import FedAvg
from strategies.fednova import normaliser
from strategies.local import NodeRule, NodeUpdate, fitting, parameters, weights

#: Array record of the round's message holding the server control variate ``c``.
SERVER_VARIATE = "scaffold-c"
#: Array record of a node's reply holding ``delta_c_i``.
VARIATE_CHANGE = "scaffold-delta-c"


def effective_lr(lrs: list[float], momentum: float) -> float:
    """Return ``E = sum_k eta_k (1 - rho^(K - k)) / (1 - rho)`` of ``K`` local steps.

    ``E`` is how far the steps move per unit of mean gradient: ``K eta`` for constant-rate
    SGD, the paper's option II.
    """
    return normaliser(lrs, momentum) * lrs[0] if lrs else 0.0


class ScaffoldNode(NodeRule):
    """Node side: gradient correction ``c - c_i`` and the option-II variate update."""

    optimizers = ("sgd",)

    def begin(self, model, received, state) -> None:
        """Keep ``x`` and the correction; ``state`` is ``c_i`` (zero the first time)."""
        self.start = weights(model)
        c = fitting(received.get(SERVER_VARIATE), self.start, "the server control variate")
        if c is None:
            raise MergeError(f"the round's message has no {SERVER_VARIATE!r} record")
        self.c = c
        self.c_i = fitting(state, self.start, "this node's control variate") \
            or {k: torch.zeros_like(v) for k, v in self.start.items()}
        self.correction = {k: self.c[k] - self.c_i[k] for k in self.start}

    def before_step(self, model, lr: float) -> None:
        """Add ``c - c_i`` to each parameter's gradient."""
        super().before_step(model, lr)
        for name, p in parameters(model).items():  # a shared parameter once, a frozen none
            if p.grad is not None:
                p.grad.add_(self.correction[name])

    def finish(self, model) -> NodeUpdate:
        """Return ``delta_c_i`` and keep ``c_i+`` (unchanged when no step was taken)."""
        lr_sum = effective_lr(self.lrs, self.momentum)
        trained = weights(model)
        new = {}
        for k, x in self.start.items():
            new[k] = (self.c_i[k] - self.c[k] + (x - trained[k]) / lr_sum) if lr_sum > 0 \
                else self.c_i[k].clone()
        change = {k: (new[k] - self.c_i[k]).cpu() for k in new}
        return NodeUpdate(arrays={VARIATE_CHANGE: change},
                          state={k: v.cpu() for k, v in new.items()})


@register
class Scaffold(FedAvg):
    """SCAFFOLD's server: FedAvg of the node models plus the server control variate.

    State between rounds (checkpointed): the control variate ``c``, one tensor per trained
    parameter. Memory: FedAvg's plus two state dicts.
    """

    name = "scaffold"
    dp_mean = False  # see Strategy.dp_mean
    secure_sum = False  # see Strategy.secure_sum
    description = "control variates correct node drift; server step size 1"
    paper = ("Karimireddy et al. 2020, SCAFFOLD: Stochastic Controlled Averaging for "
             "Federated Learning, arXiv:1910.06378")
    node_rule = ScaffoldNode
    ordered = True  # the variates amplify rounding: fold a round's replies in one order

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.c: dict[str, torch.Tensor] | None = None

    def _ensure_variate(self, reference: StateDict, buffers: frozenset[str]) -> None:
        keys = [k for k, t in reference.items() if is_float(t.dtype) and k not in buffers]
        if self.c is None or sorted(self.c) != sorted(keys):
            self.c = {k: torch.zeros(reference[k].shape, dtype=torch.float32) for k in keys}

    def to_nodes(self, reference: StateDict, buffers=frozenset()) -> dict[str, StateDict]:
        """Send ``c`` (zero before the first round) with the round's model."""
        self._ensure_variate(reference, buffers)
        return {SERVER_VARIATE: self.c}

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Start a round's merge; ``context.num_nodes`` is the run's ``N``."""
        super().begin(reference, buffers, context)
        self._ensure_variate(reference, buffers)
        self._change = FedAvg()
        self._change.begin(self.c)
        self._num_nodes = None if context is None else context.num_nodes

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Refused: SCAFFOLD needs each node's ``delta_c_i`` (:meth:`add_reply`)."""
        raise MergeError(f"scaffold needs the {VARIATE_CHANGE!r} record of node {node}'s "
                         "reply; it merges only during federated rounds")

    def add_reply(self, state_dict: StateDict, weight: float, node: str = "?", *,
                  arrays: Mapping[str, StateDict] | None = None, metrics=None) -> None:
        """Fold in ``y_i`` and ``delta_c_i``; a refused reply leaves the merge unchanged.

        Raises
        ------
        MergeError
            No ``scaffold-delta-c`` record, one that does not fit the parameters or holds
            NaN, or a model :meth:`FedAvg.add` refuses.
        """
        change = (arrays or {}).get(VARIATE_CHANGE)
        if change is None:
            raise MergeError(f"reply has no {VARIATE_CHANGE!r} record (is the node running "
                             "this version of fedavg?)")
        change = fitting(change, self.c, f"node {node}'s {VARIATE_CHANGE!r}")
        if any(not torch.isfinite(t).all() for t in change.values()):
            raise MergeError(f"node {node}'s {VARIATE_CHANGE!r} has NaN or infinite values")
        super().add(state_dict, weight, node)
        self._change.add(change, weight, node)

    def result(self):
        """Return the mean model; move ``c`` by ``|S| / N`` of the mean variate change."""
        merged = super().result()
        mean_change = self._change.result().state_dict
        share = merged.num_models / max(self._num_nodes or merged.num_models, merged.num_models)
        for k in self.c:
            self.c[k] = self.c[k] + share * mean_change[k]
        return merged

    def state(self) -> dict[str, Any]:
        """``c.<parameter>``: the server control variate."""
        return {} if self.c is None else {f"c.{k}": v for k, v in self.c.items()}

    def load_state(self, state: Mapping[str, Any], reference: StateDict | None = None) -> None:
        """Continue with a saved ``c``.

        Raises
        ------
        MergeError
            Entries other than ``c.*``, or shapes unlike ``reference``'s.
        """
        self.c = load_variates(self.name, state, "c.", reference)


def load_variates(name: str, state: Mapping[str, Any], prefix: str,
                  reference: StateDict | None) -> dict[str, torch.Tensor] | None:
    """Return the ``prefix``-named tensors of a saved strategy state (``None`` if empty).

    Raises
    ------
    MergeError
        Other entries, non-tensors, or names or shapes that ``reference`` lacks.
    """
    if not state:
        return None
    other = sorted(k for k in state if not k.startswith(prefix))
    if other:
        raise MergeError(f"strategy {name} keeps {prefix}* tensors; the checkpoint holds "
                         f"{other[:3]}")
    out = {}
    for key, value in state.items():
        param = key[len(prefix):]
        if not isinstance(value, torch.Tensor):
            raise MergeError(f"the checkpoint's {key!r} is not a tensor")
        if reference is not None and (param not in reference
                                      or tuple(reference[param].shape) != tuple(value.shape)):
            raise MergeError(f"the checkpoint's {key!r} does not fit the model")
        out[param] = value.float()
    return out
