"""Fisher-weighted merging against hand-computed values; its node side's estimate."""

import pytest
import torch
from torch import nn

import strategies
from strategies import MergeError
from strategies.fisher import FISHER, FisherNode, diagonal_fisher


def _fisher_merge(models, fishers, weights):
    s = strategies.get("fisher")
    s.begin(models[0])
    for i, (m, f, w) in enumerate(zip(models, fishers, weights)):
        s.add_reply(m, w, str(i), arrays={FISHER: f})
    return s.result().state_dict


def test_each_entry_is_weighted_by_samples_times_fisher_else_the_average():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])}
    fa, fb = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([3.0, 0.0])}
    # equal samples: (1*1 + 3*3) / (1 + 3) = 2.5; no Fisher on entry 1: the mean 3
    assert torch.allclose(_fisher_merge([a, b], [fa, fb], [1, 1])["w"], torch.tensor([2.5, 3.0]))
    # samples 2 and 1: (2*1*1 + 1*3*3) / (2*1 + 1*3) = 11/5; (2*2 + 1*4) / 3 = 8/3
    assert torch.allclose(_fisher_merge([a, b], [fa, fb], [2, 1])["w"],
                          torch.tensor([11 / 5, 8 / 3]))


def test_a_parameter_without_fisher_and_integer_buffers_merge_as_fedavg_does():
    a = {"w": torch.tensor([1.0]), "frozen": torch.tensor([0.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([3.0]), "frozen": torch.tensor([6.0]), "n": torch.tensor(7)}
    out = _fisher_merge([a, b], [{"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0])}], [1, 2])
    assert torch.allclose(out["frozen"], torch.tensor([4.0])) and out["n"].item() == 7


def test_the_fisher_of_a_linear_model_at_zero_weights_by_hand():
    # logits 0: p = (0.5, 0.5); d log p_y / d logits = onehot(y) - p = +-0.5 whatever y is;
    # x = 2: dW = 0.5 * 2 -> squared 1 for both rows; db -> 0.25
    model = nn.Linear(1, 2)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    fisher = diagonal_fisher(model, [torch.tensor([[2.0]])] * 3, torch.Generator().manual_seed(0))
    assert torch.allclose(fisher["weight"], torch.ones(2, 1))
    assert torch.allclose(fisher["bias"], torch.full((2,), 0.25))
    assert model.weight.grad is None and model.training  # left as it was


def test_the_node_keeps_its_first_inputs_once_and_sends_the_estimate():
    rule = FisherNode({"fisher_samples": 5})
    model = nn.Linear(3, 2)
    rule.begin(model, {}, None)
    batch = torch.randn(4, 3)
    assert rule.loss(model, batch, None) is None
    rule.loss(model, batch, None)  # the same batch again (SAM's second pass): not kept twice
    rule.loss(model, torch.randn(4, 3), None)
    assert len(rule.kept) == 5 and torch.equal(rule.kept[3], batch[3:4])
    update = rule.finish(model)
    assert set(update.arrays[FISHER]) == {"weight", "bias"}
    assert all((f >= 0).all() for f in update.arrays[FISHER].values())


@pytest.mark.parametrize("fisher,match", [
    (None, "no 'fisher' record"), ({"w": torch.tensor([1.0, 2.0])}, "does not fit"),
    ({"w": torch.tensor([-1.0])}, "negative"), ({"w": torch.tensor([float("nan")])}, "NaN"),
    ({}, "holds no parameter"), ({"w": torch.tensor([1])}, "not floating point"),
    ({"w": torch.tensor([1.0]), "v": torch.tensor([1.0])}, "other parameters"),
    ({"v": torch.tensor([1.0])}, "other parameters")])
def test_a_malformed_estimate_is_refused_and_leaves_the_merge_unchanged(fisher, match):
    s = strategies.get("fisher")
    good = {"w": torch.tensor([1.0]), "v": torch.tensor([2.0])}
    s.begin(good)
    s.add_reply({"w": torch.tensor([3.0]), "v": torch.tensor([2.0])}, 1, "6",
                arrays={FISHER: {"w": torch.tensor([1.0])}})  # the first node: w only
    with pytest.raises(MergeError, match=match):
        s.add_reply(good, 1, "7", arrays=None if fisher is None else {FISHER: fisher})
    with pytest.raises(MergeError, match="without its Fisher"):
        s.add(good, 1, "7")
    s.add_reply({"w": torch.tensor([5.0]), "v": torch.tensor([4.0])}, 1, "8",
                arrays={FISHER: {"w": torch.tensor([1.0])}})
    merged = s.result().state_dict  # (3 + 5) / 2 and (2 + 4) / 2: node 7 left no trace
    assert torch.equal(merged["w"], torch.tensor([4.0]))
    assert torch.equal(merged["v"], torch.tensor([3.0]))


def test_fisher_samples_below_one_is_refused():
    with pytest.raises(ValueError, match="--fisher-samples"):
        strategies.get("fisher", fisher_samples=0)
