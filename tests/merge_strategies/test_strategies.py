"""Every registered strategy against hand-computed values, and Flower's implementations.

FedAvg's merge math, integer buffers and BatchNorm models; every other strategy's merge.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

import strategies
from fedavg.config.settings import LocalTraining
from fedavg.models.registry import EnsembleModel
from fedavg.node.train import train
from strategies import MergeContext, MergeError
from strategies.ensemble import fit_weights


def test_weighted_average_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.0)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor(4.0)}
    merged = strategies.get("fedavg").merge([a, b], weights=[100, 300]).state_dict
    # (100 * 1 + 300 * 3) / 400 = 2.5 ; (100 * 2 + 300 * 6) / 400 = 5.0 ; 300 * 4 / 400 = 3.0
    assert torch.equal(merged["w"], torch.tensor([2.5, 5.0]))
    assert torch.equal(merged["b"], torch.tensor(3.0))


def test_a_transposed_tensor_is_merged_like_any_other():
    """Tied or transposed weights are views with other strides: ((1 2 / 3 4) * 1 + 0 * 3) / 4."""
    a = {"w": torch.tensor([[1.0, 3.0], [2.0, 4.0]]).t()}  # [[1, 2], [3, 4]], not contiguous
    b = {"w": torch.zeros(2, 2)}
    assert not a["w"].is_contiguous()
    # sample-weighted (1 and 3 samples), and unweighted: (x + 0) / 2
    for name, want in (("fedavg", [[0.25, 0.5], [0.75, 1.0]]),
                       ("average", [[0.25, 0.5], [0.75, 1.0]]),
                       ("uniform-soup", [[0.5, 1.0], [1.5, 2.0]]),
                       ("fedmedian", [[0.5, 1.0], [1.5, 2.0]])):
        merged = strategies.get(name).merge([a, b], weights=[1, 3]).state_dict
        assert merged["w"].tolist() == want, name
    assert a["w"].tolist() == [[1.0, 2.0], [3.0, 4.0]]  # the node model is left as it was


def test_three_models_unequal_weights():
    sds = [{"x": torch.tensor([[1.0]])}, {"x": torch.tensor([[4.0]])},
           {"x": torch.tensor([[10.0]])}]
    out = strategies.get("fedavg").merge(sds, weights=[1, 2, 1]).state_dict
    assert out["x"].item() == pytest.approx((1 + 8 + 10) / 4)  # 4.75


def test_dtypes_kept_and_integer_buffer_not_averaged():
    a = {"w": torch.tensor([1.0], dtype=torch.float16), "n": torch.tensor(5, dtype=torch.long),
         "flag": torch.tensor([True, False])}
    b = {"w": torch.tensor([2.0], dtype=torch.float16), "n": torch.tensor(8, dtype=torch.long),
         "flag": torch.tensor([False, False])}
    res = strategies.get("fedavg").merge([a, b], weights=[1, 1])
    out = res.state_dict
    assert out["w"].dtype == torch.float16 and out["w"].item() == 1.5
    # an average would give 6.5 -> 6; the maximum keeps the counter meaningful
    assert out["n"].dtype == torch.long and out["n"].item() == 8
    assert out["flag"].dtype == torch.bool and out["flag"].tolist() == [True, False]
    assert res.num_models == 2 and res.total_weight == 2


def _bn_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(2 * 4 * 4, 3))


def test_batchnorm_model_merge_and_load():
    m1, m2 = _bn_model(0), _bn_model(1)
    for m, steps in ((m1, 3), (m2, 7)):  # different num_batches_tracked
        m.train()
        for _ in range(steps):
            m(torch.randn(4, 1, 6, 6))
    s1, s2 = m1.state_dict(), m2.state_dict()
    out = strategies.get("fedavg").merge([s1, s2], weights=[30, 10]).state_dict
    bn = "1.running_mean"
    expected = (30 * s1[bn].double() + 10 * s2[bn].double()) / 40
    assert torch.allclose(out[bn], expected.float())
    assert torch.allclose(out["0.weight"], (0.75 * s1["0.weight"] + 0.25 * s2["0.weight"]))
    assert out["1.num_batches_tracked"].dtype == torch.long
    assert out["1.num_batches_tracked"].item() == 7
    merged = _bn_model(2)
    merged.load_state_dict(out, strict=True)  # keys, shapes and dtypes fit the model
    assert torch.isfinite(merged.eval()(torch.randn(2, 1, 6, 6))).all()


def test_streaming_equals_batch_merge():
    torch.manual_seed(0)
    sds = [{"w": torch.randn(5, 3)} for _ in range(6)]
    weights = [3, 1, 4, 1, 5, 9]
    batch = strategies.get("fedavg").merge(sds, weights).state_dict["w"]
    s = strategies.get("fedavg")
    s.begin(sds[0])
    for sd, w in zip(sds, weights):
        s.add(sd, w)
    assert torch.allclose(s.result().state_dict["w"], batch)
    manual = sum(w * sd["w"].double() for sd, w in zip(sds, weights)) / sum(weights)
    assert torch.allclose(batch.double(), manual, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"w": torch.zeros(3)}, "shape"),
        ({"w": torch.zeros(2, dtype=torch.float64)}, "dtype"),
        ({"v": torch.zeros(2)}, "keys"),
        ({"w": torch.tensor([float("nan"), 0.0])}, "NaN"),
    ],
)
def test_mismatched_models_refused_with_key_and_node(bad, match):
    s = strategies.get("fedavg")
    s.begin({"w": torch.zeros(2)})
    s.add({"w": torch.ones(2)}, 1, node="7")
    with pytest.raises(MergeError, match=match) as info:
        s.add(bad, 1, node="42")
    assert "42" in str(info.value)
    # the refused model did not spoil the accumulator
    assert torch.equal(s.result().state_dict["w"], torch.ones(2))


@pytest.mark.parametrize("weight", [0, -1, float("nan"), "10"])
def test_bad_weight_refused(weight):
    s = strategies.get("fedavg")
    s.begin({"w": torch.zeros(1)})
    with pytest.raises(MergeError, match="weight"):
        s.add({"w": torch.zeros(1)}, weight, node="3")


def test_empty_merge_refused():
    with pytest.raises(MergeError, match="nothing to merge"):
        strategies.get("fedavg").merge([], [])


def test_registry_lists_names_on_unknown():
    assert "fedavg" in strategies.available()
    with pytest.raises(strategies.UnknownStrategyError, match="fedavg"):
        strategies.get("does-not-exist")
    cls = strategies.available()["fedavg"]
    assert "1602.05629" in cls.paper


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedmedian", "uniform-soup"])
def test_merge_leaves_the_node_models_untouched(name):
    torch.manual_seed(0)
    sds = [{"w": torch.randn(4, 3), "n": torch.tensor(i)} for i in range(3)]
    before = [{k: v.clone() for k, v in sd.items()} for sd in sds]
    strategies.get(name).merge(sds, [1, 2, 3], reference={"w": torch.zeros(4, 3),
                                                          "n": torch.tensor(0)})
    for sd, orig in zip(sds, before):
        assert all(torch.equal(sd[k], orig[k]) for k in sd)


def test_option_defaults_name_each_option_at_its_default():
    """One lookup for resume, sweep and sweep plans: an option written out at its default."""
    import strategies

    assert strategies.option_defaults("fedprox") == {"mu": 0.01}
    assert strategies.option_defaults("fedavg") == {}
    assert strategies.option_defaults("nope") == {} == strategies.option_defaults(None)
    defaults = strategies.option_defaults("fedprox")
    defaults["mu"] = 1.0  # a copy: the strategy's own default is untouched
    assert strategies.option_defaults("fedprox") == {"mu": 0.01}


MULTI_ROUND = ["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
               "fedmedian", "trimmed-mean", "krum", "multi-krum"]


def sd(*values):
    return {"w": torch.tensor(list(values), dtype=torch.float32)}


# --- hand-computed values ------------------------------------------------------------------


def test_fedprox_merges_like_fedavg_and_asks_nodes_for_mu():
    s = strategies.get("fedprox", mu=0.5)
    assert s.node_config == {"proximal_mu": 0.5}  # a TrainSettings field, sent to nodes
    out = s.merge([sd(1.0), sd(4.0)], [1, 2]).state_dict["w"]
    assert out.item() == pytest.approx(3.0)  # (1 + 8) / 3


def test_fedprox_term_pulls_local_weights_to_the_start():
    torch.manual_seed(0)
    x = torch.randint(0, 255, (64, 1, 2, 2), dtype=torch.uint8)
    y = torch.randint(0, 2, (64,))
    spec = {"scale": 1 / 255, "mean": [0.5], "std": [0.25]}
    start = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    drift = {}
    for mu in (0.0, 2.0):
        model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
        model.load_state_dict(start.state_dict())
        train(model, x, y, spec, LocalTraining(local_epochs=5, lr=0.1, momentum=0.0),
              proximal_mu=mu)
        drift[mu] = sum(float(((p - q) ** 2).sum().detach()) for p, q in
                        zip(model.parameters(), start.parameters()))
    assert drift[2.0] < 0.5 * drift[0.0]


def test_adam_first_local_step_moves_each_weight_by_lr():
    # Adam's bias-corrected first step is lr * g / (|g| + eps): lr against the gradient's sign
    x = torch.tensor([[2.0], [4.0]])
    y = torch.tensor([0, 1])
    spec = {"scale": 1.0, "mean": [0.0], "std": [1.0]}
    model = nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5], [-0.5]]))
        model.bias.zero_()
    before = model.weight.detach().clone()
    train(model, x, y, spec, LocalTraining(local_epochs=1, batch_size=2, lr=0.01, optimizer="adam"))
    # class 0's logit is too high on the class-1 sample (x = 4) more than it helps x = 2
    torch.testing.assert_close(model.weight.detach() - before,
                               torch.tensor([[-0.01], [0.01]]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        train(model, x, y, spec, LocalTraining(optimizer="lbfgs"))


def test_fedavgm_momentum_by_hand():
    s = strategies.get("fedavgm", server_lr=1.0, server_momentum=0.9)
    # round 1: w = 1, average 3 -> grad -2, u = -2, w = 1 + 2 = 3
    out = s.merge([sd(3.0)], [1], reference=sd(1.0)).state_dict["w"]
    assert out.item() == pytest.approx(3.0)
    # round 2: w = 3, average 4 -> grad -1, u = 0.9 * -2 - 1 = -2.8, w = 3 + 2.8 = 5.8
    out = s.merge([sd(4.0)], [1], reference=sd(3.0)).state_dict["w"]
    assert out.item() == pytest.approx(5.8)


def test_fedadam_first_step_by_hand():
    s = strategies.get("fedadam", server_lr=0.01, tau=1e-3)
    out = s.merge([sd(1.0)], [1], reference=sd(0.0)).state_dict["w"].item()
    # delta 1: m = 0.1, v = 0.01; eta_t = 0.01 * sqrt(1 - 0.99^2) / (1 - 0.9^2)
    eta = 0.01 * math.sqrt(1 - 0.99**2) / (1 - 0.9**2)
    assert out == pytest.approx(eta * 0.1 / (0.1 + 1e-3), rel=1e-6)


def test_fedadagrad_and_fedyogi_first_step_by_hand():
    ada = strategies.get("fedadagrad", server_lr=0.1, tau=0.0 + 1e-3)
    # m = delta = 2, v = 4 -> w = 0 + 0.1 * 2 / (2 + 0.001)
    assert ada.merge([sd(2.0)], [1], reference=sd(0.0)).state_dict["w"].item() == \
        pytest.approx(0.1 * 2 / 2.001, rel=1e-6)
    yogi = strategies.get("fedyogi", server_lr=0.01, tau=1e-3)
    # m = 0.1 * 2 = 0.2 ; v = 0 - 0.01 * 4 * sign(0 - 4) = 0.04 ; w = 0.01 * 0.2 / (0.2 + 0.001)
    assert yogi.merge([sd(2.0)], [1], reference=sd(0.0)).state_dict["w"].item() == \
        pytest.approx(0.01 * 0.2 / 0.201, rel=1e-6)


def test_median_and_trimmed_mean_by_hand():
    med = strategies.get("fedmedian")
    assert med.merge([sd(1.0), sd(5.0), sd(3.0)], [1, 1, 1]).state_dict["w"].item() == 3.0
    assert med.merge([sd(1.0), sd(2.0), sd(3.0), sd(10.0)], [1] * 4).state_dict["w"].item() == 2.5
    tm = strategies.get("trimmed-mean", beta=0.2)
    # 5 models, floor(0.2 * 5) = 1 cut per side: mean(2, 3, 4) = 3, the outlier 100 is gone
    models = [sd(v) for v in (1.0, 2.0, 3.0, 100.0, 4.0)]
    assert tm.merge(models, [1] * 5).state_dict["w"].item() == pytest.approx(3.0)


def test_krum_and_multi_krum_by_hand():
    models = [sd(0.0), sd(0.1), sd(0.2), sd(10.0)]
    # f = 1: each model scores its n - f - 2 = 1 nearest squared distance; 10.0 scores 96.04
    krum = strategies.get("krum", num_malicious=1).merge(models, [1, 1, 1, 1])
    assert krum.state_dict["w"].item() == pytest.approx(0.0)
    assert krum.info["selected_nodes"] == ["0"]
    multi = strategies.get("multi-krum", num_malicious=1).merge(models, [1, 1, 1, 1])
    assert multi.state_dict["w"].item() == pytest.approx(0.1)  # mean of the n - f = 3 best
    assert sorted(multi.info["selected_nodes"]) == ["0", "1", "2"]


@pytest.mark.parametrize("name", ["krum", "multi-krum"])
def test_krum_needs_more_than_2f_plus_2_models_per_merge(name):
    from fedavg.config.settings import RunConfig
    from fedavg.util.errors import UserError

    # f = 1: 2f + 2 = 4, so 5 nodes per round are the fewest
    five = RunConfig().replace(strategy=name, num_nodes=5, num_malicious=1)
    assert five.build_strategy().name == name
    with pytest.raises(UserError, match=rf"{name}: --num-malicious 1 needs more than 2f\+2 = 4 "
                                        r"node models per merge, got 4"):
        five.replace(fraction=0.8).build_strategy()  # 4 of 5 nodes a round
    assert RunConfig().replace(strategy=name, num_nodes=2).build_strategy()  # f = 0: any n


def test_uniform_soup_ignores_sample_counts():
    out = strategies.get("uniform-soup").merge([sd(1.0), sd(4.0)], [1, 100]).state_dict["w"]
    assert out.item() == pytest.approx(2.5)


# --- agreement with Flower's implementations on float weights -------------------------------


def _flower_reply(node, state, n):
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return Message(RecordDict({"arrays": ArrayRecord({k: v.clone() for k, v in state.items()}),
                               "metrics": MetricRecord({"num-examples": n})}), reply_to=sent)


def _flower(name):
    from flwr.serverapp import strategy as fs

    return {
        "fedavg": lambda: fs.FedAvg(),
        "fedavgm": lambda: fs.FedAvgM(server_learning_rate=0.7, server_momentum=0.9),
        "fedadam": lambda: fs.FedAdam(eta=0.05, tau=1e-3),
        "fedyogi": lambda: fs.FedYogi(eta=0.05, tau=1e-3),
        "fedadagrad": lambda: fs.FedAdagrad(eta=0.05, tau=1e-3),
        "fedmedian": lambda: fs.FedMedian(),
        "trimmed-mean": lambda: fs.FedTrimmedAvg(beta=0.2),
        "krum": lambda: fs.Krum(num_malicious_nodes=1),
        "multi-krum": lambda: fs.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=4),
    }[name]()


OURS = {"fedavgm": {"server_lr": 0.7, "server_momentum": 0.9},
        "fedadam": {"server_lr": 0.05, "tau": 1e-3}, "fedyogi": {"server_lr": 0.05, "tau": 1e-3},
        "fedadagrad": {"server_lr": 0.05, "tau": 1e-3}, "trimmed-mean": {"beta": 0.2},
        "krum": {"num_malicious": 1}, "multi-krum": {"num_malicious": 1}}


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad",
                                  "fedmedian", "trimmed-mean", "krum", "multi-krum"])
def test_agrees_with_flower_over_three_rounds(name, task_identity):
    from flwr.app import ArrayRecord

    gen = torch.Generator().manual_seed(1)
    current = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    ours = strategies.get(name, **OURS.get(name, {}))
    flower = _flower(name)
    for rnd in (1, 2, 3):
        models = [{k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in current.items()}
                  for _ in range(5)]
        counts = [10, 20, 30, 40, 50]
        replies = [_flower_reply(i + 1, m, n) for i, (m, n) in enumerate(zip(models, counts))]
        if hasattr(flower, "current_arrays"):  # server optimisers step from the global model
            if name == "fedavgm":
                flower.current_arrays = ArrayRecord({k: v.clone() for k, v in current.items()})
            else:
                flower.current_arrays = {k: v.numpy() for k, v in current.items()}
        theirs, _ = flower.aggregate_train(rnd, replies)
        mine = ours.merge(models, counts, reference=current).state_dict
        for key in current:
            assert np.allclose(mine[key].numpy(), theirs[key].numpy(), atol=1e-5), (name, rnd, key)
        current = {k: torch.from_numpy(theirs[k].numpy().copy()) for k in current}


# --- BatchNorm models and integer buffers, with every multi-round strategy -------------------


def _bn_state(seed, steps):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    m.train()
    for _ in range(steps):
        m(torch.randn(8, 1, 4, 4) * (seed + 1))
    return m


@pytest.mark.parametrize("name", MULTI_ROUND)
def test_batchnorm_with_every_strategy(name):
    models = [_bn_state(i, steps=i + 2) for i in range(5)]
    states = [m.state_dict() for m in models]
    reference = _bn_state(9, 1).state_dict()
    buffers = frozenset(n for n, _ in models[0].named_buffers())
    s = strategies.get(name, **({"num_malicious": 1} if "krum" in name else {}))
    out = s.merge(states, [1, 2, 3, 4, 5], reference=reference, buffers=buffers).state_dict
    assert all(torch.isfinite(v).all() for v in out.values() if v.is_floating_point())
    assert out["1.num_batches_tracked"].dtype == torch.int64
    assert out["1.running_var"].min() > 0  # never a negative variance
    if name in ("fedadam", "fedyogi", "fedadagrad", "fedavgm", "fedavg", "fedprox"):
        # buffers take the plain sample-weighted average, never an optimiser step
        expected = sum(w * st["1.running_var"].double() for w, st in
                       zip([1, 2, 3, 4, 5], states)) / 15
        assert torch.allclose(out["1.running_var"].double(), expected, atol=1e-6)
        assert out["1.num_batches_tracked"].item() == 6  # the maximum, not 4.67 -> 4
    net = _bn_state(0, 0)
    net.load_state_dict(out)
    assert torch.isfinite(net.eval()(torch.randn(2, 1, 4, 4))).all()


def test_option_values_are_checked():
    for name, opts in [("trimmed-mean", {"beta": 0.5}), ("fedprox", {"mu": -1}),
                       ("krum", {"num_malicious": -1}), ("ensemble", {"ensemble_weights": "x"}),
                       ("fedadam", {"server_lr": 0})]:
        with pytest.raises(ValueError):
            strategies.get(name, **opts)


# --- one-shot merges that use held-out data ---------------------------------------------------


def _toy_context():
    """Two separable classes in 2-D; the identity normalisation."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=gen)
    y = (x[:, 0] > 0).long()
    return MergeContext(build_model=lambda: nn.Linear(2, 2), normalize=lambda v: v.float(),
                        val_x=x, val_y=y, distill_x=torch.randn(300, 2, generator=gen))


