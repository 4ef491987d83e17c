"""Fisher-weighted merging, Matena and Raffel 2022, arXiv:2111.09832.

Each node sends, with its model ``w_k``, the diagonal of its model's Fisher information
``F_k`` (one non-negative tensor per trained parameter): the expected squared gradient of the
log-likelihood, ``E_x E_{y ~ p(y|x)} [(d log p(y|x) / dw)^2]``. The merge weights every
entry by it, ``w = sum_k n_k F_k w_k / sum_k n_k F_k`` (``n_k`` the node's sample count, the
paper's merging coefficients), so a node's entry counts as much as its data constrains it.
Entries no node's Fisher constrains (all ``F_k = 0``), parameters with no estimate (frozen
ones) and buffers take the sample-weighted average; integer buffers their maximum.

The node side (:class:`FisherNode`) keeps the first ``fisher_samples`` inputs it trains on
(the batches are shuffled) and, once trained, estimates ``F_k`` on them in evaluation mode:
per input one label drawn from the model's own prediction (the true Fisher, as the paper
does, not the "empirical" one on the data's labels), one backward pass each. It changes no
training step. The estimate is one more model-sized message from each node (its bytes are
counted with the reply), and ``--save-node-models`` keeps it as ``fisher.safetensors`` beside
each node model so that ``fedavg merge --strategy fisher`` can use it.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import torch
from torch import nn

from strategies.base import Merged, MergeError, Option, StateDict, Strategy, is_float, register
from strategies.fedavg import FedAvg
from strategies.local import NodeRule, NodeUpdate, parameters

#: The reply's array record holding a node's Fisher estimate.
FISHER = "fisher"


def diagonal_fisher(model: nn.Module, inputs: list[torch.Tensor],
                    generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Estimate the diagonal Fisher of ``model``'s trainable parameters on ``inputs``.

    Parameters
    ----------
    model : torch.nn.Module
        A classifier returning ``(1, K)`` logits for a ``(1, ...)`` input.
    inputs : list of torch.Tensor
        Model inputs, each ``(1, ...)`` (one sample), on the model's device.
    generator : torch.Generator
        CPU generator drawing each sample's label from the model's prediction.

    Returns
    -------
    dict of str to torch.Tensor
        Per trainable parameter (state-dict name), the mean over ``inputs`` of the squared
        gradient of ``log p(y|x)``, float32 on the CPU; all zeros without inputs.
    """
    params = parameters(model)
    fisher = {k: torch.zeros(p.shape, dtype=torch.float32) for k, p in params.items()}
    was_training = model.training
    model.eval()
    try:
        for x in inputs:
            model.zero_grad(set_to_none=True)
            log_p = torch.log_softmax(model(x).float(), dim=1)[0]
            y = int(torch.multinomial(log_p.detach().exp().cpu(), 1, generator=generator))
            log_p[y].backward()
            for k, p in params.items():
                if p.grad is not None:
                    fisher[k] += p.grad.detach().float().cpu() ** 2
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {k: f / max(1, len(inputs)) for k, f in fisher.items()}


class FisherNode(NodeRule):
    """Node side: keep the first inputs trained on; estimate the Fisher once trained."""

    def begin(self, model, received, state) -> None:
        """Start keeping inputs (up to ``fisher_samples``)."""
        self.limit = int(self.options["fisher_samples"])
        self.kept: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def loss(self, model, inputs, logits) -> None:
        """Keep this batch's inputs while fewer than ``fisher_samples`` are kept; add nothing."""
        if inputs is self._last or len(self.kept) >= self.limit:  # SAM's second pass
            return None
        self._last = inputs
        for i in range(min(len(inputs), self.limit - len(self.kept))):
            self.kept.append(inputs[i:i + 1].detach())
        return None

    def finish(self, model) -> NodeUpdate:
        """Send the Fisher estimate of the trained model on the kept inputs."""
        seed = zlib.crc32(b"".join(x.cpu().numpy().tobytes() for x in self.kept[:4]))
        fisher = diagonal_fisher(model, self.kept, torch.Generator().manual_seed(seed))
        self.kept = []
        return NodeUpdate(arrays={FISHER: fisher})


