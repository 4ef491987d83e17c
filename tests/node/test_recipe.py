"""The node training recipe: learning-rate schedules and augmentation (fedavg.node.recipe)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fedavg.node.train as train_mod
import strategies
from fedavg.config.settings import LocalTraining, RunConfig
from fedavg.node.recipe import LogitAdjustment, augmenter, make_scheduler, round_lr
from fedavg.node.train import train
from fedavg.node.wire import TrainSettings
from fedavg.run.display import _recipe
from fedavg.util.errors import UserError

TABULAR = {"kind": "tabular", "shape": [2], "scale": 1.0, "mean": [0.0, 0.0],
           "std": [1.0, 1.0]}


def _lrs(schedule: str, total: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(opt, schedule, total)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return seen


def test_schedules_by_hand():
    assert _lrs("constant", 4) == [0.1] * 4
    # cosine over 4 steps: 0.05 * (1 + cos(pi * k / 4)), k = 0..3
    assert _lrs("cosine", 4) == pytest.approx([0.1, 0.0853553, 0.05, 0.0146447], abs=1e-7)
    # step over 8 steps: x0.1 after 4 (half) and after 6 (three quarters)
    assert _lrs("step", 8) == pytest.approx([0.1] * 4 + [0.01] * 2 + [0.001] * 2)
    with pytest.raises(ValueError, match="cosine"):
        make_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), "linear", 4)


@pytest.fixture
def stepped_lrs(monkeypatch) -> list[float]:
    """Record the learning rate of every optimizer step that training takes, in order."""
    seen = []
    real = train_mod.make_optimizer

    def spying(*args, **kwargs):
        opt = real(*args, **kwargs)
        opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
        return opt

    monkeypatch.setattr(train_mod, "make_optimizer", spying)
    return seen


def test_train_steps_the_schedule_over_the_local_epochs(stepped_lrs):
    x = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    y = np.array([0, 1] * 4)
    # 8 samples, batch 4: 2 steps per epoch, 2 epochs: 4 steps of a cosine from 0.1
    stats = train(nn.Linear(2, 2), x, y, TABULAR, LocalTraining(local_epochs=2, batch_size=4,
                                                                lr=0.1, lr_schedule="cosine"))
    assert stats["steps"] == 4
    assert stepped_lrs == pytest.approx([0.1, 0.0853553, 0.05, 0.0146447], abs=1e-7)


def test_local_steps_take_that_many_steps_over_the_epochs(stepped_lrs):
    x = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    y = np.array([0, 1] * 4)
    # 8 samples, batch 4: 2 steps a pass; 5 steps are two passes and one batch of a third,
    # and the cosine runs over the 5 steps (--local-epochs does not count)
    stats = train(nn.Linear(2, 2), x, y, TABULAR, LocalTraining(
        local_epochs=9, local_steps=5, batch_size=4, lr=0.1, lr_schedule="cosine"))
    assert stats["steps"] == 5
    cosine = [0.05 * (1 + math.cos(math.pi * k / 5)) for k in range(5)]
    assert stepped_lrs == pytest.approx(cosine, abs=1e-7)


def test_adamw_decouples_weight_decay():
    model = nn.Linear(2, 2)
    opt = train_mod.make_optimizer(model, "adamw", lr=0.1, momentum=0.0, weight_decay=0.01)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.01


def test_round_lr_decays_by_hand():
    assert round_lr(0.1, 0.5, 1) == 0.1
    assert round_lr(0.1, 0.5, 3) == pytest.approx(0.025)  # 0.1 * 0.5^2
    assert round_lr(0.1, 0.5, 0) == 0.1  # one-shot runs and bare calls: no decay
    assert round_lr(0.2, 1.0, 50) == 0.2


def test_a_node_trains_round_three_from_the_decayed_rate_then_its_schedule(stepped_lrs):
    from fedavg.node.clientapp import _train_with

    x = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    local = LocalTraining(local_epochs=1, batch_size=4, lr=0.1, momentum=0.0, weight_decay=0.0,
                          lr_schedule="cosine", lr_decay=0.5)
    cfg = TrainSettings(model={"name": "mlp"}, input=TABULAR, classes=["a", "b"], seed=0,
                        server_round=3, local=local)
    _train_with(None, nn.Linear(2, 2), x, np.array([0, 1] * 4), cfg, "cpu", 0)
    # round 3 starts from 0.1 * 0.5^2 = 0.025; a cosine over 2 steps: 0.025, 0.0125
    assert stepped_lrs == pytest.approx([0.025, 0.0125], abs=1e-9)


def _shifts(image: torch.Tensor, pad: int, flips: bool):
    """Every crop of ``image`` padded by ``pad`` (zero fill), flipped too if ``flips``."""
    c, h, w = image.shape
    padded = torch.zeros(c, h + 2 * pad, w + 2 * pad, dtype=image.dtype)
    padded[:, pad:pad + h, pad:pad + w] = image
    for base in ([padded, padded.flip(-1)] if flips else [padded]):
        for dy in range(2 * pad + 1):
            for dx in range(2 * pad + 1):
                yield base[:, dy:dy + h, dx:dx + w]


@pytest.mark.parametrize("shape, pad, flips", [((3, 32, 32), 4, True), ((1, 28, 28), 2, False),
                                               ((1, 8, 8), 1, False)])
def test_augmentation_is_a_padded_crop_and_flip_per_sample(shape, pad, flips):
    aug = augmenter({"kind": "image", "shape": list(shape)})
    torch.manual_seed(0)
    batch = torch.randint(1, 256, (6, *shape), dtype=torch.uint8)
    out = aug(batch)
    assert out.shape == batch.shape and out.dtype == torch.uint8
    assert not torch.equal(out, batch)  # 6 samples all left as they were: not augmented
    for before, after in zip(batch, out):
        assert any(torch.equal(after, s) for s in _shifts(before, pad, flips))
    # drawn per sample: the same image six times comes out in more than one way
    same = aug(batch[:1].repeat(6, 1, 1, 1))
    assert len({bytes(s.numpy()) for s in same}) > 1


def test_no_augmentation_for_text_or_tabular():
    assert augmenter({"kind": "text", "shape": [16]}) is None
    assert augmenter(TABULAR) is None
    # the run's model line says so too (a note explains why --augment is ignored)
    config = RunConfig().replace(augment=True, lr_schedule="cosine")
    image = {"kind": "image", "shape": [3, 8, 8]}
    assert _recipe(config, image) == ", cosine learning rate, augmented batches"
    assert _recipe(config, {"kind": "text", "shape": [16]}) == _recipe(config, TABULAR) \
        == ", cosine learning rate"


def test_augmented_training_is_seeded_and_leaves_the_data_alone():
    spec = {"kind": "image", "shape": [1, 8, 8], "scale": 1 / 255, "mean": [0.3],
            "std": [0.2]}
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(16, 1, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 3, size=16)
    kept = x.copy()

    def weights(seed: int, augment: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
        state = torch.random.get_rng_state()
        train(model, x, y, spec, LocalTraining(local_epochs=2, batch_size=4, augment=augment),
              seed=seed)
        assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(weights(3, True), weights(3, True))
    assert not torch.equal(weights(3, True), weights(4, True))
    assert not torch.equal(weights(3, True), weights(3, False))
    assert np.array_equal(x, kept)


def test_recipe_settings_are_checked_and_travel_to_the_nodes():
    with pytest.raises(UserError, match="--lr-schedule must be one of constant, cosine, step"):
        RunConfig().replace(lr_schedule="linear").validate()
    config = RunConfig().replace(lr_schedule="step", augment=True)
    config.validate()
    assert RunConfig.from_flat(config.to_flat()).train.augment is True
    meta = {"model": {"name": "mlp"}, "input": TABULAR, "classes": ["a", "b"]}

    class Plain:  # a strategy without a node rule, as fedavg's
        node_config: dict = {}
        node_rule = None

    record = TrainSettings.for_run(config, meta, Plain()).to_record()
    settings = TrainSettings.from_record(record)
    assert (settings.local.lr_schedule, settings.local.augment) == ("step", True)
    with pytest.raises(UserError, match=r"--lr-decay must be in \(0, 1\] \(got 0.0\)"):
        RunConfig().replace(lr_decay=0.0).validate()
    decayed = RunConfig().replace(lr_decay=0.95)
    assert TrainSettings.from_record(
        TrainSettings.for_run(decayed, meta, Plain()).to_record()).local.lr_decay == 0.95
    bad = TrainSettings.for_run(decayed, meta, Plain()).to_record()
    bad["lr-decay"] = 1.5
    with pytest.raises(ValueError, match="'lr-decay' must be in"):
        TrainSettings.from_record(bad)
    record["augment"] = 1
    with pytest.raises(ValueError, match="'augment' is not bool"):
        TrainSettings.from_record(record)
    record["augment"], record["lr-schedule"] = False, "linear"
    with pytest.raises(ValueError, match="lr-schedule"):
        TrainSettings.from_record(record)
    assert math.isclose(settings.local.lr, config.local_training().lr)


def test_sam_gradient_by_hand():
    from fedavg.node.train import sharpness_aware_gradient

    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))

    def loss():  # sum(w^3) / 3: gradient w^2
        return (model.weight ** 3).sum() / 3

    loss().backward()  # g = (1, 4), ||g|| = sqrt(17)
    sharpness_aware_gradient(model, loss, rho=math.sqrt(17))
    # e = sqrt(17) * g / sqrt(17) = (1, 4): the gradient at (2, 6) is (4, 36) ...
    assert model.weight.grad.flatten().tolist() == pytest.approx([4.0, 36.0])
    # ... and the weights are back where they were
    assert model.weight.detach().flatten().tolist() == pytest.approx([1.0, 2.0])

    model.weight.grad = torch.zeros_like(model.weight)  # a zero gradient: nothing to follow
    sharpness_aware_gradient(model, loss, rho=0.5)
    assert model.weight.grad.tolist() == [[0.0, 0.0]]


def test_sam_keeps_batchnorm_running_statistics():
    from fedavg.node.train import sharpness_aware_gradient

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1)).train()
    xb = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
    model(xb).sum().backward()  # the step's own pass updates them once
    bn = model[1]
    kept = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    sharpness_aware_gradient(model, lambda: model(xb).sum(), rho=0.1)
    assert torch.equal(bn.running_mean, kept[0]) and torch.equal(bn.running_var, kept[1])
    assert int(bn.num_batches_tracked) == kept[2] and bn.track_running_stats


def test_train_with_sam_steps_with_the_gradient_at_the_perturbed_weights():
    x = np.array([[1.0, -1.0], [0.5, 2.0], [-1.5, 0.5], [2.0, 1.0]], dtype=np.float32)
    y = np.array([0, 1, 1, 0])
    torch.manual_seed(0)
    start = nn.Linear(2, 2)
    lr, rho = 0.1, 0.3

    # the reference, step by step: g at w, e = rho g / ||g||, g' at w + e, w <- w - lr g'
    w = [p.detach().clone().requires_grad_(True) for p in start.parameters()]
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)

    def ce(params):
        return nn.functional.cross_entropy(xt @ params[0].T + params[1], yt)

    g = torch.autograd.grad(ce(w), w)
    norm = torch.sqrt(sum((gi ** 2).sum() for gi in g))
    moved = [(wi + rho * gi / norm).detach().requires_grad_(True) for wi, gi in zip(w, g)]
    g2 = torch.autograd.grad(ce(moved), moved)
    expected = [wi.detach() - lr * gi for wi, gi in zip(w, g2)]

    model = nn.Linear(2, 2)
    model.load_state_dict(start.state_dict())
    train(model, x, y, TABULAR, LocalTraining(local_epochs=1, batch_size=4, lr=lr, momentum=0.0,
                                              sam_rho=rho))
    for p, e in zip(model.parameters(), expected):
        assert torch.allclose(p.detach(), e, atol=1e-6)
    plain = nn.Linear(2, 2)
    plain.load_state_dict(start.state_dict())
    train(plain, x, y, TABULAR, LocalTraining(local_epochs=1, batch_size=4, lr=lr, momentum=0.0))
    assert not torch.allclose(plain.weight, model.weight, atol=1e-4)  # SAM changed the step


@pytest.mark.parametrize("key, value, bad, shown", [
    ("sam-rho", 0.05, float("nan"), ", SAM rho 0.05"),
    ("logit-adjust", 1.0, float("inf"), ", logit adjustment 1"),
])
def test_a_node_recipe_value_is_checked_shown_and_travels_to_the_nodes(key, value, bad, shown):
    name = key.replace("-", "_")
    with pytest.raises(UserError, match=rf"--{key} must be >= 0 and finite \(got -0.1\)"):
        RunConfig().replace(**{name: -0.1}).validate()
    config = RunConfig().replace(**{name: value})
    config.validate()
    assert getattr(RunConfig.from_flat(config.to_flat()).train, name) == value
    meta = {"model": {"name": "mlp"}, "input": TABULAR, "classes": ["a", "b"]}

    class Plain:
        node_config: dict = {}
        node_rule = None

    record = TrainSettings.for_run(config, meta, Plain()).to_record()
    assert getattr(TrainSettings.from_record(record).local, name) == value
    record[key] = bad
    with pytest.raises(ValueError, match=f"'{key}' must be >= 0 and finite"):
        TrainSettings.from_record(record)
    del record[key]  # a coordinator that sends none: plain steps, the plain loss
    assert getattr(TrainSettings.from_record(record).local, name) == 0.0
    assert _recipe(config, TABULAR) == shown


def test_a_diverged_sam_run_names_sam_rho_as_a_remedy():
    x = np.array([[np.inf, -1.0], [0.5, 2.0]], dtype=np.float32)  # a NaN loss at once
    with pytest.raises(FloatingPointError, match=r"lower --lr or --sam-rho$"):
        train(nn.Linear(2, 2), x, np.array([0, 1]), TABULAR, LocalTraining(batch_size=2,
                                                                           sam_rho=0.05))
    with pytest.raises(FloatingPointError, match=r"lower --lr$"):  # no SAM: not named
        train(nn.Linear(2, 2), x, np.array([0, 1]), TABULAR, LocalTraining(batch_size=2))


def test_a_diverged_fedprox_run_names_mu_as_a_remedy():
    x = np.array([[np.inf, -1.0], [0.5, 2.0]], dtype=np.float32)  # a NaN loss at once
    with pytest.raises(FloatingPointError, match=r"lower --lr or check --mu$"):
        train(nn.Linear(2, 2), x, np.array([0, 1]), TABULAR, LocalTraining(batch_size=2),
              proximal_mu=1e30)


def test_logit_adjustment_adds_tau_log_of_the_smoothed_label_frequencies():
    # labels 0, 0, 1 of K = 3 classes: counts + 1 = (3, 2, 1), prior (1/2, 1/3, 1/6)
    adjust = LogitAdjustment(torch.tensor([0, 0, 1]), tau=1.0)
    out = adjust(torch.zeros(2, 3))
    expected = torch.tensor([math.log(1 / 2), math.log(1 / 3), math.log(1 / 6)])
    assert torch.allclose(out, expected.expand(2, 3), atol=1e-6)
    # tau scales the offsets; the logits pass through
    half = LogitAdjustment(torch.tensor([0, 0, 1]), tau=0.5)(torch.tensor([[1.0, 2.0, 3.0]]))
    assert torch.allclose(half, torch.tensor([[1.0, 2.0, 3.0]]) + 0.5 * expected, atol=1e-6)
    # the cross-entropy of label 0 at zero logits: -log(1/2), not -log(1/3)
    loss = nn.functional.cross_entropy(out[:1], torch.tensor([0]))
    assert float(loss) == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(ValueError, match="label 3 is beyond the model's 3 outputs"):
        LogitAdjustment(torch.tensor([3]), tau=1.0)(torch.zeros(1, 3))


def test_logit_adjusted_training_takes_the_adjusted_gradient_and_spares_absent_classes():
    """One SGD step by hand; and a class the node never sees is pushed down less."""
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -1.0]], dtype=np.float32)
    y = np.array([0, 1, 0, 0])  # class 2 absent
    torch.manual_seed(0)
    start, lr = nn.Linear(2, 3), 0.5
    w = [p.detach().clone().requires_grad_(True) for p in start.parameters()]
    offsets = torch.log(torch.tensor([4.0, 2.0, 1.0]) / 7)  # counts + 1, tau 1
    logits = torch.as_tensor(x) @ w[0].T + w[1] + offsets
    g = torch.autograd.grad(nn.functional.cross_entropy(logits, torch.as_tensor(y)), w)
    expected = [wi.detach() - lr * gi for wi, gi in zip(w, g)]
    model = nn.Linear(2, 3)
    model.load_state_dict(start.state_dict())
    train(model, x, y, TABULAR, LocalTraining(local_epochs=1, batch_size=4, lr=lr, momentum=0.0,
                                              logit_adjust=1.0))
    for p, e in zip(model.parameters(), expected):
        assert torch.allclose(p.detach(), e, atol=1e-6)
    plain = nn.Linear(2, 3)
    plain.load_state_dict(start.state_dict())
    train(plain, x, y, TABULAR, LocalTraining(local_epochs=5, batch_size=4, lr=lr, momentum=0.0))
    adjusted = nn.Linear(2, 3)
    adjusted.load_state_dict(start.state_dict())
    train(adjusted, x, y, TABULAR, LocalTraining(local_epochs=5, batch_size=4, lr=lr, momentum=0.0,
                                                 logit_adjust=1.0))
    kept, pushed = float(adjusted.bias[2].detach()), float(plain.bias[2].detach())
    assert kept > pushed + 0.1  # the absent class is pushed down less


def test_logit_adjust_notes_nodes_that_hold_one_or_two_labels():
    """The prior alone nearly fits such a node's data: the plan says so, naming how many."""
    from fedavg.data.partition import label_counts
    from fedavg.run.display import logit_adjust_note

    y = np.array([0] * 10 + [1] * 10 + [2] * 10 + [0, 1, 2] * 10)
    parts = [np.arange(0, 10),  # one label
             np.arange(10, 30),  # two labels, 10 each
             np.concatenate([np.arange(0, 19), [32]]),  # 10 + 9 of 20 in two labels: 95 %
             np.arange(30, 60)]  # three labels, a third each
    counts = label_counts(y, parts, 3)
    on = RunConfig().replace(logit_adjust=0.5)
    assert logit_adjust_note(counts, on) == (
        "--logit-adjust 0.5: 3 of 4 nodes hold one or two labels for 95% or more of their "
        "samples; there the label prior alone nearly fits a node's data and it learns little: "
        "lower it (0.1) or leave it off")
    assert logit_adjust_note(counts, RunConfig()) is None  # off: no note
    assert logit_adjust_note(counts[3:], on) is None  # every label on every node


