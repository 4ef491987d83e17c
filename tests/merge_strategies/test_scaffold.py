"""SCAFFOLD (strategies/scaffold.py): server and node update rules, by hand."""

import pytest
import torch
from torch import nn

import strategies
from fedavg.config.settings import LocalTraining
from fedavg.node.train import train
from strategies.scaffold import SERVER_VARIATE, VARIATE_CHANGE, ScaffoldNode, effective_lr


class Scalar(nn.Module):
    """One trainable number."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value]))


def ctx(num_nodes):
    return strategies.MergeContext(build_model=lambda: None, normalize=lambda x: x,
                                   num_nodes=num_nodes)


def test_server_mean_model_and_control_variate_by_hand():
    s = strategies.get("scaffold")
    x = {"w": torch.zeros(2)}
    assert torch.equal(s.to_nodes(x)[SERVER_VARIATE]["w"], torch.zeros(2))  # c starts at 0
    s.begin(x, context=ctx(4))
    s.add_reply({"w": torch.tensor([1.0, 2.0])}, 1, "a",
                arrays={VARIATE_CHANGE: {"w": torch.tensor([1.0, 0.0])}})
    s.add_reply({"w": torch.tensor([3.0, 6.0])}, 3, "b",
                arrays={VARIATE_CHANGE: {"w": torch.tensor([-1.0, 4.0])}})
    merged = s.result().state_dict
    # (1 [1, 2] + 3 [3, 6]) / 4 = [2.5, 5]
    assert torch.allclose(merged["w"], torch.tensor([2.5, 5.0]))
    # c = 0 + 2/4 * (1 [1, 0] + 3 [-1, 4]) / 4 = 0.5 * [-0.5, 3]
    assert torch.allclose(s.to_nodes(merged)[SERVER_VARIATE]["w"], torch.tensor([-0.25, 1.5]))


def test_buffers_have_no_variate_and_are_averaged():
    s = strategies.get("scaffold")
    x = {"w": torch.zeros(1), "bn": torch.zeros(1), "n": torch.tensor(0)}
    assert set(s.to_nodes(x, frozenset({"bn"}))[SERVER_VARIATE]) == {"w"}
    s.begin(x, frozenset({"bn"}), ctx(2))
    s.add_reply({"w": torch.ones(1), "bn": torch.tensor([2.0]), "n": torch.tensor(5)}, 1, "a",
                arrays={VARIATE_CHANGE: {"w": torch.ones(1)}})
    s.add_reply({"w": torch.ones(1), "bn": torch.tensor([4.0]), "n": torch.tensor(7)}, 1, "b",
                arrays={VARIATE_CHANGE: {"w": torch.ones(1)}})
    merged = s.result().state_dict
    assert merged["bn"].item() == 3.0 and merged["n"].item() == 7


def test_a_reply_without_its_variate_change_is_refused_and_changes_nothing():
    s = strategies.get("scaffold")
    x = {"w": torch.zeros(1)}
    s.begin(x, context=ctx(2))
    with pytest.raises(strategies.MergeError, match="scaffold-delta-c"):
        s.add_reply({"w": torch.ones(1)}, 1, "bad")
    with pytest.raises(strategies.MergeError, match="NaN"):
        s.add_reply({"w": torch.ones(1)}, 1, "nan",
                    arrays={VARIATE_CHANGE: {"w": torch.tensor([float("nan")])}})
    with pytest.raises(strategies.MergeError, match="shape|is \\("):
        s.add_reply({"w": torch.ones(1)}, 1, "shape", arrays={VARIATE_CHANGE: {"w": torch.ones(2)}})
    s.add_reply({"w": torch.tensor([4.0])}, 1, "good",
                arrays={VARIATE_CHANGE: {"w": torch.ones(1)}})
    assert s.result().state_dict["w"].item() == 4.0
    assert s.to_nodes(x)[SERVER_VARIATE]["w"].item() == pytest.approx(0.5)  # 1/2 of 1
    with pytest.raises(strategies.MergeError, match="federated rounds"):
        s.merge([{"w": torch.ones(1)}], [1])  # a one-shot merge has no variates


def test_node_variate_update_option_two_by_hand():
    model = Scalar(1.0)
    rule = ScaffoldNode({}, momentum=0.0)
    rule.begin(model, {SERVER_VARIATE: {"w": torch.tensor([0.5])}}, {"w": torch.tensor([0.2])})
    model.w.grad = torch.tensor([1.0])
    rule.before_step(model, 0.1)
    assert model.w.grad.item() == pytest.approx(1.3)  # g + c - c_i
    rule.before_step(model, 0.1)
    with torch.no_grad():
        model.w.copy_(torch.tensor([0.4]))
    update = rule.finish(model)
    # c_i+ = c_i - c + (x - y) / (K eta) = 0.2 - 0.5 + 0.6 / 0.2 = 2.7
    assert update.state["w"].item() == pytest.approx(2.7)
    assert update.arrays[VARIATE_CHANGE]["w"].item() == pytest.approx(2.5)


def test_effective_lr_with_momentum_by_hand():
    assert effective_lr([0.1, 0.1], 0.0) == pytest.approx(0.2)
    # 0.1 (1 - 0.25) / 0.5 + 0.1 (1 - 0.5) / 0.5 = 0.15 + 0.1
    assert effective_lr([0.1, 0.1], 0.5) == pytest.approx(0.25)
    assert effective_lr([], 0.9) == 0.0


def test_no_step_keeps_the_variate():
    model = Scalar(1.0)
    rule = ScaffoldNode({})
    rule.begin(model, {SERVER_VARIATE: {"w": torch.tensor([0.5])}}, None)
    update = rule.finish(model)
    assert update.state["w"].item() == 0.0 and update.arrays[VARIATE_CHANGE]["w"].item() == 0.0


def test_train_applies_the_correction_to_each_step():
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    x, y = torch.tensor([[1.0, -2.0]]), torch.tensor([1])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    c = {k: torch.full_like(v, 0.5) for k, v in start.items()}
    c_i = {k: torch.full_like(v, 0.2) for k, v in start.items()}
    spec = {"kind": "tabular", "mean": [0.0, 0.0], "std": [1.0, 1.0], "scale": 1.0}
    rule = ScaffoldNode({})
    rule.begin(model, {SERVER_VARIATE: c}, c_i)
    train(model, x.numpy(), y.numpy(), spec, LocalTraining(local_epochs=1, batch_size=1, lr=0.1,
                                                           momentum=0.0), rule=rule)
    twin = nn.Linear(2, 2)
    twin.load_state_dict(start)
    nn.functional.cross_entropy(twin(x), y).backward()
    for name, p in twin.named_parameters():
        want = start[name] - 0.1 * (p.grad + 0.3)
        assert torch.allclose(model.state_dict()[name], want, atol=1e-6), name


def test_state_goes_through_load_state_and_refuses_foreign_entries():
    s = strategies.get("scaffold")
    x = {"w": torch.zeros(2)}
    s.to_nodes(x)
    s.c["w"] += 3
    again = strategies.get("scaffold")
    again.load_state(s.state(), x)
    assert torch.equal(again.to_nodes(x)[SERVER_VARIATE]["w"], torch.full((2,), 3.0))
    with pytest.raises(strategies.MergeError, match="c\\.\\*"):
        again.load_state({"m.w": torch.zeros(2)}, x)
    with pytest.raises(strategies.MergeError, match="does not fit"):
        again.load_state({"c.w": torch.zeros(3)}, x)


def _baselines_scaffold(model, x, y, lr, c, c_i, steps):
    """Flower Baselines' NIID-Bench SCAFFOLD node, as its code reads (written anew here).

    Plain SGD steps, then ``p -= lr (c - c_i)`` after each; ``c_i+ = c_i - c + (x - y) / (K lr)``.
    """
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.add_(c[k] - c_i[k], alpha=-lr)
    return {k: c_i[k] - c[k] + (start[k] - p.detach()) / (steps * lr)
            for k, p in model.named_parameters()}


def test_node_agrees_with_flower_baselines_without_momentum():
    torch.manual_seed(3)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    c = {k: torch.randn_like(v) * 0.1 for k, v in ours.named_parameters()}
    c_i = {k: torch.randn_like(v) * 0.1 for k, v in ours.named_parameters()}
    rule = ScaffoldNode({}, momentum=0.0)
    rule.begin(ours, {SERVER_VARIATE: c}, c_i)
    spec = {"kind": "tabular", "mean": [0.0] * 4, "std": [1.0] * 4, "scale": 1.0}
    local = LocalTraining(local_epochs=3, batch_size=6, lr=0.05, momentum=0.0, weight_decay=1e-3)
    train(ours, x.numpy(), y.numpy(), spec, local, rule=rule)
    want_c = _baselines_scaffold(theirs, x, y, 0.05, c, c_i, 3)
    got_c = rule.finish(ours).state
    for k, p in theirs.named_parameters():
        assert torch.allclose(ours.state_dict()[k], p.detach(), atol=1e-6), k
        assert torch.allclose(got_c[k], want_c[k], atol=1e-5), k


class Aliased(nn.Module):
    """Two layers, the second also registered under a second name."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(3, 4), nn.Linear(4, 2)
        self.alias = self.last

    def forward(self, x):
        """Run both layers."""
        return self.last(torch.relu(self.first(x)))


