"""DiLoCo's outer step (Douillard et al. 2023) against hand-computed values."""

import pytest
import torch

import strategies


def sd(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([value])}


def test_nesterov_outer_steps_by_hand():
    s = strategies.get("diloco")  # the paper's outer lr 0.7 and momentum 0.9
    # round 1: w = 1, nodes 0.0 and 0.4 (equal weights) -> average 0.2, g = w - avg = 0.8;
    # m = 0.8; step g + 0.9 m = 1.52; w = 1 - 0.7 * 1.52 = -0.064
    out = s.merge([sd(0.0), sd(0.4)], [1, 1], reference=sd(1.0)).state_dict["w"]
    assert out.item() == pytest.approx(-0.064)
    # round 2: w = -0.064, average w - 0.5 -> g = 0.5; m = 0.9 * 0.8 + 0.5 = 1.22;
    # step 0.5 + 0.9 * 1.22 = 1.598; w = -0.064 - 0.7 * 1.598 = -1.1826
    out = s.merge([sd(-0.564)], [1], reference=sd(-0.064)).state_dict["w"]
    assert out.item() == pytest.approx(-1.1826)


def test_outer_lr_one_without_momentum_is_fedavg():
    s = strategies.get("diloco", outer_lr=1.0, outer_momentum=0.0)
    models, weights = [sd(2.0), sd(5.0)], [1, 2]
    ours = s.merge(models, weights, reference=sd(1.0)).state_dict["w"]
    plain = strategies.get("fedavg").merge(models, weights, reference=sd(1.0)).state_dict["w"]
    assert ours.item() == pytest.approx(plain.item()) == pytest.approx(4.0)


def test_momentum_goes_into_the_checkpoint():
    s = strategies.get("diloco")
    s.merge([sd(0.0)], [1], reference=sd(1.0))
    again = strategies.get("diloco")
    again.load_state(s.state(), reference=sd(1.0))
    a = s.merge([sd(0.5)], [1], reference=sd(1.0)).state_dict["w"]
    b = again.merge([sd(0.5)], [1], reference=sd(1.0)).state_dict["w"]
    assert a.item() == b.item()


@pytest.mark.parametrize("options,message", [({"outer_lr": 0.0}, "--outer-lr must be > 0"),
                                             ({"outer_momentum": 1.0}, "--outer-momentum")])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        strategies.get("diloco", **options)


def test_its_nodes_take_adamw_steps_by_default():
    cls = strategies.strategy_class("diloco")
    assert cls.node_defaults == {"optimizer": "adamw", "lr": 1e-3, "local_steps": 50}
