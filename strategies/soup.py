"""Model soups: averages of fully trained models, Wortsman et al. 2022, arXiv:2203.05482.

- ``uniform-soup``: the unweighted parameter average of every node model.
- ``greedy-soup``: members sorted by held-out accuracy; each is added to the soup only if the
  soup's held-out accuracy does not drop (Algorithm 1 of the paper). Needs a validation set,
  never the test split.
"""

from __future__ import annotations

from strategies.base import Merged, MergeError, register
from strategies.fedavg import FedAvg
from strategies.robust import _Collect


@register
class UniformSoup(FedAvg):
    """Unweighted parameter average of the final node models."""

    name = "uniform-soup"
    description = "one-shot: unweighted parameter average of the final node models"
    paper = ("Wortsman et al. 2022, Model soups: averaging weights of multiple fine-tuned "
             "models improves accuracy without increasing inference time, arXiv:2203.05482")
    one_shot = True
    secure_sum = False  # unweighted: a secure sum weighs the nodes by their samples

    def add(self, state_dict, weight, node="?") -> None:
        """Fold in one model with weight 1 (``weight`` is still checked)."""
        super().add(state_dict, 1.0 if weight and weight > 0 else weight, node)


@register
class GreedySoup(_Collect):
    """Add members in order of held-out accuracy while held-out accuracy does not drop."""

    name = "greedy-soup"
    description = "one-shot: add models by held-out accuracy while the soup's accuracy holds"
    paper = UniformSoup.paper
    one_shot = True
    needs_validation = True

    def combine(self) -> Merged:
        """Return the greedy soup of the collected models and its held-out accuracy."""
        ctx = self._context
        if ctx is None or ctx.val_x is None:
            raise MergeError("greedy-soup needs a validation set (--validation)")

        def val_acc(sd) -> float:
            return ctx.accuracy(ctx.probabilities(sd, ctx.val_x))

        scores = [val_acc(m) for m in self._models]
        order = sorted(range(len(self._models)), key=lambda i: -scores[i])
        soup = [order[0]]
        best_sd = self._models[order[0]]
        best = scores[order[0]]
        for i in order[1:]:
            candidate = UniformSoup().merge([self._models[j] for j in soup + [i]],
                                            [1.0] * (len(soup) + 1)).state_dict
            acc = val_acc(candidate)
            if acc >= best:
                soup.append(i)
                best, best_sd = acc, candidate
        return Merged(dict(best_sd), len(self._models), sum(self._weights), info={
            "members": [self._nodes[i] for i in soup],
            "member_val_accuracy": {self._nodes[i]: round(scores[i], 6) for i in order},
            "val_accuracy": round(best, 6),
        })
