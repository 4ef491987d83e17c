"""Task arithmetic, TIES, DARE and DARE-TIES against hand-computed values."""

import pytest
import torch

import strategies
from strategies import MergeContext, MergeError
from strategies.dare import drop_and_rescale
from strategies.ties import elect_and_merge, trim

# two nodes' task vectors of one 2x3 parameter, from a start of zeros
T1 = torch.tensor([[3.0, -1.0, 0.5], [-2.0, 4.0, 1.0]])
T2 = torch.tensor([[-1.0, -2.0, 2.0], [1.0, -3.0, 0.2]])
ZERO = {"w": torch.zeros(2, 3)}


def _merge(name, models, weights, start=ZERO, **options):
    return strategies.get(name, **options).merge(models, weights, reference=start).state_dict


def test_ties_trims_elects_and_averages_the_agreeing_entries_of_a_2x3_example():
    # trim to 3 of 6 entries: T1 keeps 4, 3, -2 -> [[3, 0, 0], [-2, 4, 0]];
    # T2 keeps -3, -2, 2 -> [[0, -2, 2], [0, -3, 0]]
    assert torch.equal(trim(torch.stack([T1, T2]), 0.5),
                       torch.stack([torch.tensor([[3.0, 0, 0], [-2, 4, 0]]),
                                    torch.tensor([[0.0, -2, 2], [0, -3, 0]])]))
    # mass [[3, -2, 2], [-2, 1, 0]]: signs + - + / - + 0; (1,1): 4 agrees, -3 does not;
    # (1,2): nothing kept, 0
    merged = _merge("ties", [{"w": T1}, {"w": T2}], [1, 1], density=0.5)
    assert torch.equal(merged["w"], torch.tensor([[3.0, -2.0, 2.0], [-2.0, 4.0, 0.0]]))


def test_ties_elects_by_sample_weighted_mass_and_adds_the_scaled_vector_to_the_start():
    # density 1 keeps everything; weights 1 and 3: mass at (0,0) is 3 - 3 = 0 -> no sign, 0;
    # (0,1): both negative, (1*-1 + 3*-2) / 4 = -1.75; (1,1): 4 - 9 < 0, so only T2: -3
    start = {"w": torch.full((2, 3), 10.0)}
    merged = _merge("ties", [{"w": T1 + 10}, {"w": T2 + 10}], [1, 3], start=start, density=1.0,
                    merge_scale=2.0)
    vector = torch.tensor([[0.0, -1.75, (0.5 + 6) / 4], [1.0, -3.0, (1 + 0.6) / 4]])
    assert torch.allclose(merged["w"], 10 + 2 * vector)


def test_elect_and_merge_of_vectors_that_cancel_is_zero():
    out = elect_and_merge(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out, torch.zeros(2))


def test_task_arithmetic_is_the_start_plus_the_scaled_weighted_mean():
    start = {"w": torch.ones(2, 3)}
    merged = _merge("task-arithmetic", [{"w": T1 + 1}, {"w": T2 + 1}], [1, 3], start=start,
                    merge_scale=2.0)
    # (T1 + 3 T2) / 4 = [[0, -1.75, 1.625], [0.25, -1.25, 0.4]], times 2, plus 1
    want = 1 + 2 * torch.tensor([[0.0, -1.75, 1.625], [0.25, -1.25, 0.4]])
    assert torch.allclose(merged["w"], want)
    # at scale 1 it is FedAvg
    fedavg = strategies.get("fedavg").merge([{"w": T1 + 1}, {"w": T2 + 1}], [1, 3]).state_dict
    assert torch.allclose(_merge("task-arithmetic", [{"w": T1 + 1}, {"w": T2 + 1}], [1, 3],
                                 start=start)["w"], fedavg["w"])