GOOD = {"weight": torch.tensor([[-3.0, 0.0], [3.0, 0.0]]), "bias": torch.zeros(2)}
BAD = {"weight": torch.tensor([[9.0, 0.0], [-9.0, 0.0]]), "bias": torch.zeros(2)}
WEAK = {"weight": torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), "bias": torch.zeros(2)}


def test_greedy_soup_leaves_out_a_member_that_hurts():
    ctx = _toy_context()
    res = strategies.get("greedy-soup").merge([BAD, GOOD, WEAK], [1, 1, 1], context=ctx)
    # GOOD first (best held-out accuracy, ties by order); WEAK keeps accuracy at 1.0 and joins;
    # BAD would cancel GOOD and is left out
    assert res.info["members"] == ["1", "2"]
    assert torch.allclose(res.state_dict["weight"], (GOOD["weight"] + WEAK["weight"]) / 2)
    assert res.info["val_accuracy"] == pytest.approx(1.0)


def test_ensemble_weightings():
    ctx = _toy_context()
    members = [GOOD, BAD]
    by_count = strategies.get("ensemble").merge(members, [30, 10], context=ctx)
    assert by_count.is_ensemble and by_count.member_weights == pytest.approx([0.75, 0.25])
    uniform = strategies.get("ensemble", ensemble_weights="uniform").merge(members, [30, 10])
    assert uniform.member_weights == pytest.approx([0.5, 0.5])
    acc = strategies.get("ensemble", ensemble_weights="accuracy").merge(members, [1, 1],
                                                                         context=ctx)
    assert acc.member_weights == pytest.approx([1.0, 0.0])  # accuracies 1.0 and 0.0
    fitted = strategies.get("ensemble", ensemble_weights="fitted").merge(members, [1, 1],
                                                                          context=ctx)
    assert fitted.member_weights[0] > 0.95
    with pytest.raises(strategies.MergeError, match="validation"):
        strategies.get("ensemble", ensemble_weights="fitted").merge(members, [1, 1])


