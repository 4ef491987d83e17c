"""Node-level differential privacy on the coordinator: DP-FedAvg with an accountant.

DP-FedAvg (McMahan et al. 2018, arXiv:1710.06963): each node's update ``u_k = w_k - w`` (every
floating tensor, buffers too: running statistics come from the node's data) is clipped to L2
norm ``C`` (``--dp-clip``), the clipped updates are summed with **fixed weights** (1 per node:
sample-count weights would tell the coordinator's output how much data a node holds), Gaussian
noise of standard deviation ``z C`` is added to the sum (``--dp-noise`` is the noise multiplier
``z``), and the sum is divided by the round's sample size ``m`` (the number of nodes sampled,
fixed in advance: a node that does not reply counts as a zero update, so the estimate's
sensitivity stays ``C / m``). The strategy then works on that noisy mean; a server optimiser
(FedAvgM, FedAdam, DiLoCo ...) is post-processing of it. Integer buffers keep the round's
values.

The noise is added once per round, to the first reply the merge takes, which makes
the merged mean exactly ``w + (sum_k clip(u_k) + N(0, z^2 C^2)) / m``. Its generator is
seeded each round from the operating system's randomness, not from ``--seed``: a noise anyone
can replay protects nothing (so a resumed DP run is not bit-for-bit an unbroken one).

Accounting uses Flower's RDP accountant (:mod:`flwr.supercore.privacy_accounting`, which wraps
Google's ``dp-accounting``): one sampled Gaussian release per round. With every node in every
round (``--fraction 1``) the neighbouring relation is adding or removing one node and no
sampling amplification is claimed; with ``--fraction`` below 1 nodes are sampled without
replacement (as Flower samples them), whose analysis is for replacing one node, under which
the sum's sensitivity is ``2 C``: the release's noise multiplier is then ``z / 2``.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fedavg import flower_compat

#: delta when ``--dp-delta`` is not given: 1e-5, or 1 / N^1.1 for N nodes when that is
#: smaller (delta must stay well below 1 / N: a mechanism may expose one node with
#: probability delta).
DEFAULT_DELTA = 1e-5


@contextlib.contextmanager
def _quiet():
    """Silence dp-accounting's divide-by-zero warnings at a tiny noise multiplier."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def default_delta(num_nodes: int) -> float:
    """Return the delta a run reports epsilon at: ``min(1e-5, N^-1.1)``."""
    return min(DEFAULT_DELTA, float(num_nodes) ** -1.1)


