"""Byzantine-robust aggregation: coordinate-wise median, trimmed mean, Krum and Multi-Krum.

These need every node model of a round at once (memory O(nodes x model)). Floating tensors
are aggregated; integer buffers keep their maximum, as in FedAvg.

- FedMedian and trimmed mean: Yin et al. 2018, Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates, arXiv:1803.01498.
- Krum and Multi-Krum: Blanchard et al. 2017, Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent, NeurIPS 2017.
"""

from __future__ import annotations

import math

import torch

from strategies.base import (
    Merged,
    MergeError,
    Option,
    StateDict,
    Strategy,
    check_compatible,
    is_float,
    merge_integer,
    register,
    signature,
)
from strategies.fedavg import FedAvg, check_weight


class _Collect(Strategy):
    """Keep every model of the round; subclasses combine them in ``combine``."""

    def begin(self, reference: StateDict, buffers=frozenset(), context=None) -> None:
        """Start collecting models shaped like ``reference``."""
        self._sig = signature(reference)
        self._models: list[dict[str, torch.Tensor]] = []
        self._weights: list[float] = []
        self._nodes: list[str] = []
        self._context = context
        self._buffers = buffers

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Keep one model (checked like FedAvg's)."""
        weight = check_weight(weight, node)
        check_compatible(self._sig, state_dict, node)
        self._models.append({k: v.detach() for k, v in state_dict.items()})
        self._weights.append(weight)
        self._nodes.append(str(node))

    def result(self) -> Merged:
        """Combine what was collected."""
        if not self._models:
            raise MergeError("nothing to merge: no node models")
        return self.combine()

    def combine(self) -> Merged:
        raise NotImplementedError

    def _integers(self, models) -> dict[str, torch.Tensor]:
        out = {}
        for key, (_, dtype) in self._sig.items():
            if not is_float(dtype):
                acc = None
                for m in models:
                    acc = merge_integer(acc, m[key])
                out[key] = acc
        return out

    def _stack(self, key: str) -> torch.Tensor:
        return torch.stack([m[key].to(torch.float64) for m in self._models])


@register
class FedMedian(_Collect):
    """Coordinate-wise median of the node models (unweighted).

    With an even number of models the two middle values are averaged, as in
    ``numpy.median`` (and Flower's ``FedMedian``).
    """

    name = "fedmedian"
    description = "coordinate-wise median of node models (robust to outliers)"
    paper = ("Yin et al. 2018, Byzantine-Robust Distributed Learning: Towards Optimal "
             "Statistical Rates, arXiv:1803.01498")

    def combine(self) -> Merged:
        """Return the coordinate-wise median of the collected models."""
        n = len(self._models)
        out = self._integers(self._models)
        for key, (_, dtype) in self._sig.items():
            if is_float(dtype):
                ordered = torch.sort(self._stack(key), dim=0).values
                mid = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
                out[key] = mid.to(dtype)
        return Merged(out, n, sum(self._weights))


@register
class TrimmedMean(_Collect):
    """Coordinate-wise mean after dropping the ``beta`` fraction largest and smallest values.

    Parameters
    ----------
    beta : float
        Fraction trimmed at each end, in [0, 0.5). ``floor(beta * n)`` values per side.
    """

    name = "trimmed-mean"
    description = "coordinate-wise mean without the beta largest and smallest values"
    paper = FedMedian.paper

    options = (Option("beta", float, 0.1, "Fraction trimmed at each end, in [0, 0.5)"),)

    def check(self) -> None:
        """``beta`` in [0, 0.5)."""
        if not 0 <= self.beta < 0.5:
            raise ValueError(f"--beta must be in [0, 0.5) (got {self.beta})")

    def nodes_note(self, n: int) -> str | None:
        """Say that a ``beta`` > 0 trims none of ``n`` models per side (``beta * n < 1``)."""
        if self.beta > 0 and math.floor(self.beta * n) == 0:
            least = (f"raise --beta to at least {math.ceil(1000 / n) / 1000:g}" if n >= 3
                     else "trimming needs 3 or more")
            return (f"--beta {self.beta:g} trims floor({self.beta:g} x {n}) = 0 of {n} models "
                    f"per side, so it is a plain mean ({least})")
        return None

    def combine(self) -> Merged:
        """Return the coordinate-wise trimmed mean of the collected models."""
        n = len(self._models)
        cut = int(math.floor(self.beta * n))
        out = self._integers(self._models)
        for key, (_, dtype) in self._sig.items():
            if is_float(dtype):
                ordered = torch.sort(self._stack(key), dim=0).values
                out[key] = ordered[cut: n - cut].mean(dim=0).to(dtype)
        return Merged(out, n, sum(self._weights), info={"trimmed_per_side": cut})


def krum_scores(models: list[dict[str, torch.Tensor]], keys: list[str],
                num_malicious: int) -> torch.Tensor:
    """Krum score of each model: sum of squared distances to its ``n - f - 2`` nearest others.

    Parameters
    ----------
    models : list of state dicts
    keys : list of str
        Floating keys compared.
    num_malicious : int
        ``f``, the number of Byzantine nodes tolerated.

    Returns
    -------
    torch.Tensor
        ``(n,)`` float64 scores; lower is more central.
    """
    flat = torch.stack([torch.cat([m[k].to(torch.float64).reshape(-1) for k in keys])
                        for m in models])
    dist = torch.cdist(flat, flat) ** 2
    n = len(models)
    closest = max(n - num_malicious - 2, 1)
    scores = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1:]])
        scores.append(torch.sort(others).values[:closest].sum() if len(others) else
                      torch.tensor(0.0, dtype=torch.float64))
    return torch.stack(scores)


