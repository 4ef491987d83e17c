"""LoRA adapters on a frozen pretrained base (``peft``): what nodes train and send.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) freezes a pretrained weight ``W`` and trains ``s * B @ A`` beside it, with
``A`` ``(r, in)``, ``B`` ``(out, r)``, ``s = alpha / r``. ``peft``'s
``inject_adapter_in_model`` puts the adapters into the model in place; the new classifier
head stays trainable.

:class:`LoraModel`'s ``state_dict()`` holds only what travels between coordinator and nodes
(:meth:`LoraModel.travelling`): the adapters, the head and the buffers (BatchNorm
statistics), and with the ``exact`` merge also the adapted weights ``W``, which the
coordinator changes (:mod:`strategies.lora`). Every run stage that saves, sends or merges a
state dict therefore handles only those tensors. The frozen rest is built by every copy from
its own install of the pretrained weights, and :attr:`LoraSpec.base_sha256` must match.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
from torch import nn

from fedavg.util.errors import UserError
from fedavg.util.units import size

#: ``--lora-merge`` values: ``average`` (A and B averaged separately), ``exact`` (the average
#: of the nodes' products ``B_k A_k``, :mod:`strategies.lora`).
LORA_MERGES = ("exact", "average")
#: Default adapted layers, by the module names a model has (the first set it has wins).
DEFAULT_TARGETS = (
    ("query", "value"),  # BERT, ViT and other attention in transformers
    ("q_proj", "v_proj"),  # LLaMA-like, BART
    ("conv_pw", "conv_pwl", "conv_head"),  # timm EfficientNet / MobileNet: pointwise convs
)


@dataclass(frozen=True)
class LoraSpec:
    """How a model's LoRA adapters are made and merged (stored in ``model.json``).

    Attributes
    ----------
    rank : int
        ``r``, the adapters' rank (>= 1).
    alpha : float
        Scaling numerator: the update is ``alpha / r * B @ A``.
    dropout : float
        Dropout on the adapters' input, in [0, 1).
    targets : tuple of str
        Names (last parts) of the adapted modules, e.g. ``("query", "value")``.
    merge : str
        One of :data:`LORA_MERGES`.
    head : str
        The classifier head's module name (trained in full, never adapted).
    base_sha256 : str
        SHA-256 of the pretrained weights every copy builds its frozen base from.
    """

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    merge: str
    head: str = ""
    base_sha256: str = ""

    @property
    def scaling(self) -> float:
        """``alpha / r``."""
        return float(self.alpha) / int(self.rank)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON and the wire."""
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LoraSpec:
        """Inverse of :meth:`as_dict`."""
        return cls(int(raw["rank"]), float(raw["alpha"]), float(raw["dropout"]),
                   tuple(raw["targets"]), str(raw["merge"]), str(raw.get("head", "")),
                   str(raw.get("base_sha256", "")))


def head_name(net: nn.Module, num_classes: int) -> str:
    """Return the name of ``net``'s classifier head: its last ``Linear`` with K outputs.

    Raises
    ------
    UserError
        No such layer.
    """
    found = [name for name, m in net.named_modules()
             if isinstance(m, nn.Linear) and m.out_features == int(num_classes)]
    if not found:
        raise UserError(f"--lora-rank: the model has no Linear head with {num_classes} outputs "
                        "to train beside the adapters")
    return found[-1]


def default_targets(net: nn.Module, head: str) -> tuple[str, ...]:
    """Return the modules to adapt when ``--lora-targets`` is not given.

    Attention query and value projections (Hu et al.'s choice), pointwise convolutions of a
    timm EfficientNet, else every ``Linear`` layer but the head (by full name).
    """
    names = {name.rsplit(".", 1)[-1] for name, _ in net.named_modules()}
    for targets in DEFAULT_TARGETS:
        if set(targets) <= names:
            return targets
    linear = [name for name, m in net.named_modules()  # full names: "0" alone is ambiguous
              if isinstance(m, nn.Linear) and name != head and not name.startswith(head + ".")]
    if not linear:
        raise UserError("--lora-rank: the model has no Linear layer beside its head to adapt; "
                        "name the layers with --lora-targets")
    return tuple(linear)


