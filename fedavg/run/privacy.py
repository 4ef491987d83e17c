"""Differential privacy with an accountant: node level (DP-FedAvg) and record level (DP-SGD).

Record level (``--dp-sgd``, :class:`RecordLevelDP`): the nodes train by DP-SGD
(:mod:`fedavg.node.dp_sgd`) and the coordinator accounts their steps; see the class.

Node level, on the coordinator:

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
from fedavg.util.errors import UserError
from strategies.tensors import clip_update

__all__ = ["NodeLevelDP", "RecordLevelDP", "add_noise", "clip_update", "for_run",
           "plan_note", "record_epsilon", "within_budget"]

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
    clip_on : str
        ``coordinator``, or ``node``: each node clips its own update before it sends it
        (the coordinator clips again, which changes nothing it received clipped).
    """

    clip: float
    noise: float
    num_nodes: int
    sampled: bool
    delta: float
    budget: float | None = None
    clip_on: str = "coordinator"
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

    def private(self, state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                weight: float = 1.0, node: str = "", metrics=None
                ) -> tuple[dict[str, torch.Tensor], float]:  # noqa: ARG002
        """Return a node's model and weight as the merge takes them.

        The model clipped (the round's noise on the first), the weight 1.

        Parameters
        ----------
        state, reference : dict of str to torch.Tensor
            The node's model and the round's.
        weight, node, metrics
            The reply's sample count, node and metrics (unused: every node weighs 1).
        """
        clipped, _ = clip_update(state, reference, self.clip)
        if self._noised:
            return clipped, 1.0
        return add_noise(clipped, self.noise * self.clip, self._generator), 1.0

    def noised_mean(self, mean: dict[str, torch.Tensor], used: int
                    ) -> tuple[dict[str, torch.Tensor], float]:
        """Return a secure sum's mean of ``used`` clipped updates as the merge takes it.

        Secure aggregation reveals only ``w + sum_k clip(u_k) / used`` (the nodes clipped
        their own updates, ``--dp-clip-on node``); the round's noise, of standard deviation
        ``z C`` on the sum, is ``z C / used`` on that mean, which then weighs ``used``:
        with :meth:`fill`'s zero updates the merge is ``w + (sum_k clip(u_k) + N(0, z^2
        C^2)) / m``, as without secure aggregation.
        """
        return add_noise(mean, self.noise * self.clip / max(used, 1), self._generator), \
            float(used)

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
                "noise_multiplier": self.noise, "clip": self.clip, "clip_on": self.clip_on,
                "rounds": self.releases,
                "accounting": f"RDP (Flower's accountant over dp-accounting), {relation}",
                **({"budget": self.budget} if self.budget is not None else {})}

    def replay(self, samples: list[int]) -> None:
        """Account rounds already merged (a resumed run's), by their sampled node counts."""
        for sample in samples:
            self._compose(self._accountant, self._event(sample))
            self._history.append(sample)

    def replay_records(self, rounds: list[dict]) -> None:
        """Account the rounds of ``metrics.jsonl`` records (:func:`sampled_history`)."""
        self.replay(sampled_history(rounds))

    round_steps = None  # what metrics.jsonl keeps of a round: its epsilon alone


