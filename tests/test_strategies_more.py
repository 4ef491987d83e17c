"""Every registered strategy: hand-computed values and agreement with Flower's implementations.

Also BatchNorm models and integer buffers.
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
from strategies import MergeContext
from strategies.ensemble import fit_weights

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