def test_fit_weights_by_hand():
    # member 0 gives the true class 0.9, member 1 gives it 0.1, on every sample: all on 0
    probs = torch.tensor([[[0.9, 0.1]] * 4, [[0.1, 0.9]] * 4])
    w = fit_weights(probs, torch.zeros(4, dtype=torch.long))
    assert w[0] > 0.99 and w.sum().item() == pytest.approx(1.0)
    # two members that are each right on half the samples: the optimum mixes them equally
    probs = torch.tensor([[[0.9, 0.1], [0.1, 0.9]], [[0.1, 0.9], [0.9, 0.1]]])
    w = fit_weights(probs, torch.tensor([0, 0]))
    assert w.tolist() == pytest.approx([0.5, 0.5], abs=1e-4)


def test_ensemble_model_outputs_log_of_weighted_probabilities():
    a, b = nn.Linear(1, 2), nn.Linear(1, 2)
    for m, bias in ((a, [0.0, math.log(3.0)]), (b, [0.0, 0.0])):
        nn.init.zeros_(m.weight)
        m.bias.data = torch.tensor(bias)
    ens = EnsembleModel([a, b], [3, 1])  # weights 0.75, 0.25
    out = ens(torch.zeros(1, 1)).exp()
    # a gives (0.25, 0.75), b gives (0.5, 0.5): 0.75 * a + 0.25 * b = (0.3125, 0.6875)
    assert out[0].tolist() == pytest.approx([0.3125, 0.6875])


