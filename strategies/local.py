"""Node-side rules: the local-training half of methods that change what a node does.

Most strategies only merge; SCAFFOLD, FedNova, MOON and FedDyn also change a node's local
training (a gradient correction, an extra loss term, a reported step count) and may keep
state on the node from one of its rounds to the next. Such a strategy names a
:class:`NodeRule` subclass in its ``node_rule`` attribute; the node builds one per round
(:func:`node_rule`), and the training loop calls it:

1. :meth:`NodeRule.begin` with the model as received, the extra arrays the coordinator sent
   (:meth:`strategies.Strategy.to_nodes`) and the node's state of its last round (or ``None``);
2. :meth:`NodeRule.loss` for each batch, added to the cross-entropy;
3. :meth:`NodeRule.before_step` after each backward pass, before the optimizer steps;
4. :meth:`NodeRule.finish` once: the extra arrays and metrics of the reply, and the state to
   keep until the node's next round;
5. :meth:`NodeRule.close`, even when training failed.

Plain PyTorch, no Flower import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from strategies.tensors import MergeError, StateDict


@dataclass
class NodeUpdate:
    """What a node rule adds to the node's reply, and what the node keeps.

    Attributes
    ----------
    arrays : dict of str to state dict
        Extra array records of the reply (e.g. SCAFFOLD's control-variate change).
    metrics : dict of str to float
        Extra metrics of the reply (e.g. FedNova's normalising factor).
    state : state dict, optional
        Kept on the node (Flower's per-node ``Context.state``) until its next round.
    """

    arrays: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, torch.Tensor] | None = None


class NodeRule:
    """The node side of a method; one instance per node and round.

    Parameters
    ----------
    options : mapping
        The strategy's options (:meth:`strategies.Strategy.node_options`).
    momentum : float
        The node optimizer's momentum (SGD), in [0, 1).
    """

    optimizers: tuple[str, ...] = ("sgd", "adam")
    """The node optimizers the method's update rule holds for."""

    def __init__(self, options: Mapping[str, Any], momentum: float = 0.0) -> None:
        self.options = dict(options)
        self.momentum = momentum
        self.lrs: list[float] = []

    def begin(self, model: torch.nn.Module, received: Mapping[str, StateDict],
              state: StateDict | None) -> None:
        """Start a round: ``model`` holds the global weights; ``state`` is the node's own.

        Raises
        ------
        strategies.MergeError
            ``received`` lacks an array record the method needs, or it does not fit.
        """

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor,
             logits: torch.Tensor) -> torch.Tensor | None:
        """Return a term added to this batch's loss, or ``None``."""
        return None

    def before_step(self, model: torch.nn.Module, lr: float) -> None:
        """After the backward pass of a step taken with learning rate ``lr``."""
        self.lrs.append(lr)

    def finish(self, model: torch.nn.Module) -> NodeUpdate:
        """Return the reply's extras and the state kept; ``model`` is the trained model."""
        return NodeUpdate()

    def close(self) -> None:
        """Undo anything done to ``model`` (hooks); called after training, even on error."""


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return ``model``'s trainable parameters by state-dict name (no copies)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return detached copies of ``model``'s trainable parameters, by name."""
    return {name: p.detach().clone() for name, p in parameters(model).items()}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return detached copies of every parameter entry of ``model``'s state dict.

    Frozen parameters and second names of a shared one included: the state-dict entries a
    coordinator counts as parameters (every floating entry that is not a buffer). An
    integer parameter (never trained) is left out, and so is a parameter the model's state
    dict does not hold (a LoRA model's frozen base, which never travels).
    """
    entries = model.state_dict(keep_vars=True)
    return {name: p.detach().clone()
            for name, p in model.named_parameters(remove_duplicate=False)
            if p.is_floating_point() and name in entries}


def fitting(arrays: Mapping[str, torch.Tensor] | None, like: Mapping[str, torch.Tensor],
            what: str) -> dict[str, torch.Tensor] | None:
    """Return ``arrays`` as float tensors shaped like ``like``, or ``None`` if none given.

    Raises
    ------
    strategies.MergeError
        A name of ``like`` missing from ``arrays``, or a shape that differs.
    """
    if arrays is None:
        return None
    out = {}
    for name, ref in like.items():
        if name not in arrays:
            raise MergeError(f"{what} has no {name!r}")
        t = arrays[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise MergeError(f"{what}'s {name!r} is {tuple(t.shape)}, the model's "
                             f"{tuple(ref.shape)}")
        out[name] = t.detach().to(ref.device, ref.dtype)
    return out


def node_rule(strategy: str, options: Mapping[str, Any], momentum: float = 0.0) -> NodeRule | None:
    """Return the node rule of the registered ``strategy``, or ``None`` if it has none.

    Raises
    ------
    strategies.UnknownStrategyError
        No strategy of that name.
    """
    from strategies.base import strategy_class

    cls = strategy_class(strategy).node_rule
    return None if cls is None else cls(options, momentum)
