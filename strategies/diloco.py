"""DiLoCo: many local AdamW steps on each node, then an outer Nesterov step over the average.

Douillard et al. 2023, DiLoCo: Distributed Low-Communication Training of Language Models,
arXiv:2311.08105. Each round every node takes ``H`` inner AdamW steps from the global weights
``w`` (``--local-steps``, the strategy's node default 50, with ``--optimizer adamw``); the
outer gradient is the average pseudo-gradient ``g = w - mean(w_k)``, and the coordinator takes
one step of SGD with Nesterov momentum on it::

    m = momentum * m + g
    w = w - lr * (g + momentum * m)

with the paper's outer learning rate 0.7 and momentum 0.9. It is the server-momentum family of
``fedavgm`` (Hsu et al. 2019), which takes heavy-ball steps (``w -= lr * m``) with lr 1;
Nesterov's look-ahead and the smaller outer step are what DiLoCo found stable over hundreds of
inner steps. With ``--outer-lr 1 --outer-momentum 0`` it is FedAvg. Only trained floating
parameters are stepped; buffers take the FedAvg average (:mod:`strategies.fedopt`). Its
pseudo-gradients travel compressed like any update (``--compress``; the paper's follow-ups
sent them as int8).
"""

from __future__ import annotations

from strategies.base import Option, register
from strategies.fedopt import _ServerOpt


@register
class DiLoCo(_ServerOpt):
    """Outer Nesterov momentum on the averaged pseudo-gradient (DiLoCo's outer optimiser).

    Parameters
    ----------
    outer_lr : float
        Outer learning rate, > 0 (the paper's 0.7).
    outer_momentum : float
        Nesterov momentum, in [0, 1) (the paper's 0.9).
    """

    name = "diloco"
    description = ("outer SGD with Nesterov momentum on the averaged pseudo-gradient; nodes "
                   "take --local-steps AdamW steps")
    paper = ("Douillard et al. 2023, DiLoCo: Distributed Low-Communication Training of "
             "Language Models, arXiv:2311.08105")
    options = (Option("outer_lr", float, 0.7, "DiLoCo's outer learning rate"),
               Option("outer_momentum", float, 0.9, "DiLoCo's outer Nesterov momentum, in "
                      "[0, 1)"))
    node_defaults = {"optimizer": "adamw", "lr": 1e-3, "local_steps": 50}

    def check(self) -> None:
        """``outer_lr`` > 0, ``outer_momentum`` in [0, 1)."""
        if not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0 (got {self.outer_lr})")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")

    def kept_moments(self) -> tuple[str, ...]:
        """Return ``("m",)``: the momentum buffer (none with momentum 0)."""
        return ("m",) if self.outer_momentum > 0 else ()

    def step(self, key, w, delta):
        """One Nesterov step on the pseudo-gradient ``g = -delta = w - average``."""
        grad = -delta
        if self.outer_momentum > 0:
            m = self.m.get(key)
            m = grad if m is None else self.outer_momentum * m + grad
            self.m[key] = m
            grad = grad + self.outer_momentum * m
        return w - self.outer_lr * grad
