"""Bad updates from nodes: the update-norm bound, non-finite merges, and random replies."""

import json
import math
import re
import shlex

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies
from fedavg.run.flower_adapter import FlowerAdapter
from fedavg.util.errors import RunError
from strategies.fedavg import FedAvg


def reply(node, arrays, n=10):
    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": n})})
    return Message(content, reply_to=sent)


def make_adapter(failures, merge=None, **kwargs):
    ref = {"w": torch.zeros(2), "n": torch.tensor(0)}
    return FlowerAdapter(merge or strategies.get("fedavg"), ref,
                         lambda r, node, reason: failures.append((r, node, reason)), **kwargs)


def test_update_norm_by_hand():
    ref = {"w": torch.zeros(2), "b": torch.ones(1), "n": torch.tensor(7)}
    node = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0]), "n": torch.tensor(900)}
    assert strategies.update_norm(ref, node) == pytest.approx(5.0)  # counters do not count
    node["b"] = torch.tensor([13.0])  # sqrt(9 + 16 + 144) = 13
    assert strategies.update_norm(ref, node) == pytest.approx(13.0)
    assert strategies.update_norm(ref, {**node, "w": torch.tensor([math.inf, 0.0])}) == math.inf


def test_first_non_finite_names_the_tensor():
    assert strategies.first_non_finite({"a": torch.ones(2), "n": torch.tensor(3)}) is None
    assert strategies.first_non_finite({"a": torch.ones(2),
                                        "b": torch.tensor([0.0, math.nan])}) == "b"


def test_updates_beyond_the_norm_bound_are_left_out(task_identity):
    failures = []
    a = make_adapter(failures, max_update_norm=4.0)
    replies = [reply(11, {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(1)}),
               reply(12, {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(1)}),  # norm 5
               reply(13, {"w": torch.tensor([-3.0, 1.0]), "n": torch.tensor(1)}, n=30)]
    arrays, _ = a.aggregate_train(2, replies)
    merged = arrays.to_torch_state_dict()
    # nodes 11 and 13 only: (10 * 1 + 30 * -3) / 40 = -2.0 ; (10 + 30) / 40 = 1.0
    assert torch.allclose(merged["w"], torch.tensor([-2.0, 1.0]))
    assert failures == [(2, 12, "update norm 5 exceeds --max-update-norm 4")]


def test_the_bound_is_measured_from_the_rounds_own_model(task_identity):
    failures = []
    a = make_adapter(failures, max_update_norm=1.0)
    start = ArrayRecord({"w": torch.tensor([10.0, 10.0]), "n": torch.tensor(0)})
    a.reference = start.to_torch_state_dict()  # as configure_train sets it
    arrays, _ = a.aggregate_train(3, [reply(11, {"w": torch.tensor([10.5, 10.0]),
                                                 "n": torch.tensor(0)})])
    assert not failures and torch.allclose(arrays.to_torch_state_dict()["w"],
                                           torch.tensor([10.5, 10.0]))


class _Exploding(FedAvg):
    """FedAvg whose result overflows: what a bad server step would do."""

    name = "exploding"

    def result(self):
        out = super().result()
        out.state_dict["w"] = out.state_dict["w"] * math.inf
        return out


def test_a_non_finite_merged_model_fails_the_round(task_identity):
    a = make_adapter([], merge=_Exploding())
    with pytest.raises(RunError, match=r"round 5: the merged model's 'w' has NaN or infinite"):
        a.aggregate_train(5, [reply(11, {"w": torch.tensor([1.0, 0.0]), "n": torch.tensor(0)})])


_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.floats(-1e3, 1e3, width=32))
_tensor = st.one_of(
    st.lists(_values, min_size=0, max_size=4).map(lambda v: torch.tensor(v, dtype=torch.float32)),
    st.lists(st.integers(-5, 5), min_size=1, max_size=3).map(torch.tensor),
    st.lists(_values, min_size=2, max_size=2).map(lambda v: torch.tensor(v, dtype=torch.float64)),
)
_state = st.dictionaries(st.sampled_from(["w", "n", "x"]), _tensor, max_size=3)
_weight = st.one_of(st.integers(-3, 1000), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.function_scoped_fixture])
@given(updates=st.lists(st.tuples(_state, _weight), min_size=1, max_size=4),
       bound=st.one_of(st.none(), st.floats(0.01, 100)))