def test_a_diverged_run_names_logit_adjust_as_a_remedy():
    x = np.array([[np.inf, -1.0], [0.5, 2.0]], dtype=np.float32)  # a NaN loss at once
    y = np.array([0, 1])
    with pytest.raises(FloatingPointError, match=r"lower --lr or --logit-adjust$"):
        train(nn.Linear(2, 2), x, y, TABULAR, LocalTraining(batch_size=2, logit_adjust=1.0))
    with pytest.raises(FloatingPointError, match=r"lower --lr, --sam-rho or --logit-adjust$"):
        train(nn.Linear(2, 2), x, y, TABULAR, LocalTraining(batch_size=2, sam_rho=0.05,
                                                            logit_adjust=1.0))


def test_clip_grad_norm_scales_a_step_down_to_its_norm_and_is_checked_everywhere():
    # zero weights, one sample x = (10, 0) of class 0: the gradient of the cross-entropy is
    # W: (softmax - onehot) x^T = [[-5, 0], [5, 0]], b: [-0.5, 0.5]; ||g|| = sqrt(50.5)
    def step(clip: float) -> torch.Tensor:
        model = nn.Linear(2, 2)
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
        train(model, np.array([[10.0, 0.0]], np.float32), np.array([0]), TABULAR,
              LocalTraining(batch_size=1, lr=1.0, momentum=0.0, clip_grad_norm=clip))
        return torch.cat([model.weight.detach().flatten(), model.bias.detach()])

    assert float(step(0.0).norm()) == pytest.approx(math.sqrt(50.5), rel=1e-5)  # lr 1: w = -g
    clipped = step(1.0)
    assert float(clipped.norm()) == pytest.approx(1.0, rel=1e-5)
    assert float(clipped[0]) == pytest.approx(5 / math.sqrt(50.5), rel=1e-5)
    with pytest.raises(UserError, match=r"--clip-grad-norm must be >= 0 and finite"):
        RunConfig().replace(clip_grad_norm=-1.0).validate()
    meta = {"model": {"name": "mlp"}, "input": TABULAR, "classes": ["a", "b"]}
    record = TrainSettings.for_run(RunConfig().replace(clip_grad_norm=0.5), meta,
                                   strategies.get("fedavg")).to_record()
    assert TrainSettings.from_record(record).local.clip_grad_norm == 0.5
    record["clip-grad-norm"] = -2.0
    with pytest.raises(ValueError, match="'clip-grad-norm' must be >= 0 and finite"):
        TrainSettings.from_record(record)

