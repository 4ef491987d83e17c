"""FedAvg merge math against hand-computed values, integer buffers, BatchNorm models."""

import pytest
import torch
from torch import nn

import strategies
from strategies import MergeError


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
