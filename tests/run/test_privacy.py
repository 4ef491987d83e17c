"""Node-level DP (DP-FedAvg): clipping, fixed weights, noise and the accountant, by hand."""

import math

import pytest
import torch

import strategies
from fedavg.config.settings import RunConfig
from fedavg.run import privacy
from fedavg.run.privacy import NodeLevelDP, add_noise, clip_update
from fedavg.util.errors import UserError


def test_an_update_is_clipped_to_c_and_integers_keep_the_rounds_values():
    reference = {"w": torch.zeros(2), "n": torch.tensor(7)}
    state = {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(99)}  # ||u|| = 5
    clipped, norm = clip_update(state, reference, 1.0)
    assert norm == pytest.approx(5.0)
    assert clipped["w"].tolist() == pytest.approx([0.6, 0.8])
    assert clipped["n"].item() == 7  # a node's batch counter would tell its data's size
    same, _ = clip_update(state, reference, 10.0)  # inside the bound: unchanged
    assert same["w"].tolist() == pytest.approx([3.0, 4.0])


def test_the_norm_is_over_every_float_tensor_together():
    reference = {"a": torch.ones(1), "b": torch.zeros(1)}
    state = {"a": torch.tensor([4.0]), "b": torch.tensor([4.0])}  # u = (3, 4): norm 5
    clipped, norm = clip_update(state, reference, 2.5)
    assert norm == pytest.approx(5.0)
    assert clipped["a"].item() == pytest.approx(1 + 1.5) and clipped["b"].item() == pytest.approx(2)


def test_the_noise_has_standard_deviation_z_times_c():
    gen = torch.Generator().manual_seed(0)
    noised = add_noise({"w": torch.zeros(200_000), "i": torch.tensor(3)}, 0.75, gen)
    assert noised["w"].std().item() == pytest.approx(0.75, rel=0.01)
    assert abs(noised["w"].mean().item()) < 0.01
    assert noised["i"].item() == 3


def _dp(**kw):
    return NodeLevelDP(**{"clip": 1.0, "noise": 2.0, "num_nodes": 3, "sampled": False,
                          "delta": 1e-5, **kw})


def test_the_merge_is_the_fixed_weight_mean_of_clipped_updates_plus_the_noise_once():
    """3 nodes sampled, 2 reply: the mean is (0.3, 0.4) plus the noise / 3.

    u1 = (3, 4) clips to (0.6, 0.8), u2 = (0.3, 0.4) stays, and the third node counts as a
    zero update. Every node weighs 1 (the coordinator's adapter passes 1, see
    ``test_flower_adapter``).
    """
    dp = _dp(noise=1e-9)  # noise far below the figures checked
    reference = {"w": torch.zeros(2)}
    merge = strategies.get("fedavg")
    merge.begin(reference)
    dp.begin_round(3)
    merge.add_reply(*dp.private({"w": torch.tensor([3.0, 4.0])}, reference, 30.0))
    dp.folded()
    merge.add_reply(*dp.private({"w": torch.tensor([0.3, 0.4])}, reference, 70.0))
    dp.fill(merge, reference, used=2)
    assert merge.result().state_dict["w"].tolist() == pytest.approx([0.3, 0.4], abs=1e-6)


def test_only_the_first_reply_of_a_round_carries_the_noise_and_each_round_draws_anew():
    dp = _dp(noise=2.0, clip=0.5)  # std z C = 1
    reference = {"w": torch.zeros(100_000)}
    state = {"w": torch.zeros(100_000)}
    dp.begin_round(3)
    first = dp.private(state, reference)[0]["w"]
    assert first.std().item() == pytest.approx(1.0, rel=0.02)
    # the merge refused that reply (malformed): the next one still carries the noise
    assert dp.private(state, reference)[0]["w"].std().item() == pytest.approx(1.0, rel=0.02)
    dp.folded()  # the merge took one: no more noise this round
    assert torch.equal(dp.private(state, reference)[0]["w"], torch.zeros(100_000))
    dp.begin_round(3)
    again = dp.private(state, reference)[0]["w"]
    assert not torch.equal(first, again)  # fresh randomness, not a replayable seed


def _library_epsilon(events, delta):
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(delta)