@dataclass
class RecordLevelDP:
    """Account the nodes' DP-SGD steps (``--dp-sgd``): each node's records, the run's epsilon.

    Each node trains by DP-SGD (:mod:`fedavg.node.dp_sgd`) and reports, with its model, the
    chance ``q`` a sample had to join a step's batch and the steps it took. A record lives
    on one node, so the run's epsilon is the largest of the nodes' (parallel composition);
    a node's epsilon is Opacus's RDP accountant over all its steps (Poisson sampling,
    neighbouring datasets differ by adding or removing one record; Mironov et al. 2019,
    arXiv:1908.10530). No amplification is claimed from the sampling of nodes. The merge
    is unchanged: it is post-processing of the nodes' private models, though the sample
    counts it weighs them by (their partitions' sizes) are taken as public, as in Opacus.

    Attributes
    ----------
    noise : float
        ``z``, DP-SGD's noise multiplier.
    delta : float
        The delta epsilon is reported at.
    budget : float or None
        ``--dp-epsilon``.
    """

    noise: float
    delta: float
    budget: float | None = None
    clip: float = 1.0
    _steps: dict[str, dict[float, int]] = field(default_factory=dict, repr=False)
    _epsilons: dict[str, float] = field(default_factory=dict, repr=False)
    _round: dict[str, list] = field(default_factory=dict, repr=False)
    _pending: tuple[str, float, int] | None = None
    _releases: int = 0

    def begin_round(self, sampled: int) -> None:  # noqa: ARG002 - the node-level interface
        """Start a round: nothing of it is accounted yet."""
        self._round, self._pending = {}, None

    def private(self, state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                weight: float, node: str, metrics) -> tuple[dict[str, torch.Tensor], float]:
        """Return the reply as the merge takes it (unchanged), after reading its DP-SGD steps.

        Raises
        ------
        ValueError
            The reply lacks a sound ``dp-sample-rate`` or ``dp-steps`` (a node that did not
            train by DP-SGD): it is left out.
        """
        from fedavg.node import keys

        q, steps = metrics.get(keys.DP_SAMPLE_RATE), metrics.get(keys.DP_STEPS)
        if not (isinstance(q, float) and 0 < q <= 1 and isinstance(steps, int)
                and not isinstance(steps, bool) and steps >= 0):
            raise ValueError(f"the reply has no DP-SGD steps to account ({keys.DP_SAMPLE_RATE} "
                             f"{q!r}, {keys.DP_STEPS} {steps!r}): was the node trained with "
                             "--dp-sgd?")
        self._pending = (node, q, steps)
        return state, weight

    def folded(self) -> None:
        """Account the reply :meth:`private` read: the merge took it."""
        if self._pending is not None:
            node, q, steps = self._pending
            self._round[node] = [q, steps]
            self._pending = None

    def fill(self, merge, reference, used: int) -> None:
        """Nothing to fill: a node that sent nothing spent nothing the run reports."""

    def noise_std(self, sampled: int) -> float:  # noqa: ARG002
        """Return the noise's standard deviation on one step's mean gradient of a node."""
        return self.noise * self.clip

    @property
    def round_sample(self) -> int:
        """The nodes accounted in the current round."""
        return len(self._round)

    def release(self) -> float:
        """Account the round's nodes' steps; return the run's epsilon at :attr:`delta`."""
        self.replay([self._round])
        return self.epsilon

    @property
    def round_steps(self) -> dict[str, list]:
        """The current round's ``{node: [q, steps]}``, as ``metrics.jsonl`` keeps it."""
        return dict(self._round)

    def replay_records(self, rounds: list[dict]) -> None:
        """Account the rounds of ``metrics.jsonl`` records (their ``dp_steps``)."""
        self.replay([r.get("dp_steps") or {} for r in rounds])

    def replay(self, rounds: list[dict[str, list]]) -> None:
        """Account rounds already merged, each ``{node: [q, steps]}``."""
        touched = set()
        for one in rounds:
            for node, (q, steps) in (one or {}).items():
                per_rate = self._steps.setdefault(node, {})
                per_rate[float(q)] = per_rate.get(float(q), 0) + int(steps)
                touched.add(node)
            self._releases += 1
        for node in touched:
            self._epsilons[node] = self._node_epsilon(self._steps[node])

    def _node_epsilon(self, per_rate: dict[float, int]) -> float:
        return record_epsilon(self.noise, [(q, n) for q, n in per_rate.items()], self.delta)

    @property
    def releases(self) -> int:
        """The rounds accounted so far."""
        return self._releases

    @property
    def epsilon(self) -> float:
        """The run's epsilon so far: the largest node's (0 before any step)."""
        return max(self._epsilons.values(), default=0.0)

    def rounds_within(self, rounds: int, per_round: dict[str, tuple[float, int]]
                      ) -> tuple[int, float]:
        """Return how many more rounds fit the budget, and the epsilon after them.

        ``per_round``: each node's ``(q, steps)`` in one round; every node is assumed to
        train in every round (no amplification by node sampling).
        """
        epsilon = self.epsilon
        for done in range(rounds):
            after = max((self._node_epsilon(self._with(node, q, steps * (done + 1)))
                         for node, (q, steps) in per_round.items()), default=0.0)
            if self.budget is not None and after > self.budget:
                return done, epsilon
            epsilon = after
        return rounds, epsilon

    def _with(self, node: str, q: float, steps: int) -> dict[float, int]:
        per_rate = dict(self._steps.get(node, {}))
        per_rate[q] = per_rate.get(q, 0) + steps
        return per_rate

    def describe(self) -> dict[str, Any]:
        """Return the run's privacy as ``model.json`` and ``summary.json`` keep it."""
        return {"level": "record", "epsilon": self.epsilon, "delta": self.delta,
                "noise_multiplier": self.noise, "max_grad_norm": self.clip,
                "rounds": self.releases, "nodes": len(self._epsilons),
                "accounting": "RDP (Opacus's accountant) per node over its DP-SGD steps, "
                              "Poisson sampling, add or remove one record; the run's "
                              "epsilon is the largest node's",
                **({"budget": self.budget} if self.budget is not None else {})}


def record_epsilon(noise: float, steps: list[tuple[float, int]], delta: float) -> float:
    """Return the epsilon of DP-SGD steps at ``delta``: Opacus's RDP accountant.

    Parameters
    ----------
    noise : float
        ``z``, the noise multiplier of every step.
    steps : list of (float, int)
        ``(q, count)``: ``count`` steps whose batches took each sample with probability ``q``.
    delta : float
        In (0, 1).
    """
    from opacus.accountants import RDPAccountant

    if not any(count for _, count in steps):
        return 0.0
    accountant = RDPAccountant()
    accountant.history = [(noise, q, count) for q, count in steps if count]
    with _quiet():
        return float(accountant.get_epsilon(delta))


