"""MOON: model-contrastive federated learning, Li et al. 2021, arXiv:2103.16257.

A node adds ``mu * l_con`` to its cross-entropy, where for a batch's representation ``z``
(local model), ``z_glob`` (the round's global model) and ``z_prev`` (the node's own model
after its previous round)

    l_con = -log( exp(sim(z, z_glob) / T) / (exp(sim(z, z_glob) / T) + exp(sim(z, z_prev) / T)) )

with ``sim`` the cosine similarity and ``T`` the temperature: the local representation is
pulled towards the global model's and pushed from the stale local one. The representation
is the input of the model's last ``nn.Linear`` layer (the paper adds a projection head for
it; the built-in models have none). On a node's first round there is no previous model and
the term is left out (with ``z_prev = z_glob``, as in the paper's code, it is the constant
``log 2``). The server merges by FedAvg. Each training step runs two extra forward passes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from strategies.base import MergeError, Option, register
from strategies.fedavg import FedAvg
from strategies.local import NodeRule, NodeUpdate


def last_linear(model: nn.Module) -> nn.Linear:
    """Return the last ``nn.Linear`` among ``model``'s modules (its classifier).

    Raises
    ------
    MergeError
        The model has no ``nn.Linear`` layer.
    """
    found = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not found:
        raise MergeError("moon needs a model whose classifier is an nn.Linear layer (its "
                         "input is the representation); this model has none")
    return found[-1]


class _Representation:
    """Records the input of a model's last linear layer at each forward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self.handle = last_linear(model).register_forward_pre_hook(self._keep)

    def _keep(self, _module, inputs) -> None:
        self.value = inputs[0].flatten(1)


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """Return MOON's ``l_con``, the batch mean over ``(N, D)`` representations (nats)."""
    pos = nn.functional.cosine_similarity(z, z_glob, dim=1) / temperature
    neg = nn.functional.cosine_similarity(z, z_prev, dim=1) / temperature
    logits = torch.stack([pos, neg], dim=1)
    return nn.functional.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long,
                                                           device=z.device))


class MoonNode(NodeRule):
    """Node side: the contrastive term; the state is the node's trained model."""

    def begin(self, model, received, state) -> None:
        """Freeze a copy of the global model and, from ``state``, the previous local one."""
        self.mu = float(self.options["moon_mu"])
        self.temperature = float(self.options["temperature"])
        self.hooks: list[_Representation] = []
        if state is None or self.mu == 0:
            return
        glob, prev = copy.deepcopy(model), copy.deepcopy(model)  # before any hook of ours
        try:
            prev.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # wrong keys or shapes
            raise MergeError(f"this node's previous MOON model does not fit: "
                             f"{str(exc).splitlines()[0]}") from None
        self.glob, self.prev = (m.eval().requires_grad_(False) for m in (glob, prev))
        self.hooks = [_Representation(m) for m in (model, self.glob, self.prev)]

    def loss(self, model, inputs, logits) -> torch.Tensor | None:
        """``mu * l_con`` of this batch (``None`` on the node's first round)."""
        if not self.hooks:
            return None
        with torch.no_grad():
            self.glob(inputs)
            self.prev(inputs)
        z, z_glob, z_prev = (h.value for h in self.hooks)
        return self.mu * contrastive_loss(z, z_glob, z_prev, self.temperature)

    def finish(self, model) -> NodeUpdate:
        """Keep the trained model (its whole state dict) for the node's next round."""
        return NodeUpdate(state={k: v.detach().cpu().clone()
                                 for k, v in model.state_dict().items()})

    def close(self) -> None:
        """Remove the hook from the (cached, reused) local model."""
        for hook in self.hooks:
            hook.handle.remove()
        self.hooks = []


@register
class Moon(FedAvg):
    """MOON: FedAvg's merge; nodes add the model-contrastive loss.

    Parameters
    ----------
    moon_mu : float
        Weight of the contrastive term (>= 0; the paper uses 5 on CIFAR-10).
    temperature : float
        Softmax temperature of the contrastive term (> 0; the paper uses 0.5).
    """

    name = "moon"
    description = "FedAvg merge + model-contrastive node loss (global vs previous local)"
    paper = ("Li et al. 2021, Model-Contrastive Federated Learning, arXiv:2103.16257")
    options = (Option("moon_mu", float, 5.0, "MOON contrastive-loss weight mu (>= 0)"),
               Option("temperature", float, 0.5, "MOON contrastive temperature (> 0)"))
    node_rule = MoonNode

    def check_setup(self, model: nn.Module, train) -> list[str]:
        """Refuse a model without an ``nn.Linear``; note one whose representation is its input.

        Raises
        ------
        MergeError
            No ``nn.Linear`` layer in the model.
        """
        head = last_linear(model)
        if {id(p) for p in model.parameters()} <= {id(p) for p in head.parameters()}:
            return ["moon: the model's classifier is its only layer, so its representation is "
                    "the input itself; the contrastive term is constant and moon trains as "
                    "fedavg"]
        return []

    def check(self) -> None:
        """``moon_mu >= 0`` and ``temperature > 0``."""
        if not self.moon_mu >= 0:
            raise ValueError(f"--moon-mu must be >= 0 (got {self.moon_mu})")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (got {self.temperature})")
