"""Exact LoRA merging (strategies/lora.py), checked against products computed by hand."""

import pytest
import torch

import strategies
from strategies.lora import delta, fold_into_base, fold_reply, layer_keys
from strategies.tensors import MergeError

W, A, B = layer_keys("layer")


def test_layer_keys_follow_peft():
    assert (W, A, B) == ("layer.base_layer.weight", "layer.lora_A.default.weight",
                         "layer.lora_B.default.weight")


def test_delta_is_scaling_times_b_a_on_2x2():
    a = torch.tensor([[1.0, 2.0]])  # (r=1, in=2)
    b = torch.tensor([[3.0], [4.0]])  # (out=2, r=1)
    # B A = [[3, 6], [4, 8]]; times s = 0.5
    assert torch.equal(delta(a, b, 0.5, torch.Size([2, 2])),
                       torch.tensor([[1.5, 3.0], [2.0, 4.0]]))


def test_delta_of_a_convolution_keeps_its_kernel_shape():
    a = torch.ones(2, 3, 1, 1)  # (r, in, 1, 1)
    b = torch.ones(4, 2, 1, 1)  # (out, r, 1, 1)
    out = delta(a, b, 1.0, torch.Size([4, 3, 1, 1]))
    assert out.shape == (4, 3, 1, 1) and torch.all(out == 2.0)


def test_factors_that_do_not_make_the_weight_are_refused():
    with pytest.raises(MergeError, match="do not make a"):
        delta(torch.ones(1, 3), torch.ones(2, 1), 1.0, torch.Size([2, 2]))


def _node(a_rows, b_cols, head):
    return {A: torch.tensor(a_rows), B: torch.tensor(b_cols), "head": torch.tensor(head)}


def test_exact_fedavg_is_the_weighted_average_of_the_products_not_of_the_factors():
    reference = {W: torch.tensor([[1.0, 0.0], [0.0, 1.0]]), A: torch.tensor([[0.5, 0.5]]),
                 B: torch.zeros(2, 1), "head": torch.tensor([0.0])}
    node1 = _node([[1.0, 0.0]], [[2.0], [0.0]], [1.0])  # B1 A1 = [[2, 0], [0, 0]]
    node2 = _node([[0.0, 1.0]], [[0.0], [4.0]], [3.0])  # B2 A2 = [[0, 0], [0, 4]]
    layers = {"layer": 1.0}
    folded = [fold_reply(n, reference, layers) for n in (node1, node2)]
    merged = strategies.get("fedavg").merge(folded, weights=[1, 3]).state_dict
    # W + (1 * B1 A1 + 3 * B2 A2) / 4 = [[1 + 0.5, 0], [0, 1 + 3]]
    assert torch.allclose(merged[W], torch.tensor([[1.5, 0.0], [0.0, 4.0]]))
    assert torch.allclose(merged["head"], torch.tensor([2.5]))
    # the adapters are the round's again: B = 0, so the next round starts afresh
    assert torch.equal(merged[A], reference[A]) and torch.equal(merged[B], reference[B])
    # averaging the factors apart gives another model: (B1 + 3 B2)/4 (A1 + 3 A2)/4
    b_avg = (node1[B] + 3 * node2[B]) / 4
    a_avg = (node1[A] + 3 * node2[A]) / 4
    assert torch.allclose(b_avg @ a_avg, torch.tensor([[0.125, 0.375], [0.75, 2.25]]))
    assert not torch.allclose(reference[W] + b_avg @ a_avg, merged[W])


def test_a_reply_without_its_adapter_is_refused():
    reference = {W: torch.eye(2), A: torch.ones(1, 2), B: torch.zeros(2, 1)}
    with pytest.raises(MergeError, match="lacks the LoRA adapter of layer"):
        fold_reply({A: torch.ones(1, 2)}, reference, {"layer": 1.0})


def test_fold_into_base_gives_the_plain_models_keys_and_weights():
    state = {W: torch.eye(2), "layer.base_layer.bias": torch.tensor([1.0, 2.0]),
             A: torch.tensor([[1.0, 1.0]]), B: torch.tensor([[1.0], [0.0]]),
             "head.weight": torch.ones(3, 2)}
    out = fold_into_base(state, {"layer": 2.0})
    assert set(out) == {"layer.weight", "layer.bias", "head.weight"}
    assert torch.equal(out["layer.weight"], torch.tensor([[3.0, 2.0], [0.0, 1.0]]))
    assert torch.equal(out["layer.bias"], torch.tensor([1.0, 2.0]))