def test_distill_student_learns_the_ensemble():
    ctx = _toy_context()
    # members that each see only part of the picture; the average is worse than the ensemble
    m1 = {"weight": torch.tensor([[-4.0, -1.0], [4.0, 1.0]]), "bias": torch.tensor([0.0, 0.5])}
    m2 = {"weight": torch.tensor([[-4.0, 1.0], [4.0, -1.0]]), "bias": torch.tensor([0.5, 0.0])}
    res = strategies.get("distill", distill_steps=200, distill_lr=0.05).merge(
        [m1, m2], [1, 1], context=ctx)
    assert not res.is_ensemble and set(res.state_dict) == {"weight", "bias"}
    assert res.info["val_accuracy"] >= res.info["val_accuracy_average"]
    assert res.info["val_accuracy"] >= 0.95
    with pytest.raises(strategies.MergeError, match="unlabeled"):
        strategies.get("distill").merge([m1, m2], [1, 1])


def test_distill_augments_each_batch_and_labels_it_with_the_ensemble():
    ctx = _toy_context()
    seen = []

    def mirror(batch):  # an augmentation the teacher must see: x -> -x
        seen.append(len(batch))
        return -batch

    ctx.augment = mirror
    m1 = {"weight": torch.tensor([[-4.0, -1.0], [4.0, 1.0]]), "bias": torch.tensor([0.0, 0.5])}
    m2 = {"weight": torch.tensor([[-4.0, 1.0], [4.0, -1.0]]), "bias": torch.tensor([0.5, 0.0])}
    plain = strategies.get("distill", distill_steps=50, distill_lr=0.05, distill_batch_size=32)
    res = strategies.get("distill", distill_steps=50, distill_lr=0.05, distill_batch_size=32,
                         distill_augment="default").merge([m1, m2], [1, 1], context=ctx)
    assert seen == [32] * 50 and res.info["augment"] == "default"
    # labelled anew on the augmented inputs, the student still learns the ensemble's rule
    assert res.info["val_accuracy"] >= 0.95
    ctx.augment = None
    assert plain.merge([m1, m2], [1, 1], context=ctx).info["augment"] == "none"
    with pytest.raises(strategies.MergeError, match="no default augmentation"):
        strategies.get("distill", distill_augment="default").merge([m1, m2], [1, 1],
                                                                    context=ctx)
    with pytest.raises(ValueError, match="--distill-augment"):
        strategies.get("distill", distill_augment="yes")