def test_every_node_every_round_is_accounted_as_gaussian_releases_of_z():
    """Without sampling, T rounds compose T Gaussian mechanisms of multiplier z.

    Hand bound (RDP of order a: T a / (2 z^2); the classic conversion at the best a):
    epsilon <= T / (2 z^2) + sqrt(2 T ln(1/delta)) / z = 6.63 for z = 2, T = 6, delta 1e-5.
    The library converts more tightly.
    """
    from dp_accounting import dp_event

    dp = _dp(noise=2.0, num_nodes=20)
    for _ in range(6):
        dp.begin_round(20)
        dp.release()
    classic = 6 / 8 + math.sqrt(2 * 6 * math.log(1e5)) / 2
    assert classic == pytest.approx(6.63, abs=0.01)
    assert 0.8 * classic < dp.epsilon <= classic
    assert dp.epsilon == pytest.approx(_library_epsilon([dp_event.GaussianDpEvent(2.0)] * 6,
                                                        1e-5))


def test_sampled_rounds_are_accounted_without_replacement_at_half_the_multiplier():
    """Replacing one node moves the sum of clipped updates by up to 2 C: z / 2."""
    from dp_accounting import dp_event
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    dp = _dp(noise=4.0, num_nodes=1000, sampled=True)
    for _ in range(5):
        dp.begin_round(100)
        dp.release()
    event = dp_event.SampledWithoutReplacementDpEvent(1000, 100, dp_event.GaussianDpEvent(2.0))
    accountant = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    accountant.compose(event, 5)
    assert dp.epsilon == pytest.approx(accountant.get_epsilon(1e-5))
    full = _dp(noise=4.0, num_nodes=1000)
    for _ in range(5):
        full.begin_round(1000)
        full.release()
    assert dp.epsilon < full.epsilon  # sampling 10 % amplifies


def test_the_budget_keeps_the_rounds_whose_epsilon_stays_within_it():
    from dp_accounting import dp_event

    dp = _dp(noise=2.0, num_nodes=20, budget=6.0)
    rounds, epsilon = dp.rounds_within(8, 20)
    assert rounds == 6 and epsilon <= 6.0
    seventh = _library_epsilon([dp_event.GaussianDpEvent(2.0)] * 7, 1e-5)
    assert seventh > 6.0  # the 7th round would exceed it
    config = RunConfig().replace(num_nodes=20, rounds=8, dp_noise=2.0, dp_clip=1.0,
                                 dp_epsilon=6.0)
    cut, note = privacy.within_budget(config)
    assert cut.merge.rounds == 6 and "stops after round 6 of 8" in note
    assert privacy.within_budget(config.replace(rounds=6)) == (config.replace(rounds=6), None)
    resumed, _ = privacy.within_budget(config, [{"num_nodes": 20}] * 4)  # 4 done: 2 more fit
    assert resumed.merge.rounds == 6
    with pytest.raises(UserError, match="allows no more round"):
        privacy.within_budget(config.replace(dp_epsilon=1.0))


def test_the_default_delta_is_1e_5_or_n_to_the_minus_1_1_when_smaller():
    assert privacy.default_delta(10) == 1e-5
    assert privacy.default_delta(1_000_000) == pytest.approx(1e6 ** -1.1)
    assert privacy.for_run(RunConfig().replace(dp_noise=1.0, dp_clip=1.0)).delta == 1e-5
    assert privacy.for_run(RunConfig()) is None


def test_the_strategies_dp_accepts_are_those_whose_merge_is_a_mean():
    """A new strategy is refused with --dp-noise until it says DP-FedAvg's analysis holds."""
    assert sorted(n for n, k in strategies.available().items() if k.dp_mean) == [
        "average", "diloco", "fedadagrad", "fedadam", "fedavg", "fedavgm", "fedprox",
        "fedyogi", "moon", "task-arithmetic", "uniform-soup"]


def test_a_noise_too_small_to_account_is_refused_and_a_spent_budget_says_so():
    config = RunConfig().replace(num_nodes=10, rounds=3, dp_noise=1e-300, dp_clip=1.0)
    with _no_warning():
        with pytest.raises(UserError, match="too small to give any privacy: epsilon is "
                                            "infinite"):
            privacy.within_budget(config)
    spent = config.replace(dp_noise=2.0, rounds=8, dp_epsilon=6.0)
    with pytest.raises(UserError, match=r"this run has spent its --dp-epsilon 6 \(epsilon "
                                        r"5\.98 after round 6\): more rounds need a new run"):
        privacy.within_budget(spent, [{"num_nodes": 10}] * 6)


def _no_warning():
    import warnings

    class _Strict(warnings.catch_warnings):
        def __enter__(self):
            out = super().__enter__()
            warnings.simplefilter("error", RuntimeWarning)  # dp-accounting's divide by 0
            return out

    return _Strict()


