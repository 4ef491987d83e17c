"""Task arithmetic: the start plus a scaled mean of the nodes' task vectors.

Ilharco et al. 2023, Editing Models with Task Arithmetic, arXiv:2212.04089. Node ``k``'s
task vector is ``tau_k = w_k - w_0``: its trained weights minus the weights every node
started from (the run's initial or pretrained model for a one-shot merge, the round's global
model per round). The merge is ``w_0 + lambda * sum_k n_k tau_k / sum_k n_k`` with sample
counts ``n_k``; the paper's unweighted sum with scale ``lambda'`` is ``lambda = K lambda'``
for ``K`` equal-sized nodes, and ``lambda = 1`` is FedAvg.

:class:`TaskVectorMerge` is the shared frame of the task-vector methods that need every
node's vector at once (TIES, DARE): every node model is kept until the merge (memory
O(nodes x model)); each trained
floating parameter is merged from its task vectors; floating buffers (BatchNorm running
statistics) take the sample-weighted average of the node models, integer buffers their
maximum. With LoRA nodes merged exactly (:mod:`strategies.lora`), each node's model holds
``W + s B_k A_k``, so its task vector of an adapted weight is its adapter product
``s B_k A_k``, and every method here applies to the products.
"""

from __future__ import annotations

import torch

from strategies.base import Merged, Option, StateDict, is_float, register
from strategies.fedavg import FedAvg
from strategies.robust import _Collect

MERGE_SCALE = Option("merge_scale", float, 1.0, "Scale of the merged task vector added to the "
                     "start (> 0, at most 100; 1: its weighted mean)")
#: The largest ``merge_scale``: the paper's sum of K task vectors at scale l is K * l of the
#: mean, and its best l stay near 1 (0.3-1 over 8 tasks); far larger scales only swamp the
#: start (at 1e39 float32 overflows).
MAX_SCALE = 100.0


def check_scale(scale: float) -> None:
    """Refuse a ``merge_scale`` not in (0, 100] (``ValueError`` naming the option)."""
    if not 0 < scale <= MAX_SCALE:
        raise ValueError(f"--merge-scale must be > 0 and at most {MAX_SCALE:g} (got {scale})")


def trained_floats(reference: StateDict, buffers=frozenset()) -> dict:
    """Return the start's trained floating parameters (no buffers): task vectors start there."""
    return {k: v.detach() for k, v in reference.items()
            if is_float(v.dtype) and k not in buffers}


class _FromStart:
    """A merge scaled by ``--merge-scale`` from the start every node trained from."""

    needs_start = True
    options = (MERGE_SCALE,)

    def check(self) -> None:
        """``merge_scale`` must be > 0."""
        check_scale(self.merge_scale)

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Start a merge from ``reference``, the model every node started from."""
        super().begin(reference, buffers, context)
        self._start = trained_floats(reference, buffers)


class TaskVectorMerge(_FromStart, _Collect):
    """Merge node models through their task vectors from the start ``begin`` is given.

    Subclasses implement :meth:`combine_vectors`.
    """

    def combine(self) -> Merged:
        """Return ``start + merge_scale * combine_vectors(...)`` for every trained parameter."""
        out = self._integers(self._models)
        weights = torch.tensor(self._weights, dtype=torch.float64)
        for key, (_, dtype) in self._sig.items():
            if not is_float(dtype):
                continue
            stack = self._stack(key)
            if key in self._start:
                start = self._start[key].to(torch.float64)
                vector = self.combine_vectors(key, stack - start, weights)
                out[key] = (start + self.merge_scale * vector).to(dtype)
            else:  # a buffer: the plain weighted average
                out[key] = _weighted_mean(stack, weights).to(dtype)
        return Merged(out, len(self._models), sum(self._weights), info=self.info())

    def combine_vectors(self, key: str, vectors: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """Return one merged task vector of parameter ``key``.

        Parameters
        ----------
        key : str
            The parameter's state-dict name.
        vectors : torch.Tensor
            ``(K, *shape)`` float64: each node's task vector, in the order added.
        weights : torch.Tensor
            ``(K,)`` float64 sample counts, > 0.
        """
        raise NotImplementedError

    def info(self) -> dict:
        """Return facts about the merge for the run's metadata (default: none)."""
        return {}


def _weighted_mean(stack: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k x_k / sum_k w_k`` over the first dimension of ``stack`` ``(K, ...)``."""
    shape = (-1,) + (1,) * (stack.dim() - 1)
    return (stack * weights.view(shape)).sum(0) / weights.sum()


@register
class TaskArithmetic(_FromStart, FedAvg):
    """The start plus ``merge_scale`` times the sample-weighted mean task vector.

    That is ``w_0 + lambda * (FedAvg - w_0)``: folded in one model at a time like FedAvg, so
    its memory is one state dict whatever the number of nodes.

    Parameters
    ----------
    merge_scale : float
        ``lambda`` (> 0); 1 is FedAvg, above 1 extrapolates along the nodes' mean update.
    """

    name = "task-arithmetic"
    description = "start + merge_scale x weighted mean of the task vectors (w_k - w_0)"
    paper = "Ilharco et al. 2023, Editing Models with Task Arithmetic, arXiv:2212.04089"

    def result(self) -> Merged:
        """Return ``start + merge_scale * (weighted mean - start)``; buffers keep the mean."""
        merged = super().result()
        for key, start in self._start.items():
            mean, w0 = merged.state_dict[key], start.to(torch.float64)
            merged.state_dict[key] = (w0 + self.merge_scale * (mean.to(torch.float64) - w0)
                                      ).to(mean.dtype)
        return merged