def for_run(config) -> NodeLevelDP | RecordLevelDP | None:
    """Return the run's DP (``config``: a ``RunConfig``), or ``None`` when off.

    Record level (:class:`RecordLevelDP`) with ``--dp-sgd``, else node level.
    """
    m = config.merge
    if not m.dp_noise > 0:
        return None
    if config.train.dp_sgd:
        return RecordLevelDP(noise=float(m.dp_noise), budget=m.dp_epsilon,
                             clip=float(config.train.dp_max_grad_norm),
                             delta=m.dp_delta if m.dp_delta is not None else DEFAULT_DELTA)
    return NodeLevelDP(clip=float(m.dp_clip), noise=float(m.dp_noise), num_nodes=m.num_nodes,
                       sampled=config.nodes_per_round < m.num_nodes, budget=m.dp_epsilon,
                       clip_on=m.dp_clip_on,
                       delta=m.dp_delta if m.dp_delta is not None else default_delta(m.num_nodes))


def sampled_history(rounds: list[dict]) -> list[int]:
    """Return the nodes each finished round sampled (its used and failed ones), from records."""
    return [int(r.get("num_nodes") or 0) + int(r.get("num_failed") or 0) for r in rounds]


def within_budget(config, rounds: list[dict] | None = None,
                  sizes: list[int] | None = None):
    """Return ``config`` with ``--rounds`` cut to the rounds ``--dp-epsilon`` allows, and a note.

    ``rounds``: the ``metrics.jsonl`` records of the rounds a resumed run has done. The note
    (``None`` when nothing is cut) says where the run stops and at which epsilon. With
    ``--dp-sgd`` the epsilon of a round depends on each node's partition size: ``sizes``
    gives them (one per partition); without it the config is returned as it is.

    Raises
    ------
    fedavg.util.errors.UserError
        The budget allows not one more round, or the noise gives no privacy at all.
    """
    dp = for_run(config)
    if dp is None or (isinstance(dp, RecordLevelDP) and sizes is None):
        return config, None
    rounds = rounds or []
    dp.replay_records(rounds)
    left = config.merge.rounds - len(rounds)
    done = len(rounds)
    allowed, epsilon = dp.rounds_within(left, _per_round(config, dp, sizes))
    if not math.isfinite(epsilon):
        raise UserError(f"--dp-noise {dp.noise:g} is too small to give any privacy: epsilon "
                        "is infinite; give a noise multiplier of about 0.5 or more")
    if allowed == left:
        return config, None
    if allowed == 0 and done:
        raise UserError(f"this run has spent its --dp-epsilon {dp.budget:g} (epsilon "
                        f"{dp.epsilon:.3g} after round {done}): more rounds need a "
                        "new run (another --output) with a larger budget")
    if allowed == 0:
        raise UserError(f"--dp-epsilon {dp.budget:g} allows no more round: the next one would "
                        f"take epsilon above it at --dp-noise {dp.noise:g}; raise --dp-noise "
                        "or the budget")
    stop = done + allowed
    return config.replace(rounds=stop), (
        f"--dp-epsilon {dp.budget:g}: the run stops after round {stop} of "
        f"{config.merge.rounds}, at epsilon {epsilon:.3g} (delta {dp.delta:g}); one more "
        "round would exceed the budget")


def _per_round(config, dp, sizes: list[int] | None):
    """Return what a round spends: its sampled nodes, or each node's DP-SGD ``(q, steps)``."""
    if isinstance(dp, NodeLevelDP):
        return config.nodes_per_round
    from fedavg.node.dp_sgd import sample_rate, steps_per_round

    local = config.local_training()
    return {str(k): (sample_rate(n, local.batch_size),
                     steps_per_round(n, local.batch_size, local.local_epochs,
                                     local.local_steps or 0))
            for k, n in enumerate(sizes or []) if n}


def plan_note(config, sizes: list[int] | None = None) -> str | None:
    """Say how the run is private and what its rounds spend (``None`` without DP).

    ``sizes``: the partitions' sizes, which a record-level (``--dp-sgd``) epsilon needs.
    """
    dp = for_run(config)
    if dp is None:
        return None
    rounds = config.merge.rounds
    if isinstance(dp, RecordLevelDP):
        spent = ""
        if sizes is not None:
            _, epsilon = dp.rounds_within(rounds, _per_round(config, dp, sizes))
            spent = (f": epsilon {epsilon:.3g} at delta {dp.delta:g} after {rounds} round(s) "
                     "if every node trains in every one")
        return (f"record-level DP (DP-SGD on every node): each sample's gradient clipped to L2 "
                f"{dp.clip:g}, noise multiplier {dp.noise:g}{spent}; the partitions' sizes "
                "and the train loss are not covered")
    _, epsilon = dp.rounds_within(rounds, config.nodes_per_round)
    return (f"node-level DP: each node's update clipped to L2 {dp.clip:g} and weighted 1, "
            f"noise multiplier {dp.noise:g}: epsilon {epsilon:.3g} at delta {dp.delta:g} after "
            f"{rounds} round(s)"
            + (f" of {config.nodes_per_round} sampled nodes" if dp.sampled else "")
            + "; train loss and other metrics are not covered")
