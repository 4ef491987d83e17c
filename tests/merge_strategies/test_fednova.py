"""FedNova (strategies/fednova.py): the normalising factor and the server update, by hand."""

import pytest
import torch

import strategies
from strategies.fednova import NORMALISER, FedNovaNode, normaliser


def test_normaliser_by_hand():
    assert normaliser([0.1] * 3, 0.0) == pytest.approx(3.0)  # tau for plain SGD
    # the paper's [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho), tau 2, rho 0.5: 2.5
    assert normaliser([0.1, 0.1], 0.5) == pytest.approx(2.5)
    assert normaliser([0.1, 0.05], 0.0) == pytest.approx(1.5)  # a decaying rate counts less
    assert normaliser([], 0.9) == 0.0


def test_node_reports_its_factor():
    rule = FedNovaNode({}, momentum=0.5)
    rule.begin(torch.nn.Linear(1, 1), {}, None)
    for _ in range(2):
        rule.before_step(None, 0.1)
    update = rule.finish(None)
    assert update.metrics == {NORMALISER: pytest.approx(2.5)} and update.state is None


def test_server_update_by_hand():
    s = strategies.get("fednova")
    s.begin({"w": torch.zeros(1)})
    s.add_reply({"w": torch.tensor([-2.0])}, 1, "a", metrics={NORMALISER: 2.0})
    s.add_reply({"w": torch.tensor([-2.0])}, 1, "b", metrics={NORMALISER: 4.0})
    merged = s.result()
    # d = (1 + 0.5) / 2 = 0.75, tau_eff = 3: x+ = 0 - 3 * 0.75 (FedAvg would give -2)
    assert merged.state_dict["w"].item() == pytest.approx(-2.25)
    assert merged.info["tau_eff"] == pytest.approx(3.0)


def test_sample_shares_weight_both_sums():
    s = strategies.get("fednova")
    s.begin({"w": torch.zeros(1)})
    s.add_reply({"w": torch.tensor([-1.0])}, 1, "a", metrics={NORMALISER: 1.0})
    s.add_reply({"w": torch.tensor([-1.0])}, 3, "b", metrics={NORMALISER: 4.0})
    # p = 1/4, 3/4: d = 1/4 * 1 + 3/4 * 0.25 = 0.4375, tau_eff = 1/4 + 3 = 3.25
    assert s.result().state_dict["w"].item() == pytest.approx(-3.25 * 0.4375)


def test_equal_factors_give_fedavg_and_buffers_are_averaged():
    g = torch.Generator().manual_seed(1)
    models = [{"w": torch.randn(3, generator=g), "bn": torch.randn(2, generator=g),
               "n": torch.tensor(i)} for i in range(3)]
    ref = {"w": torch.randn(3, generator=g), "bn": torch.zeros(2), "n": torch.tensor(0)}
    s = strategies.get("fednova")
    s.begin(ref, frozenset({"bn", "n"}))
    for i, m in enumerate(models):
        s.add_reply(m, i + 1, str(i), metrics={NORMALISER: 7.0})
    got = s.result().state_dict
    want = strategies.get("fedavg").merge(models, [1, 2, 3]).state_dict
    assert torch.allclose(got["w"], want["w"], atol=1e-6)
    assert torch.allclose(got["bn"], want["bn"]) and got["n"].item() == 2


@pytest.mark.parametrize("metrics", [None, {}, {NORMALISER: 0.0}, {NORMALISER: float("nan")},
                                     {NORMALISER: True}])
def test_a_reply_without_a_usable_factor_is_refused_and_changes_nothing(metrics):
    s = strategies.get("fednova")
    s.begin({"w": torch.zeros(1)})
    with pytest.raises(strategies.MergeError, match="fednova-a"):
        s.add_reply({"w": torch.tensor([9.0])}, 5, "bad", metrics=metrics)
    s.add_reply({"w": torch.tensor([-2.0])}, 1, "good", metrics={NORMALISER: 2.0})
    assert s.result().state_dict["w"].item() == pytest.approx(-2.0)


def test_server_agrees_with_flower_baselines():
    """Agree with NIID-Bench's FedNova in Flower Baselines (as its code reads, written anew).

    Nodes send ``g_i = (x - y_i) / a_i`` with ``a_i = [tau - rho (1 - rho^tau) / (1 - rho)]
    / (1 - rho)``; the server sets ``x - sum_i (sum_j p_j a_j) p_i g_i``.
    """
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, generator=g)
    ys = [torch.randn(4, generator=g) for _ in range(3)]
    n, tau, rho = [50, 120, 30], [8, 19, 5], 0.9
    a = [(t - rho * (1 - rho ** t) / (1 - rho)) / (1 - rho) for t in tau]
    p = [k / sum(n) for k in n]
    c_fact = sum(ai * pi for ai, pi in zip(a, p))
    want = x - sum(c_fact * pi * (x - y) / ai for pi, y, ai in zip(p, ys, a))
    s = strategies.get("fednova")
    s.begin({"w": x})
    for i, y in enumerate(ys):
        factor = normaliser([0.01] * tau[i], rho)
        assert factor == pytest.approx(a[i])
        s.add_reply({"w": y}, n[i], str(i), metrics={NORMALISER: factor})
    assert torch.allclose(s.result().state_dict["w"], want, atol=1e-5)