def test_random_replies_are_merged_or_left_out_never_a_crash(task_identity, updates, bound):
    failures = []
    a = make_adapter(failures, max_update_norm=bound)
    replies = [reply(10 + i, sd, n=w) for i, (sd, w) in enumerate(updates)]
    try:
        arrays, _ = a.aggregate_train(1, replies)
    except RunError as exc:  # no usable reply at all: one line naming why
        assert "no usable model" in str(exc) and "\n" not in str(exc)
        assert len(failures) == len(updates)
        return
    merged = arrays.to_torch_state_dict()
    assert set(merged) == {"w", "n"}
    assert strategies.first_non_finite(merged) is None
    assert len(failures) + a.last_train["num_nodes"] == len(updates)


@pytest.mark.e2e
def test_cli_bound_rejects_every_update_and_says_why(tmp_path):
    from conftest import run_cli

    proc = run_cli("simulate", "--num-nodes", "2", "--rounds", "2", "--max-update-norm",
                   "1e-6", "--output", tmp_path / "run", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "round 1: no usable model from any node" in proc.stderr
    assert re.search(r"\(partition [01]\) update norm [0-9.]+ exceeds --max-update-norm 1e-06",
                     proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    # a later round refused: the resume command it prints leaves the bound out, and works
    run_cli("simulate", "--num-nodes", "2", "--rounds", "1", "--output", tmp_path / "ok")
    proc = run_cli("simulate", "--resume", tmp_path / "ok", "--rounds", "2",
                   "--max-update-norm", "1e-6", check=False)
    assert proc.returncode == 1 and "round 2: no usable model" in proc.stderr, proc.stderr
    hint = proc.stderr.replace("\n", "").split("resume with a larger --max-update-norm or "
                                                "without it: ")[1]
    assert "--max-update-norm" not in hint, hint
    args = shlex.split(hint)
    assert args[:2] == ["fedavg", "simulate"]
    run_cli(*args[1:])
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["rounds"] == 2
    bad = run_cli("simulate", "--max-update-norm", "-1", check=False)
    assert bad.returncode == 2 and "--max-update-norm must be > 0" in bad.stderr


def test_a_round_is_folded_in_partition_order_whatever_the_arrival(task_identity, monkeypatch):
    """Float sums depend on their order: a held round saves the same bits for any arrival."""
    from itertools import permutations

    from fedavg.run import flower_adapter

    gen = torch.Generator().manual_seed(0)
    models = [torch.randn(500, generator=gen) * 10.0 ** p for p in range(4)]

    def merged(order, budget):
        monkeypatch.setattr(flower_adapter, "ORDERED_FOLD_BYTES", budget)
        replies = []
        for pid in order:
            sent = Message(content=RecordDict(), dst_node_id=20 + pid, message_type="train")
            replies.append(Message(RecordDict({
                "arrays": ArrayRecord({"w": models[pid]}),
                "metrics": MetricRecord({"num-examples": 7 + pid, "partition-id": pid})}),
                reply_to=sent))
        adapter = FlowerAdapter(strategies.get("fedavg"), {"w": torch.zeros(500)},
                                lambda *a: None)
        # as StreamingGrid hands them over: one pass, one destination per message sent
        stream = flower_adapter._Replies(iter(replies), {"": 20})
        arrays, _ = adapter.aggregate_train(1, stream)
        return arrays.to_torch_state_dict()["w"]

    orders = list(permutations(range(4)))
    held = [merged(o, 1 << 30) for o in orders]
    assert all(torch.equal(held[0], h) for h in held)
    # above the bound, replies are folded as they arrive: the bits then show the order
    streamed = [merged(o, 0) for o in orders]
    assert not all(torch.equal(streamed[0], s) for s in streamed)
    expected = sum((7 + p) * models[p].double() for p in range(4)) / sum(7 + p for p in range(4))
    assert torch.allclose(held[0].double(), expected, rtol=1e-6, atol=1e-3)


def test_a_round_failure_line_counts_the_nodes_it_does_not_name():
    """Four nodes refused for four different norms: three named, the fourth counted."""
    from fedavg.run.flower_adapter import _RoundTally

    tally = _RoundTally()
    for node, norm in enumerate((1.5, 2.5, 3.5, 4.5)):
        tally.reasons.append((node, f"update norm {norm} exceeds --max-update-norm 0.5"))
    assert tally.detail() == (
        "node 0: update norm 1.5 exceeds --max-update-norm 0.5; node 1: update norm 2.5 "
        "exceeds --max-update-norm 0.5; node 2: update norm 3.5 exceeds --max-update-norm "
        "0.5; and 1 more node")
    tally.reasons += [(4, "timeout"), (5, "timeout")]
    assert tally.detail().endswith("; and 3 more nodes")
    tally.reasons = [(0, "shape"), (1, "shape")]
    assert tally.detail() == "2 nodes: shape"