def test_rounds_of_every_node_are_not_accounted_as_sampled():
    """--fraction 0.7 of 3 nodes still picks all 3: no sampling to amplify, add/remove one."""
    assert not privacy.for_run(RunConfig().replace(num_nodes=3, fraction=0.7, dp_noise=1.0,
                                                   dp_clip=1.0)).sampled
    assert privacy.for_run(RunConfig().replace(num_nodes=100, fraction=0.1, dp_noise=1.0,
                                               dp_clip=1.0)).sampled


def test_a_clip_without_noise_is_noted_as_doing_nothing():
    from fedavg.config.setting_use import unused_merge_notes

    assert unused_merge_notes(RunConfig().replace(dp_clip=1.0).merge) == [
        "--dp-clip 1 does nothing without --dp-noise z (node-level DP clips the updates and "
        "adds noise together)"]
    assert unused_merge_notes(RunConfig().replace(dp_clip=1.0, dp_noise=1.0).merge) == []


# --- record level: DP-SGD on the nodes, accounted per node --------------------------------

def test_record_epsilon_matches_the_librarys_published_example():
    # Opacus's own accountant test: z 1.5, q 0.04, 90 epochs (2,250 steps) -> 7.32911117143
    assert privacy.record_epsilon(1.5, [(0.04, 2250)], 1e-5) == pytest.approx(7.32911117143)
    assert privacy.record_epsilon(1.5, [(0.04, 0)], 1e-5) == 0.0


def _reply(q, steps):
    from fedavg.node import keys

    return {keys.DP_SAMPLE_RATE: q, keys.DP_STEPS: steps}


def test_a_node_epsilon_composes_its_steps_and_the_run_takes_the_largest_node():
    dp = privacy.RecordLevelDP(noise=1.5, delta=1e-5)
    state = {"w": torch.zeros(2)}
    for _ in range(3):  # node 0: 750 steps a round at q 0.04; node 1: 10 at q 0.04
        dp.begin_round(2)
        for node, steps in (("0", 750), ("1", 10)):
            taken, weight = dp.private(state, state, 120.0, node, _reply(0.04, steps))
            assert taken is state and weight == 120.0  # the merge is unchanged
            dp.folded()
        epsilon = dp.release()
    assert epsilon == pytest.approx(7.32911117143)  # node 0's 2,250 steps, as one history
    assert dp.round_steps == {"0": [0.04, 750], "1": [0.04, 10]}
    small = privacy.record_epsilon(1.5, [(0.04, 30)], 1e-5)
    assert small < epsilon  # parallel composition: node 1's records spent far less
    replayed = privacy.RecordLevelDP(noise=1.5, delta=1e-5)
    replayed.replay_records([{"dp_steps": dp.round_steps}] * 3)  # a resumed run's rounds
    assert replayed.epsilon == pytest.approx(epsilon) and replayed.releases == 3
    assert dp.describe()["level"] == "record" and dp.describe()["nodes"] == 2


def test_a_reply_without_dp_sgd_steps_is_refused_and_not_accounted():
    dp = privacy.RecordLevelDP(noise=1.0, delta=1e-5)
    dp.begin_round(1)
    state = {"w": torch.zeros(1)}
    for metrics in ({}, _reply(0.0, 3), _reply(0.5, -1), _reply(0.5, True)):
        with pytest.raises(ValueError, match="no DP-SGD steps to account"):
            dp.private(state, state, 1.0, "0", metrics)
    assert dp.release() == 0.0


def test_a_record_level_budget_is_cut_from_the_partitions_sizes():
    config = RunConfig().replace(num_nodes=2, rounds=20, dp_sgd=True, dp_noise=1.5,
                                 batch_size=32, dp_epsilon=3.0)
    assert privacy.within_budget(config) == (config, None)  # sizes unknown: not yet
    cut, note = privacy.within_budget(config, sizes=[320, 3200])
    # the smaller partition samples at q = 0.1 and spends more: it decides
    allowed = cut.merge.rounds
    assert 1 <= allowed < 20 and f"stops after round {allowed} of 20" in note
    assert privacy.record_epsilon(1.5, [(0.1, 10 * allowed)], 1e-5) <= 3.0
    assert privacy.record_epsilon(1.5, [(0.1, 10 * (allowed + 1))], 1e-5) > 3.0
    done = [{"dp_steps": {"0": [0.1, 10], "1": [0.01, 100]}}] * allowed
    with pytest.raises(UserError, match="has spent its --dp-epsilon 3"):
        privacy.within_budget(config, done, sizes=[320, 3200])
    note = privacy.plan_note(config.replace(dp_epsilon=None, rounds=allowed), [320, 3200])
    assert note.startswith("record-level DP (DP-SGD on every node)")
    assert f"epsilon {privacy.record_epsilon(1.5, [(0.1, 10 * allowed)], 1e-5):.3g}" in note
