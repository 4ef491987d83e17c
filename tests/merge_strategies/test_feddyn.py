"""FedDyn (strategies/feddyn.py): server and node update rules, by hand."""

import pytest
import torch
from torch import nn

import strategies
from strategies.feddyn import FedDynNode


def ctx(num_nodes):
    return strategies.MergeContext(build_model=lambda: None, normalize=lambda x: x,
                                   num_nodes=num_nodes)


def test_server_rounds_by_hand():
    s = strategies.get("feddyn", alpha_dyn=0.1)
    s.begin({"w": torch.zeros(1)}, context=ctx(4))
    s.add({"w": torch.tensor([1.0])}, 1, "a")
    s.add({"w": torch.tensor([3.0])}, 100, "b")  # unweighted: samples do not count
    # mean 2; h = 0 - 0.1 * (1/4) * ((1 - 0) + (3 - 0)) = -0.1; x+ = 2 + 0.1 / 0.1 = 3
    assert s.result().state_dict["w"].item() == pytest.approx(3.0)
    assert s.state()["h.w"].item() == pytest.approx(-0.1)
    s.begin({"w": torch.tensor([3.0])}, context=ctx(4))
    s.add({"w": torch.tensor([3.0])}, 1, "a")
    # no movement: h stays -0.1; x+ = 3 + 1 = 4
    assert s.result().state_dict["w"].item() == pytest.approx(4.0)


def test_buffers_are_sample_weighted_and_state_reloads():
    s = strategies.get("feddyn")
    ref = {"w": torch.zeros(1), "bn": torch.zeros(1)}
    s.begin(ref, frozenset({"bn"}), ctx(2))
    s.add({"w": torch.ones(1), "bn": torch.tensor([1.0])}, 1, "a")
    s.add({"w": torch.ones(1), "bn": torch.tensor([5.0])}, 3, "b")
    assert s.result().state_dict["bn"].item() == pytest.approx(4.0)
    again = strategies.get("feddyn")
    again.load_state(s.state(), ref)
    assert set(s.state()) == {"h.w"} and torch.equal(again.h["w"], s.h["w"])
    with pytest.raises(strategies.MergeError):
        again.load_state({"c.w": torch.zeros(1)}, ref)


def test_alpha_must_be_positive():
    with pytest.raises(ValueError, match="--alpha-dyn"):
        strategies.get("feddyn", alpha_dyn=0)


class Scalar(nn.Module):
    """One trainable number."""

    def __init__(self, value):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value]))


def test_node_terms_and_state_by_hand():
    model = Scalar(1.0)
    rule = FedDynNode({"alpha_dyn": 0.1})
    rule.begin(model, {}, {"w": torch.tensor([0.5])})
    with torch.no_grad():
        model.w.copy_(torch.tensor([2.0]))
    # -<g, w> + alpha/2 ||w - x||^2 = -1 + 0.05
    assert rule.loss(model, None, None).item() == pytest.approx(-0.95)
    # g - alpha (w - x) = 0.5 - 0.1
    assert rule.finish(model).state["w"].item() == pytest.approx(0.4)


def test_first_round_starts_from_zero_gradient_state():
    model = Scalar(1.0)
    rule = FedDynNode({"alpha_dyn": 0.5})
    rule.begin(model, {}, None)
    assert rule.loss(model, None, None).item() == 0.0
    with pytest.raises(strategies.MergeError, match="gradient state"):
        FedDynNode({"alpha_dyn": 0.5}).begin(model, {}, {"v": torch.zeros(1)})
