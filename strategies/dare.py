"""DARE: drop a fraction of each task vector at random and rescale the rest; and DARE-TIES.

Yu et al. 2024, Language Models are Super Mario: Absorbing Abilities from Homologous Models
as a Free Lunch, arXiv:2311.03099. Each node's task vector ``tau_k = w_k - w_0``
(:mod:`strategies.task_arithmetic`) keeps each entry with probability ``1 - p`` and is
rescaled by ``1 / (1 - p)``, so its expectation is ``tau_k`` again; then

- ``dare``: the sample-weighted mean of the dropped vectors (task arithmetic);
- ``dare-ties``: TIES's sign election and disjoint mean over them (:mod:`strategies.ties`),
  DARE's drop taking the place of TIES's trim.

The merge is ``w_0 + merge_scale * tau``. Drops are seeded: the run's ``--seed``, the
parameter, the merge's number (rounds since the run began, kept on resume) and the task
vector's own bytes fix each mask, whatever order the nodes' models arrive in.
"""

from __future__ import annotations

import zlib
from typing import Any, Mapping

import torch

from strategies.base import MergeError, Option, StateDict, register
from strategies.task_arithmetic import TaskVectorMerge, _weighted_mean
from strategies.ties import elect_and_merge


def drop_and_rescale(vector: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Zero each entry of ``vector`` with probability ``p``; scale the rest by ``1/(1-p)``.

    Parameters
    ----------
    vector : torch.Tensor
        A task vector of any shape (floating).
    p : float
        Drop rate in [0, 1).
    generator : torch.Generator
        CPU generator that draws the mask.

    Returns
    -------
    torch.Tensor
        A new tensor of ``vector``'s shape whose expectation over masks is ``vector``.
    """
    keep = torch.rand(vector.shape, generator=generator, dtype=torch.float64) >= p
    return torch.where(keep.to(vector.device), vector / (1.0 - p), torch.zeros_like(vector))


def mask_seed(seed: int, merge: int, key: str, vector: torch.Tensor) -> int:
    """Return the seed of task vector ``vector``'s mask (parameter ``key``, merge ``merge``).

    The vector's own bytes enter the seed: each node's mask is the same whichever id the
    node has and in whichever order its model arrives, and nodes' masks differ.
    """
    content = zlib.crc32(vector.detach().cpu().contiguous().numpy().tobytes())
    return zlib.crc32(f"{seed}/{merge}/{key}/{content}".encode())


@register
class Dare(TaskVectorMerge):
    """Drop and rescale each task vector, then take their sample-weighted mean.

    Parameters
    ----------
    drop_rate : float
        ``p``, the fraction of each task vector's entries dropped, in [0, 1).
    merge_scale : float
        ``lambda`` (> 0), the scale of the merged task vector.
    """

    name = "dare"
    description = "DARE: drop task-vector entries at random, rescale by 1/(1-p), average"
    paper = ("Yu et al. 2024, Language Models are Super Mario: Absorbing Abilities from "
             "Homologous Models as a Free Lunch, arXiv:2311.03099")
    options = TaskVectorMerge.options + (
        Option("drop_rate", float, 0.5, "Fraction of each task vector's entries DARE drops "
                                        "at random, in [0, 1)"),)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._merges = 0

    def check(self) -> None:
        """``drop_rate`` in [0, 1), ``merge_scale`` > 0."""
        super().check()
        if not 0 <= self.drop_rate < 1:
            raise ValueError(f"--drop-rate must be in [0, 1) (got {self.drop_rate})")

    def combine(self):
        """Merge, then count the merge (the next one draws other masks)."""
        merged = super().combine()
        self._merges += 1
        return merged

    def dropped(self, key: str, vectors: torch.Tensor) -> torch.Tensor:
        """Each node's task vector of ``key`` dropped and rescaled, ``(K, *shape)``."""
        seed = self._context.seed if self._context is not None else 0
        out = []
        for vector in vectors:
            gen = torch.Generator().manual_seed(mask_seed(seed, self._merges, key, vector))
            out.append(drop_and_rescale(vector, self.drop_rate, gen))
        return torch.stack(out)

    def combine_vectors(self, key, vectors, weights):
        """Return the sample-weighted mean of the dropped vectors."""
        return _weighted_mean(self.dropped(key, vectors), weights)

    def info(self) -> dict:
        """Return the merge's number, which fixed its masks."""
        return {"dare_merge": self._merges}

    def state(self) -> dict[str, Any]:
        """How many merges ran (their masks are not drawn again)."""
        return {"merges": self._merges}

    def load_state(self, state: Mapping[str, Any], reference: StateDict | None = None) -> None:
        """Go on counting merges from a checkpoint's count."""
        if set(state) - {"merges"} or not isinstance(state.get("merges", 0), int):
            raise MergeError(f"strategy {self.name} keeps a merge count; the checkpoint "
                             f"holds {sorted(state)[:3]}")
        self._merges = int(state.get("merges", 0))


@register
class DareTies(Dare):
    """Drop and rescale each task vector, then TIES's sign election and disjoint mean."""

    name = "dare-ties"
    description = "DARE's random drop and rescale, then TIES's sign election and disjoint mean"
    paper = Dare.paper + "; with Yadav et al. 2023, TIES-Merging, arXiv:2306.01708"
    rounds_note = ("DARE-TIES is made for one merge of fine-tuned models; per round its drop "
                   "and sign election train slower than fedavg")

    def combine_vectors(self, key, vectors, weights):
        """Elect signs and average the agreeing dropped entries."""
        return elect_and_merge(self.dropped(key, vectors), weights)