@register
class Fisher(Strategy):
    """Merge each parameter entry weighted by the nodes' diagonal Fisher information.

    Parameters
    ----------
    fisher_samples : int
        Inputs each node estimates its Fisher on (>= 1; one backward pass each).
    """

    name = "fisher"
    description = "each entry weighted by the nodes' diagonal Fisher information"
    paper = ("Matena and Raffel 2022, Merging Models with Fisher-Weighted Averaging, "
             "arXiv:2111.09832")
    options = (Option("fisher_samples", int, 256,
                      "Inputs each node estimates its diagonal Fisher on (>= 1)",
                      node_side=True),)
    node_rule = FisherNode
    trains_nodes = False  # its node rule only measures: saved models merge with their estimates
    saved_extras = (FISHER,)

    def check(self) -> None:
        """``fisher_samples`` must be >= 1."""
        if self.fisher_samples < 1:
            raise ValueError(f"--fisher-samples must be >= 1 (got {self.fisher_samples})")

    def check_setup(self, model: nn.Module, train: Mapping[str, Any]) -> list[str]:
        """Refuse LoRA adapters: the merged weights ``W`` are frozen, so no Fisher of them.

        Raises
        ------
        MergeError
            A model with frozen parameters beside LoRA adapters.
        """
        if int(train.get("lora_rank") or 0) > 0:
            raise MergeError("the weights LoRA adapts stay frozen, so nodes cannot estimate "
                             "their Fisher: use ties, dare or task-arithmetic with --lora-rank")
        return []

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Start a merge of models shaped like ``reference``."""
        self._average = FedAvg()
        self._average.begin(reference, buffers, context)
        self._shapes = {k: v.shape for k, v in reference.items()
                        if is_float(v.dtype) and k not in buffers}
        self._num: dict[str, torch.Tensor] = {}
        self._den: dict[str, torch.Tensor] = {}
        self._keys: set[str] | None = None  # the parameters the first node's estimate covers

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Refuse a model without its Fisher estimate.

        Raises
        ------
        MergeError
            Always: use :meth:`add_reply` with the ``fisher`` record.
        """
        raise MergeError(f"model from node {node} came without its Fisher estimate: fisher "
                         "merges models with their 'fisher' records")

    def add_reply(self, state_dict: StateDict, weight: float, node: str = "?", *,
                  arrays: Mapping[str, StateDict] | None = None,
                  metrics: Mapping[str, float] | None = None) -> None:
        """Fold in a node's model and its Fisher estimate.

        Raises
        ------
        MergeError
            No ``fisher`` record; an empty one, one covering other parameters than the first
            node's or of other shapes, not floating point, or holding negative, NaN or
            infinite values; a model FedAvg refuses. Nothing is folded in then.
        """
        fisher = self._checked((arrays or {}).get(FISHER), node)
        self._average.add(state_dict, weight, node)
        self._keys = set(fisher)
        w = float(weight)
        for key, f in fisher.items():
            f = f.to(torch.float64) * w
            num = f * state_dict[key].detach().to(torch.float64)
            if key in self._num:
                self._num[key] += num
                self._den[key] += f
            else:
                self._num[key], self._den[key] = num, f

    def _checked(self, fisher: StateDict | None, node: str) -> StateDict:
        if fisher is None:
            raise MergeError(f"reply of node {node} has no {FISHER!r} record (is the node "
                             "running this version of fedavg?)")
        if not fisher:
            raise MergeError(f"node {node}'s Fisher estimate holds no parameter")
        keys = self._keys if self._keys is not None else set(fisher)
        if set(fisher) != keys:  # every node estimates the same (trainable) parameters
            odd = sorted(set(fisher) ^ keys)[:3]
            raise MergeError(f"node {node}'s Fisher estimate covers other parameters than the "
                             f"first node's ({', '.join(odd)})")
        for key, f in fisher.items():
            if key not in self._shapes or f.shape != self._shapes[key]:
                raise MergeError(f"node {node}'s Fisher estimate {key!r} does not fit the "
                                 "model's parameters")
            if not f.is_floating_point():
                raise MergeError(f"node {node}'s Fisher estimate {key!r} is {f.dtype}, not "
                                 "floating point")
            if not torch.isfinite(f).all() or (f < 0).any():
                raise MergeError(f"node {node}'s Fisher estimate {key!r} holds negative, NaN "
                                 "or infinite values")
        return fisher

    def result(self) -> Merged:
        """Return the Fisher-weighted model (the plain average where no Fisher constrains)."""
        merged = self._average.result()
        out = dict(merged.state_dict)
        for key, num in self._num.items():
            den = self._den[key]
            average = out[key].to(torch.float64)
            out[key] = torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny),
                                   average).to(out[key].dtype)
        self._num, self._den = {}, {}
        return Merged(out, merged.num_models, merged.total_weight)