class LoraModel(nn.Module):
    """A pretrained network with ``peft`` LoRA adapters; its state dict is what travels.

    Parameters
    ----------
    net : torch.nn.Module
        The network, pretrained weights loaded, mapping a batch to ``(N, K)`` logits.
    spec : LoraSpec
        Rank, scaling, dropout, targets, merge and head (``spec.head`` set).

    Raises
    ------
    UserError
        ``peft`` missing, or targets that name no layer of ``net`` or a layer peft cannot
        adapt.
    """

    def __init__(self, net: nn.Module, spec: LoraSpec) -> None:
        super().__init__()
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError:
            raise UserError("--lora-rank needs peft: pip install 'fedavg[pretrained]'") from None
        config = LoraConfig(r=int(spec.rank), lora_alpha=float(spec.alpha),
                            lora_dropout=float(spec.dropout), target_modules=list(spec.targets),
                            exclude_modules=[spec.head], bias="none")
        try:
            inject_adapter_in_model(config, net)
        except (ValueError, TypeError, RuntimeError) as exc:
            said = str(exc).splitlines()[0]
            if "groups=" in said:  # peft's advice (another rank) leads to an unmergeable layer
                said = ("a grouped (depthwise) convolution, whose LoRA update cannot be "
                        "merged into its weight; adapt pointwise convolutions or Linear layers")
            raise UserError(f"--lora-targets {','.join(spec.targets)}: {said}") from None
        grouped = next((name for name, m in net.named_modules() if hasattr(m, "lora_A")
                        and getattr(getattr(m, "base_layer", None), "groups", 1) > 1), None)
        if grouped is not None:
            raise UserError(f"--lora-targets: {grouped} is a grouped (depthwise) convolution, "
                            "whose LoRA update cannot be merged into its weight; adapt "
                            "pointwise convolutions or Linear layers")
        for p in net.get_submodule(spec.head).parameters():
            p.requires_grad_(True)
        self.net = net
        self.spec = spec
        self.fedavg_notes: list[str] = []
        self.layers = {name[len("net."):]: spec.scaling for name, m in self.named_modules()
                       if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
        self._travelling = self.travelling()
        self._pretrained = {k: t.detach().clone() for k, t in super().state_dict().items()
                            if k in self.downlink_only()}  # W as built: a node's round 0
        self.fedavg_notes = [*getattr(net, "fedavg_notes", []), self.describe()]

    def describe(self) -> str:
        """Say what is adapted, trained and sent, in one line (shown with the run's plan)."""
        total = sum(t.numel() for t in self.full_state_dict().values())
        trained = sum(p.numel() for p in self.parameters() if p.requires_grad)
        sent = sum(t.numel() * t.element_size() for t in self.state_dict().values())
        back = sent - sum(t.numel() * t.element_size() for k, t in self.state_dict().items()
                          if k in self.downlink_only())
        s = self.spec
        return (f"LoRA r={s.rank}, alpha={s.alpha:g} on {len(self.layers)} layers "
                f"({','.join(s.targets)}), head {s.head} trained in full: {trained:,} of "
                f"{total:,} values trained ({100 * trained / max(total, 1):.2f} %); "
                f"{s.merge} merge; a node gets {size(sent)} and sends {size(back)} per round")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the network: a batch -> ``(N, K)`` logits."""
        return self.net(x)

    def travelling(self) -> frozenset[str]:
        """Return the state-dict keys that travel between coordinator and nodes.

        Trainable tensors, buffers and, for the ``exact`` merge, the adapted weights (the
        coordinator folds the nodes' updates into them).
        """
        keys = {name for name, p in self.named_parameters() if p.requires_grad}
        keys |= {name for name, _ in self.named_buffers()}
        if self.spec.merge == "exact":
            keys |= {f"net.{prefix}.base_layer.weight" for prefix in self.layers}
        return frozenset(k for k in super().state_dict() if k in keys)

    def downlink_only(self) -> frozenset[str]:
        """Return the travelling keys nodes do not send back: the adapted weights (``exact``).

        Nodes never change them; the coordinator folds the updates in
        (:func:`strategies.lora.fold_reply`).
        """
        if self.spec.merge != "exact":
            return frozenset()
        return frozenset(f"net.{prefix}.base_layer.weight" for prefix in self.layers)

    def pretrained_weights(self) -> dict[str, torch.Tensor]:
        """Return the adapted weights as built from the pretrained base (``exact`` only)."""
        return self._pretrained

    def adapted_layers(self) -> dict[str, float]:
        """Adapted layer prefix (as in the state dict) -> scaling ``alpha / r``."""
        return {f"net.{prefix}": scaling for prefix, scaling in self.layers.items()}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Return the travelling tensors only (:meth:`travelling`), as ``nn.Module`` does."""
        full = super().state_dict(*args, destination=None, prefix=prefix, keep_vars=keep_vars)
        out = OrderedDict((k, v) for k, v in full.items() if k[len(prefix):] in self._travelling)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False):
        """Load travelling tensors; with ``strict``, exactly :meth:`travelling`'s keys.

        Raises
        ------
        RuntimeError
            ``strict`` and keys missing or unexpected (as ``nn.Module`` raises).
        """
        missing = sorted(self._travelling - set(state_dict))
        unexpected = sorted(set(state_dict) - self._travelling)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for LoraModel: missing keys "
                               f"{missing[:3]}, unexpected keys {unexpected[:3]}")
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return type(result)(missing, result.unexpected_keys)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model, frozen base included (``nn.Module``'s state dict)."""
        return dict(super().state_dict())


def wrap(net: nn.Module, spec: LoraSpec, num_classes: int) -> LoraModel:
    """Adapt ``net`` as ``spec`` says, finding its head and default targets when not given."""
    head = spec.head or head_name(net, num_classes)
    targets = spec.targets or default_targets(net, head)
    from dataclasses import replace

    return LoraModel(net, replace(spec, head=head, targets=tuple(targets)))
