"""DP-SGD on a node (fedavg.node.dp_sgd): Poisson batches, per-sample clipping, noise scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedavg.config.settings import LocalTraining
from fedavg.node import dp_sgd
from fedavg.node.train import train
from fedavg.util.errors import UserError

# torch notes that Opacus's hooks fire on a first layer whose input needs no gradient (data)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

SPEC = {"kind": "image", "shape": [1, 8, 8], "mean": [0.5], "std": [0.5], "scale": 1 / 16}


def test_sample_rate_and_steps_follow_the_batch_size():
    assert dp_sgd.sample_rate(100, 32) == 0.25  # ceil(100 / 32) = 4 batches an epoch
    assert dp_sgd.sample_rate(10, 32) == 1.0
    assert dp_sgd.steps_per_round(100, 32, local_epochs=3) == 12
    assert dp_sgd.steps_per_round(100, 32, local_epochs=3, local_steps=5) == 5


def test_poisson_batches_take_each_sample_with_probability_q():
    g = torch.Generator().manual_seed(0)
    batches = list(dp_sgd.poisson_batches(50, 0.1, 4000, g))
    assert len(batches) == 4000
    sizes = np.array([len(b) for b in batches])
    assert sizes.mean() == pytest.approx(5.0, rel=0.03)  # q N
    assert (sizes == 0).any()  # (1 - 0.1)^50 = 0.5 %: empty batches happen
    counts = np.bincount(torch.cat(batches).numpy(), minlength=50)
    assert counts.min() > 300 and counts.max() < 500  # each about q x 4000 = 400 times


def _private(model, n, batch, noise, clip):
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    return dp_sgd.PrivateTraining(model, opt, n, batch, noise, clip)


def test_each_sample_gradient_is_clipped_then_summed_over_the_expected_batch():
    """Hand values: w = 0, loss = mean_i w . x_i, so sample i's gradient is x_i.

    x_1 = (3, 4) (norm 5) clips to (0.6, 0.8) at C = 1; x_2 = (0.3, 0.4) (norm 0.5) stays.
    N = B = 2, so q = 1 and the expected batch is 2: with no noise and lr 1 the step is
    w = -((0.6, 0.8) + (0.3, 0.4)) / 2 = (-0.45, -0.6). Plain SGD would give (-1.65, -2.2).
    """
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    private = _private(model, n=2, batch=2, noise=0.0, clip=1.0)
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    private.module(x).mean().backward()
    private.private_optimizer.step()
    private.close()
    assert model.weight.detach().flatten().tolist() == pytest.approx([-0.45, -0.6], abs=1e-6)


def test_the_noise_on_a_step_has_std_z_times_c_over_the_expected_batch():
    model = nn.Linear(20_000, 1, bias=False)
    nn.init.zeros_(model.weight)
    private = _private(model, n=4, batch=4, noise=2.0, clip=0.5)  # q = 1, expected batch 4
    private.module(torch.zeros(4, 20_000)).sum().backward()  # zero gradients: noise alone
    private.private_optimizer.step()
    private.close()
    w = model.weight.detach().flatten()
    assert w.mean().item() == pytest.approx(0.0, abs=0.01)
    assert w.std().item() == pytest.approx(2.0 * 0.5 / 4, rel=0.03)  # z C / (q N) = 0.25


def test_the_noise_is_drawn_anew_each_round_not_from_the_seed():
    def one_round():
        model = nn.Linear(100, 1, bias=False)
        nn.init.zeros_(model.weight)
        private = _private(model, n=1, batch=1, noise=1.0, clip=1.0)
        private.module(torch.zeros(1, 100)).sum().backward()
        private.private_optimizer.step()
        private.close()
        return model.weight.detach().clone()

    assert not torch.equal(one_round(), one_round())  # a replayable noise protects nothing


def test_batchnorm_is_refused_naming_the_layer_and_groupnorm_trains():
    with_bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                            nn.LazyLinear(10))
    assert "layer '1' (BatchNorm2d) has no per-sample gradient" in \
        dp_sgd.unsupported_layer(with_bn)
    with pytest.raises(UserError, match="'1' \\(BatchNorm2d\\)"):
        _private(with_bn, 10, 5, 1.0, 1.0)
    with_gn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(),
                            nn.Linear(4 * 6 * 6, 10))
    assert dp_sgd.unsupported_layer(with_gn) is None


def test_train_reports_the_rate_and_steps_and_leaves_the_model_as_it_was_built():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (90, 1, 8, 8)).astype(np.uint8)
    y = rng.integers(0, 10, 90)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    keys = list(model.state_dict())
    before = model[1].weight.detach().clone()
    stats = train(model, x, y, SPEC, LocalTraining(dp_sgd=True, batch_size=30, local_epochs=2),
                  dp_noise=1.0)
    assert stats["dp_sample_rate"] == pytest.approx(1 / 3)
    assert stats["steps"] == 6 and stats["num_examples"] == 90
    assert not torch.equal(model[1].weight, before)
    assert list(model.state_dict()) == keys  # no wrapper's prefix in what the node sends
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # hooks gone
    assert not model[1]._forward_hooks and not model[1]._backward_hooks
    plain = train(model, x, y, SPEC, LocalTraining(batch_size=30))
    assert "dp_sample_rate" not in plain and plain["steps"] == 3


class _Residual(nn.Module):
    """A ResNet block's shape: a norm layer's output added to in place (``out += x``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.norm = nn.GroupNorm(1, 1)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out = self.norm(self.conv(x))
        out += x
        return self.head(out.flatten(1))


def test_an_in_place_residual_add_falls_back_to_expanded_weights_and_trains():
    model = _Residual()
    x = torch.randn(6, 1, 8, 8)
    hooked = _private(model, 6, 6, 0.0, 1e6)  # no probe: Opacus's hooks, which fail here
    with pytest.raises(RuntimeError, match="BackwardHookFunction"):
        hooked.module(x).sum().backward()
    hooked.close()
    before = model.head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    private = dp_sgd.PrivateTraining(model, opt, 6, 6, 0.0, 1e6, probe=x[:2])
    private.module(x).sum().backward()
    assert model.head.weight.grad_sample.shape == (6, 10, 64)  # per sample
    private.private_optimizer.step()
    private.close()
    assert not torch.equal(model.head.weight, before)


def test_group_norm_replaces_batchnorm_in_the_spec_every_copy_builds():
    from fedavg.models.registry import ModelSpec

    spec = ModelSpec.resolve("resnet18", (3, 32, 32), 10, group_norm=True)
    model = spec.build()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 20
    assert dp_sgd.unsupported_layer(model) is None
    assert any("20 BatchNorm layer(s) replaced by GroupNorm" in n for n in spec.check(model))
    again = ModelSpec.from_dict(spec.as_dict())  # as model.json and the wire carry it
    assert again.group_norm and again.build().state_dict().keys() == model.state_dict().keys()
    plain = ModelSpec.resolve("resnet18", (3, 32, 32), 10)
    assert "group_norm" not in plain.as_dict() and dp_sgd.unsupported_layer(plain.build())


def test_a_model_opacus_cannot_take_per_sample_gradients_of_is_refused_naming_both_ways():
    class Bag(nn.Module):  # fastText's shape: an EmbeddingBag over token ids
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(50, 8, mode="sum")
            self.fc = nn.Linear(8, 4)

        def forward(self, ids):
            return self.fc(self.bag(ids))

    model = Bag()
    with pytest.raises(UserError, match=r"no per-sample gradients for model bag \(hooks: .*; "
                                        r"ew: .*embedding_bag.*\): pick another --model"):
        dp_sgd.per_sample_mode(model, torch.zeros(2, 6, dtype=torch.long), "bag")
    assert all(p.grad is None for p in model.parameters())  # the probe left nothing
    linear = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    assert dp_sgd.per_sample_mode(linear, torch.zeros(2, 1, 8, 8)) == "hooks"
    assert dp_sgd.per_sample_mode(_Residual(), torch.zeros(2, 1, 8, 8)) == "ew"