def clip_update(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """Return ``reference + u * min(1, C / ||u||)`` for ``u = state - reference``, and ``||u||``.

    The norm is over every floating tensor together (float32); integer tensors take the
    reference's values (a node's batch counter would tell its data's size).

    Parameters
    ----------
    state, reference : dict of str to torch.Tensor
        A node's model and the round's, with the same keys and shapes.
    clip : float
        ``C`` > 0.
    """
    updates = {k: state[k].detach().to(torch.float32) - v.to(torch.float32)
               for k, v in reference.items() if v.is_floating_point()}
    norm = math.sqrt(sum(float(u.square().sum()) for u in updates.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {}
    for key, ref in reference.items():
        if key in updates:
            out[key] = (ref.to(torch.float32) + scale * updates[key]).to(ref.dtype)
        else:
            out[key] = ref
    return out, norm


def add_noise(state: dict[str, torch.Tensor], std: float,
              generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Return ``state`` with Gaussian noise of standard deviation ``std`` on each float entry."""
    out = {}
    for key, value in state.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            out[key] = (value.to(torch.float32) + std * noise).to(value.dtype)
        else:
            out[key] = value
    return out


@dataclass
class NodeLevelDP:
    """Clip, weigh, noise and account one run's rounds (see the module notes).

    Attributes
    ----------
    clip : float
        ``C``, the L2 bound of a node's update.
    noise : float
        ``z``, the noise multiplier: the noise on the sum has standard deviation ``z C``.
    num_nodes : int
        ``N``, every node of the run (the population).
    sampled : bool
        Whether a round samples some of the nodes (``--fraction`` below 1).
    delta : float
        The delta epsilon is reported at.
    budget : float or None
        ``--dp-epsilon``: no round starts whose release would take epsilon above it.
    """

    clip: float
    noise: float
    num_nodes: int
    sampled: bool
    delta: float
    budget: float | None = None
    _history: list[int] = field(default_factory=list, repr=False)
    _round_sample: int = 0
    _noised: bool = False
    _accountant: Any = field(default=None, repr=False)
    _generator: torch.Generator = field(default_factory=torch.Generator, repr=False)

    def __post_init__(self) -> None:
        self._accountant = self._new_accountant()

    def _new_accountant(self):
        return flower_compat.rdp_accountant(self.delta, self.num_nodes, self.sampled)

    def _epsilon_of(self, accountant) -> float:
        with _quiet():
            return float(accountant.get_epsilon(self.delta))

    @staticmethod
    def _compose(accountant, event, count: int = 1) -> None:
        with _quiet():
            accountant.compose(event, count)

    def _event(self, sample: int):
        # replacing one node moves the sum of clipped updates by up to 2 C
        multiplier = self.noise / 2 if self.sampled else self.noise
        return flower_compat.gaussian_release(multiplier, sample, self.num_nodes)

    def begin_round(self, sampled: int) -> None:
        """Start a round that sent work to ``sampled`` nodes: its noise, fresh, is still due."""
        self._round_sample = sampled
        self._noised = False
        self._generator.manual_seed(secrets.randbits(63))

    def private(self, state: dict[str, torch.Tensor],
                reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return a node's model as the merge takes it (clipped; the round's noise on the first).

        Parameters
        ----------
        state, reference : dict of str to torch.Tensor
            The node's model and the round's.
        """
        clipped, _ = clip_update(state, reference, self.clip)
        if self._noised:
            return clipped
        return add_noise(clipped, self.noise * self.clip, self._generator)

    @property
    def round_sample(self) -> int:
        """The nodes the current round sampled."""
        return self._round_sample

    def noise_std(self, sampled: int) -> float:
        """Return the noise's standard deviation on the merged mean: ``z C / m``."""
        return self.noise * self.clip / max(sampled, 1)

    def folded(self) -> None:
        """Note that the merge took a reply :meth:`private` made: the round's noise is in.

        Until then every reply gets noise, so that a noised reply the merge refuses (a
        malformed one) does not leave the round without it.
        """
        self._noised = True

    def fill(self, merge, reference: dict[str, torch.Tensor], used: int) -> None:
        """Count the sampled nodes that sent nothing usable as zero updates (the reference)."""
        missing = self._round_sample - used
        if missing > 0:
            merge.add_reply(reference, float(missing), node="dp-missing")

    def release(self) -> float:
        """Account the round just merged; return the run's epsilon at :attr:`delta`."""
        self._compose(self._accountant, self._event(self._round_sample))
        self._history.append(self._round_sample)
        return self.epsilon

    @property
    def releases(self) -> int:
        """The rounds accounted so far."""
        return len(self._history)

    @property
    def epsilon(self) -> float:
        """The run's epsilon so far at :attr:`delta` (0 before the first release)."""
        if not self._history:
            return 0.0
        return self._epsilon_of(self._accountant)

    def rounds_within(self, rounds: int, sampled: int) -> tuple[int, float]:
        """Return how many more rounds fit the budget, and the epsilon after them.

        Of ``rounds`` more rounds of ``sampled`` nodes each, those that keep epsilon within
        :attr:`budget` (all of them without a budget).
        """
        projected = self._new_accountant()
        for sample in self._history:
            self._compose(projected, self._event(sample))
        epsilon = self._epsilon_of(projected) if self._history else 0.0
        for done in range(rounds):
            self._compose(projected, self._event(sampled))
            after = self._epsilon_of(projected)
            if self.budget is not None and after > self.budget:
                return done, epsilon
            epsilon = after
        return rounds, epsilon

    def describe(self) -> dict[str, Any]:
        """Return the run's privacy as ``model.json`` and ``summary.json`` keep it."""
        relation = ("replace one node, sampled without replacement" if self.sampled
                    else "add or remove one node, no sampling amplification")
        return {"level": "node", "epsilon": self.epsilon, "delta": self.delta,
                "noise_multiplier": self.noise, "clip": self.clip, "rounds": self.releases,
                "accounting": f"RDP (Flower's accountant over dp-accounting), {relation}",
                **({"budget": self.budget} if self.budget is not None else {})}

    def replay(self, samples: list[int]) -> None:
        """Account rounds already merged (a resumed run's), by their sampled node counts."""
        for sample in samples:
            self._compose(self._accountant, self._event(sample))
            self._history.append(sample)


def for_run(config) -> NodeLevelDP | None:
    """Return the run's node-level DP (``config``: a ``RunConfig``), or ``None`` when off."""
    m = config.merge
    if not m.dp_noise > 0:
        return None
    return NodeLevelDP(clip=float(m.dp_clip), noise=float(m.dp_noise), num_nodes=m.num_nodes,
                       sampled=config.nodes_per_round < m.num_nodes, budget=m.dp_epsilon,
                       delta=m.dp_delta if m.dp_delta is not None else default_delta(m.num_nodes))


def sampled_history(rounds: list[dict]) -> list[int]:
    """Return the nodes each finished round sampled (its used and failed ones), from records."""
    return [int(r.get("num_nodes") or 0) + int(r.get("num_failed") or 0) for r in rounds]


def within_budget(config, history: list[int] | None = None):
    """Return ``config`` with ``--rounds`` cut to the rounds ``--dp-epsilon`` allows, and a note.

    ``history``: the sampled node counts of the rounds a resumed run has done. The note
    (``None`` when nothing is cut) says where the run stops and at which epsilon.

    Raises
    ------
    fedavg.util.errors.UserError
        The budget allows not one more round.
    """
    from fedavg.util.errors import UserError

    dp = for_run(config)
    if dp is None:
        return config, None
    history = history or []
    dp.replay(history)
    left = config.merge.rounds - len(history)
    rounds, epsilon = dp.rounds_within(left, config.nodes_per_round)
    if not math.isfinite(epsilon):
        raise UserError(f"--dp-noise {dp.noise:g} is too small to give any privacy: epsilon "
                        "is infinite; give a noise multiplier of about 0.5 or more")
    if rounds == left:
        return config, None
    if rounds == 0 and history:
        raise UserError(f"this run has spent its --dp-epsilon {dp.budget:g} (epsilon "
                        f"{dp.epsilon:.3g} after round {len(history)}): more rounds need a "
                        "new run (another --output) with a larger budget")
    if rounds == 0:
        raise UserError(f"--dp-epsilon {dp.budget:g} allows no more round: the next one would "
                        f"take epsilon above it at --dp-noise {dp.noise:g}; raise --dp-noise "
                        "or the budget")
    stop = len(history) + rounds
    return config.replace(rounds=stop), (
        f"--dp-epsilon {dp.budget:g}: the run stops after round {stop} of "
        f"{config.merge.rounds}, at epsilon {epsilon:.3g} (delta {dp.delta:g}); one more "
        "round would exceed the budget")


def plan_note(config) -> str | None:
    """Say how the run is private and what its rounds spend (``None`` without DP)."""
    dp = for_run(config)
    if dp is None:
        return None
    _, epsilon = dp.rounds_within(config.merge.rounds, config.nodes_per_round)
    return (f"node-level DP: each node's update clipped to L2 {dp.clip:g} and weighted 1, "
            f"noise multiplier {dp.noise:g}: epsilon {epsilon:.3g} at delta {dp.delta:g} after "
            f"{config.merge.rounds} round(s)"
            + (f" of {config.nodes_per_round} sampled nodes" if dp.sampled else "")
            + "; train loss and other metrics are not covered")