@register
class Krum(_Collect):
    """Keep the single node model closest to its ``n - f - 2`` nearest neighbours.

    Parameters
    ----------
    num_malicious : int
        ``f``, Byzantine nodes tolerated (>= 0).
    """

    name = "krum"
    description = "the node model nearest to its n-f-2 closest others"
    paper = ("Blanchard et al. 2017, Machine Learning with Adversaries: Byzantine Tolerant "
             "Gradient Descent, NeurIPS")
    keep = 1
    skew_note = ("krum keeps one node's model a round (its analysis assumes alike data on "
                 "every node): on a label-skewed partition the merged model knows what one "
                 "node's data holds (digits, 5 nodes, Dirichlet 0.5, 5 rounds: 0.41 accuracy); "
                 "multi-krum averages the n-f best (0.89 there)")

    options = (Option("num_malicious", int, 0, "Byzantine nodes tolerated, f (>= 0)"),)

    def check(self) -> None:
        """``num_malicious`` >= 0."""
        if self.num_malicious < 0:
            raise ValueError(f"--num-malicious must be >= 0 (got {self.num_malicious})")

    def check_nodes(self, n: int) -> None:
        """Krum's guarantee needs ``n > 2f + 2`` node models per merge."""
        f = self.num_malicious
        if f > 0 and n <= 2 * f + 2:
            raise ValueError(f"--num-malicious {f} needs more than 2f+2 = {2 * f + 2} node "
                             f"models per merge, got {n}: lower --num-malicious or merge more "
                             "nodes")

    def _selected(self) -> list[int]:
        keys = [k for k, (_, d) in self._sig.items() if is_float(d)]
        scores = krum_scores(self._models, keys, self.num_malicious)
        k = self.keep if self.keep else max(len(self._models) - self.num_malicious, 1)
        return torch.argsort(scores, stable=True)[:k].tolist()

    def combine(self) -> Merged:
        """Return the sample-weighted average of the best-scored models (Krum: the single best)."""
        chosen = self._selected()
        avg = FedAvg().merge([self._models[i] for i in chosen],
                             [self._weights[i] for i in chosen],
                             [self._nodes[i] for i in chosen])
        avg.num_models = len(self._models)
        avg.info = {"selected_nodes": [self._nodes[i] for i in chosen]}
        return avg


@register
class MultiKrum(Krum):
    """Sample-weighted average of the ``n - f`` node models with the best Krum scores."""

    name = "multi-krum"
    description = "average of the n-f node models with the best Krum scores"
    paper = Krum.paper
    keep = 0  # n - f
    skew_note = ""