def test_frozen_and_shared_parameters_have_variates_on_both_sides():
    torch.manual_seed(0)
    model = Aliased()
    model.first.requires_grad_(False)  # fine-tuning: a frozen layer
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    server = strategies.get("scaffold")
    sent = server.to_nodes(reference)[SERVER_VARIATE]
    assert set(sent) == set(reference)  # every parameter entry, the alias included
    rule = ScaffoldNode({})
    rule.begin(model, {SERVER_VARIATE: sent}, None)
    spec = {"kind": "tabular", "mean": [0.0] * 3, "std": [1.0] * 3, "scale": 1.0}
    train(model, torch.randn(8, 3).numpy(), torch.randint(0, 2, (8,)).numpy(), spec,
          LocalTraining(local_epochs=1, batch_size=4, lr=0.1, momentum=0.0), rule=rule)
    update = rule.finish(model)
    change = update.arrays[VARIATE_CHANGE]
    assert torch.equal(change["first.weight"], torch.zeros(4, 3))  # frozen: no drift
    assert torch.equal(change["alias.weight"], change["last.weight"])
    server.begin(reference, context=ctx(1))
    server.add_reply(model.state_dict(), 8, "n", arrays=update.arrays)
    server.result()


class WithCounter(nn.Module):
    """A linear layer and an integer parameter (a step counter kept as a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.steps = nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)

    def forward(self, x):
        """Apply the linear layer (the counter takes no part)."""
        return self.lin(x)


def test_an_integer_parameter_has_no_variate_on_either_side():
    """The node's variate held it and the server's did not: every node's round failed."""
    torch.manual_seed(0)
    model = WithCounter()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    server = strategies.get("scaffold")
    sent = server.to_nodes(reference)[SERVER_VARIATE]
    assert set(sent) == {"lin.weight", "lin.bias"}
    rule = ScaffoldNode({})
    rule.begin(model, {SERVER_VARIATE: sent}, None)  # was MergeError: ... has no 'steps'
    spec = {"kind": "tabular", "mean": [0.0] * 3, "std": [1.0] * 3, "scale": 1.0}
    train(model, torch.randn(8, 3).numpy(), torch.randint(0, 2, (8,)).numpy(), spec,
          LocalTraining(local_epochs=1, batch_size=4, lr=0.1, momentum=0.0), rule=rule)
    update = rule.finish(model)
    assert set(update.arrays[VARIATE_CHANGE]) == {"lin.weight", "lin.bias"}
    server.begin(reference, context=ctx(1))
    server.add_reply(model.state_dict(), 8, "n", arrays=update.arrays)
    merged = server.result().state_dict
    assert torch.equal(merged["steps"], torch.zeros(3, dtype=torch.int32))