def test_dare_rescaling_keeps_the_expectation_over_seeds():
    vector = torch.tensor([3.0, -1.0, 0.5, 2.0])
    draws = torch.stack([drop_and_rescale(vector, 0.75, torch.Generator().manual_seed(s))
                         for s in range(4000)])
    kept = (draws != 0).double().mean()
    assert abs(kept - 0.25) < 0.02  # a quarter kept ...
    assert torch.equal(draws[draws != 0].unique().sort().values,
                       torch.tensor([-4.0, 2.0, 8.0, 12.0]))  # ... scaled by 1 / (1 - 0.75)
    assert torch.allclose(draws.mean(0), vector, atol=0.1)  # the mean is the vector again


def test_dare_without_drops_is_task_arithmetic_and_dare_ties_is_ties_untrimmed():
    models = [{"w": T1}, {"w": T2}]
    assert torch.allclose(_merge("dare", models, [1, 3], drop_rate=0.0)["w"],
                          _merge("task-arithmetic", models, [1, 3])["w"])
    # elect without trim: (0,1) both negative -1.5; (0,2) (0.5 + 2) / 2; (1,2) (1 + 0.2) / 2
    want = torch.tensor([[3.0, -1.5, 1.25], [-2.0, 4.0, 0.6]])
    assert torch.allclose(_merge("dare-ties", models, [1, 1], drop_rate=0.0)["w"], want)


def test_dare_masks_do_not_depend_on_the_order_models_arrive_in_but_on_the_seed():
    gen = torch.Generator().manual_seed(0)
    models = [{"w": torch.randn(50, generator=gen)} for _ in range(3)]
    start = {"w": torch.zeros(50)}

    def run(order, seed):
        s = strategies.get("dare", drop_rate=0.5)
        ctx = MergeContext(build_model=lambda: None, normalize=lambda x: x, seed=seed)
        return s.merge([models[i] for i in order], [1, 1, 1], reference=start,
                       context=ctx).state_dict["w"]

    assert torch.allclose(run([0, 1, 2], 1), run([2, 0, 1], 1))
    assert not torch.allclose(run([0, 1, 2], 1), run([0, 1, 2], 2))


def test_dare_draws_new_masks_each_round_and_resumes_the_count():
    start, models = {"w": torch.zeros(40)}, [{"w": torch.arange(1.0, 41.0)}]
    s = strategies.get("dare", drop_rate=0.5)
    first = s.merge(models, [1], reference=start).state_dict["w"]
    second = s.merge(models, [1], reference=start).state_dict["w"]
    assert not torch.equal(first, second) and s.state() == {"merges": 2}
    again = strategies.get("dare", drop_rate=0.5)
    again.load_state({"merges": 1})
    assert torch.equal(again.merge(models, [1], reference=start).state_dict["w"], second)
    with pytest.raises(MergeError):
        again.load_state({"momentum": 1})


def test_float_buffers_are_averaged_and_integer_buffers_keep_their_maximum():
    a = {"w": torch.tensor([1.0]), "var": torch.tensor([2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0]), "var": torch.tensor([4.0]), "n": torch.tensor(5)}
    start = {"w": torch.tensor([0.0]), "var": torch.tensor([1.0]), "n": torch.tensor(0)}
    for name in ("task-arithmetic", "ties", "dare", "dare-ties"):
        s = strategies.get(name, merge_scale=3.0)
        out = s.merge([a, b], [1, 1], reference=start,
                      buffers=frozenset({"var", "n"})).state_dict
        assert torch.equal(out["var"], torch.tensor([3.0])), name  # the mean, not scaled
        assert out["n"].item() == 5 and out["n"].dtype == torch.int64, name


@pytest.mark.parametrize("name,options", [
    ("ties", {"density": 0.0}), ("ties", {"density": 1.5}), ("dare", {"drop_rate": 1.0}),
    ("dare-ties", {"drop_rate": -0.1}), ("task-arithmetic", {"merge_scale": 0.0}),
    ("task-arithmetic", {"merge_scale": 1e39}), ("ties", {"merge_scale": float("nan")}),
    ("dare", {"merge_scale": 100.5})])
def test_option_values_outside_their_range_are_refused_naming_the_option(name, options):
    flag = "--" + next(iter(options)).replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        strategies.get(name, **options)
