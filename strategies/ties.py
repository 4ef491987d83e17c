"""TIES-merging: trim, elect sign, disjoint merge.

Yadav et al. 2023, TIES-Merging: Resolving Interference When Merging Models,
arXiv:2306.01708. From each node's task vector ``tau_k = w_k - w_0``
(:mod:`strategies.task_arithmetic`):

1. **Trim**: keep the ``density`` fraction of its entries largest in magnitude, zero the rest.
   The paper ranks a whole model's task vector at once; here each parameter tensor is ranked
   on its own (the same fraction of every tensor), which needs no model-wide sort.
2. **Elect**: each entry's sign is the sign of the nodes' total trimmed mass,
   ``gamma = sign(sum_k n_k tau_k)``.
3. **Disjoint merge**: each entry is the mean over the nodes whose trimmed entry is non-zero
   and has the elected sign; entries no node agrees on are 0.

The merge is ``w_0 + merge_scale * tau``. Sums and means are weighted by sample counts
``n_k``; with equal counts they are the paper's unweighted ones.
"""

from __future__ import annotations

import math

import torch

from strategies.base import Option, register
from strategies.task_arithmetic import TaskVectorMerge


def trim(vectors: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``ceil(density * n)`` largest-magnitude entries of each row, zero the rest.

    Parameters
    ----------
    vectors : torch.Tensor
        ``(K, *shape)``: one task vector per row, of ``n`` entries each.
    density : float
        Fraction kept, in (0, 1].

    Returns
    -------
    torch.Tensor
        ``(K, *shape)``, the trimmed vectors (a new tensor).
    """
    flat = vectors.reshape(len(vectors), -1)
    keep = max(1, math.ceil(density * flat.shape[1]))
    if keep >= flat.shape[1]:
        return vectors.clone()
    idx = flat.abs().topk(keep, dim=1).indices
    out = torch.zeros_like(flat)
    out.scatter_(1, idx, flat.gather(1, idx))
    return out.view_as(vectors)


def elect_and_merge(vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Elect each entry's sign by weighted mass and average the agreeing non-zero entries.

    Parameters
    ----------
    vectors : torch.Tensor
        ``(K, *shape)`` task vectors (trimmed or dropped).
    weights : torch.Tensor
        ``(K,)`` weights, > 0.

    Returns
    -------
    torch.Tensor
        ``(*shape)``: per entry, ``sum_k w_k t_k [agree] / sum_k w_k [agree]``; 0 where no
        node agrees with the elected sign (or the mass is 0).
    """
    w = weights.view((-1,) + (1,) * (vectors.dim() - 1)).to(vectors.dtype)
    sign = torch.sign((vectors * w).sum(0))
    agree = (torch.sign(vectors) == sign) & (vectors != 0)
    share = (w * agree).sum(0)
    total = (vectors * w * agree).sum(0)
    return torch.where(share > 0, total / share.clamp_min(torch.finfo(share.dtype).tiny),
                       torch.zeros_like(total))


@register
class Ties(TaskVectorMerge):
    """Trim each task vector to its top ``density``, elect signs, average the agreeing entries.

    Parameters
    ----------
    density : float
        Fraction of each task vector's entries kept, in (0, 1] (the paper's ``k``: 0.2).
    merge_scale : float
        ``lambda`` (> 0), the scale of the merged task vector (the paper's default 1).
    """

    name = "ties"
    description = "TIES: trim task vectors to their top entries, elect signs, disjoint mean"
    paper = ("Yadav et al. 2023, TIES-Merging: Resolving Interference When Merging Models, "
             "arXiv:2306.01708")
    rounds_note = ("TIES is made for one merge of fine-tuned models; per round it keeps only "
                   "--density of each update and trains slower than fedavg")
    options = TaskVectorMerge.options + (
        Option("density", float, 0.2, "Fraction of each task vector's entries TIES keeps, "
                                      "by magnitude, in (0, 1]"),)

    def check(self) -> None:
        """``density`` in (0, 1], ``merge_scale`` > 0."""
        super().check()
        if not 0 < self.density <= 1:
            raise ValueError(f"--density must be in (0, 1] (got {self.density})")

    def combine_vectors(self, key, vectors, weights):
        """Trim, elect, disjoint mean."""
        return elect_and_merge(trim(vectors, self.density), weights)
