"""MOON (strategies/moon.py): the contrastive term, by hand, and the node rule's hooks."""

import math

import pytest
import torch
from torch import nn

import strategies
from strategies.moon import MoonNode, contrastive_loss, last_linear


def test_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0]])
    # sim to global 1, to previous 0, T = 0.5: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    got = contrastive_loss(z, torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]]), 0.5)
    assert got.item() == pytest.approx(math.log(1 + math.exp(-2)))
    same = contrastive_loss(z, z, z, 0.5)
    assert same.item() == pytest.approx(math.log(2))


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_first_round_has_no_term_and_leaves_no_hook():
    model = net()
    rule = MoonNode({"moon_mu": 5.0, "temperature": 0.5})
    rule.begin(model, {}, None)
    assert rule.loss(model, torch.zeros(2, 3), model(torch.zeros(2, 3))) is None
    state = rule.finish(model).state
    assert set(state) == set(model.state_dict())
    rule.close()


def test_term_uses_the_last_linear_layers_input():
    model, prev = net(), net()
    with torch.no_grad():
        for p in prev.parameters():
            p.add_(1.0)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    rule = MoonNode({"moon_mu": 2.0, "temperature": 0.5})
    rule.begin(model, {}, prev.state_dict())
    with torch.no_grad():
        model[0].weight.mul_(-1)  # local training moved the model
    x = torch.randn(5, 3)
    got = rule.loss(model, x, model(x))
    twin = net()
    twin.load_state_dict(glob)
    want = 2.0 * contrastive_loss(model[1](model[0](x)), twin[1](twin[0](x)),
                                  prev[1](prev[0](x)), 0.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert got.requires_grad
    rule.close()
    assert not model[2]._forward_pre_hooks  # the cached model is clean for the next round


def test_a_previous_model_that_does_not_fit_is_one_error():
    with pytest.raises(strategies.MergeError, match="previous MOON model"):
        MoonNode({"moon_mu": 1.0, "temperature": 0.5}).begin(net(), {}, {"x": torch.zeros(1)})


def test_needs_a_linear_classifier_and_valid_options():
    with pytest.raises(strategies.MergeError, match="nn.Linear"):
        last_linear(nn.Sequential(nn.Conv2d(1, 1, 1)))
    with pytest.raises(ValueError, match="--temperature"):
        strategies.get("moon", temperature=0)
    with pytest.raises(ValueError, match="--moon-mu"):
        strategies.get("moon", moon_mu=-1)


def test_setup_refuses_a_model_without_linear_and_notes_a_linear_only_one():
    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import _strategy_notes
    from fedavg.util.errors import UserError

    moon = strategies.get("moon")
    assert moon.check_setup(net(), {}) == []
    notes = moon.check_setup(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), {})
    assert len(notes) == 1 and "trains as fedavg" in notes[0]
    with pytest.raises(UserError, match="^moon: moon needs a model whose classifier is an "
                                        "nn.Linear"):
        _strategy_notes(moon, nn.Sequential(nn.Conv2d(1, 10, 8), nn.Flatten()),
                        RunConfig().replace(strategy="moon"))


def test_feddyn_notes_momentum():
    feddyn = strategies.get("feddyn")
    assert "--momentum 0.9" in feddyn.check_setup(net(), {"optimizer": "sgd", "momentum": 0.9})[0]
    assert feddyn.check_setup(net(), {"optimizer": "sgd", "momentum": 0.0}) == []
