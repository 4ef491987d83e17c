"""The coordinator's adapter: Flower replies in, our merge out; bad updates left out.

Bad updates from nodes: the update-norm bound, non-finite merges, malformed and random
replies.
"""

import json
import math
import re
import shlex
import time

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies
from fedavg.flower_compat import error_summary
from fedavg.run.flower_adapter import FlowerAdapter
from fedavg.util.errors import RunError
from strategies.fedavg import FedAvg


def reply(node, content):
    sent = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    return Message(content, reply_to=sent)


def good(node, w, n, loss=1.0):
    return reply(node, RecordDict({
        "arrays": ArrayRecord({"w": torch.tensor(w), "n": torch.tensor(5)}),
        "metrics": MetricRecord({"num-examples": n, "train-loss": loss}),
    }))


def adapter(failures):
    ref = {"w": torch.zeros(2), "n": torch.tensor(0)}
    return FlowerAdapter(strategies.get("fedavg"), ref,
                         lambda r, node, reason: failures.append((r, node, reason)))


def test_malformed_updates_are_left_out_and_reported(task_identity):
    failures = []
    a = adapter(failures)
    replies = [
        good(11, [1.0, 1.0], 1, loss=2.0),
        good(12, [3.0, 5.0], 3, loss=1.0),
        reply(13, Error(code=0, reason="RuntimeError: CUDA out of memory")),
        reply(14, RecordDict({"arrays": ArrayRecord({"w": torch.zeros(2), "n": torch.tensor(1)}),
                              "metrics": MetricRecord({"other": 1})})),
        reply(15, RecordDict({"arrays": ArrayRecord({"w": torch.zeros(3), "n": torch.tensor(1)}),
                              "metrics": MetricRecord({"num-examples": 10})})),
        reply(16, RecordDict({"arrays": ArrayRecord({"w": torch.tensor([float("nan"), 0.0]),
                                                     "n": torch.tensor(1)}),
                              "metrics": MetricRecord({"num-examples": 10})})),
        reply(17, RecordDict({"metrics": MetricRecord({"num-examples": 10})})),
    ]
    arrays, metrics = a.aggregate_train(4, replies)
    merged = arrays.to_torch_state_dict()
    # only nodes 11 and 12: (1*1 + 3*3)/4 = 2.5 ; (1*1 + 3*5)/4 = 4.0
    assert torch.allclose(merged["w"], torch.tensor([2.5, 4.0]))
    assert merged["n"].item() == 5 and merged["n"].dtype == torch.int64
    assert a.last_train["num_nodes"] == 2 and a.last_train["num_failed"] == 5
    assert a.last_train["train_loss"] == pytest.approx((2.0 * 1 + 1.0 * 3) / 4)
    assert metrics["num-nodes"] == 2
    reasons = {node: reason for _, node, reason in failures}
    assert set(reasons) == {13, 14, 15, 16, 17}
    assert all(r == 4 for r, _, _ in failures)
    assert "CUDA out of memory" in reasons[13]
    assert "num-examples" in reasons[14]
    assert "shape" in reasons[15]
    assert "NaN" in reasons[16]
    assert "arrays" in reasons[17]


def test_round_without_usable_model_raises_with_reasons(task_identity):
    failures = []
    with pytest.raises(RunError, match="round 2: no usable model.*node 21.*diverged"):
        adapter(failures).aggregate_train(
            2, [reply(21, Error(code=0, reason="FloatingPointError: diverged"))])
    with pytest.raises(RunError, match="no replies before --round-timeout"):
        adapter(failures).aggregate_train(3, [])


def test_nodes_diverging_after_a_server_step_are_told_to_lower_the_server_lr(task_identity):
    ref = {"w": torch.zeros(2), "n": torch.tensor(0)}
    for name, round_, told in (("fedavgm", 2, True), ("fedavgm", 1, False),
                               ("fedavg", 2, False)):
        a = FlowerAdapter(strategies.get(name), ref, lambda *args: None)
        with pytest.raises(RunError) as exc:
            a.aggregate_train(round_, [reply(21, Error(
                code=0, reason="FloatingPointError: training diverged (loss nan); lower --lr"))])
        assert ("the nodes started from the model fedavgm stepped to, so lower --server-lr "
                "too" in str(exc.value)) is told, str(exc.value)


def test_error_summary_finds_the_original_exception():
    wrapped = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::"
        "ClientAppActor.run()\x1b[39m (pid=1)\n  File \"train.py\", line 9, in train\n"
        "    raise FloatingPointError('x')\nFloatingPointError: training diverged (loss nan)\n\n"
        "The above exception was the direct cause of the following exception:\n"
        "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException "
        "occurred. Message: training diverged (loss nan)'>"
    )
    assert error_summary(wrapped) == "FloatingPointError: training diverged (loss nan)"
    assert error_summary("Exception occurred. Message: disk full'>") == "disk full"
    assert error_summary("") == "unknown error"
    # a first line that announces the next: both (a node's model of another architecture)
    mismatch = ("Traceback (most recent call last):\n  File \"node.py\", line 111\n"
                "RuntimeError: Error(s) in loading state_dict for Sequential:\n"
                "\tsize mismatch for 1.weight: copying a param with shape torch.Size([32, 64])"
                "\n")
    assert error_summary(mismatch) == ("RuntimeError: Error(s) in loading state_dict for "
                                       "Sequential: size mismatch for 1.weight: copying a param "
                                       "with shape torch.Size([32, 64])")


def test_first_line_keeps_a_line_the_first_announces():
    from fedavg.util.errors import first_line

    assert first_line(RuntimeError("Error(s) in loading:\n\tsize mismatch\nmore")) == \
        "Error(s) in loading: size mismatch"
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(KeyError()) == "KeyError"


class _FakeGrid:
    """Replies become available one per pull; records how often it was pulled."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.pulls = 0

    def push_messages(self, messages):
        return [f"id{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        return [self.replies.pop(0)] if self.replies else []

    def get_node_ids(self):
        return [1, 2, 3]


class _Reply:
    def __init__(self, i):
        self.metadata = type("M", (), {"reply_to_message_id": f"id{i}"})()


def _sent(*nodes):
    """Stand-ins for the messages of a round, one per destination node."""
    return [type("S", (), {"metadata": type("M", (), {"dst_node_id": n})()})() for n in nodes]


def test_streaming_grid_yields_replies_as_they_arrive():
    from fedavg.run.flower_adapter import StreamingGrid

    fake = _FakeGrid([_Reply(i) for i in range(3)])
    grid = StreamingGrid(fake, poll_s=0.0)
    assert grid.get_node_ids() == [1, 2, 3]  # everything else is delegated
    replies = grid.send_and_receive(_sent(1, 2, 3), timeout=10)
    assert fake.pulls == 0  # nothing pulled until the merge asks for a reply
    first = next(iter(replies))
    assert first.metadata.reply_to_message_id == "id0" and fake.pulls == 1
    assert [r.metadata.reply_to_message_id for r in replies] == ["id1", "id2"]
    assert fake.pulls == 3


def test_streaming_grid_stops_at_the_timeout():
    from fedavg.run.flower_adapter import StreamingGrid

    grid = StreamingGrid(_FakeGrid([]), poll_s=0.01)
    start = time.monotonic()
    assert list(grid.send_and_receive(_sent(1), timeout=0.2)) == []
    assert 0.2 <= time.monotonic() - start < 2


def test_streaming_grid_stops_waiting_for_a_node_that_left():
    from fedavg.run.flower_adapter import StreamingGrid

    class Shrinking(_FakeGrid):
        def get_node_ids(self):  # node 2 disconnects after the first reply
            return [1, 3] if self.pulls >= 1 else [1, 2, 3]

    lost = []
    fake = Shrinking([_Reply(0), _Reply(2)])
    grid = StreamingGrid(fake, poll_s=0.01, on_lost=lost.append, node_check_s=0.0)
    start = time.monotonic()
    replies = grid.send_and_receive(_sent(1, 2, 3), timeout=30)
    assert replies.destination == {"id0": 1, "id1": 2, "id2": 3}
    assert [r.metadata.reply_to_message_id for r in replies] == ["id0", "id2"]
    assert lost == [2]  # reported once, and the round did not wait for the timeout
    assert time.monotonic() - start < 5


def test_nodes_silent_at_the_timeout_are_counted_and_reported_once(task_identity):
    """A node that never replied is a failure naming --round-timeout; one that left is not.

    The one that left was reported when it left.
    """
    from fedavg.run.flower_adapter import _Replies

    failures = []
    a = adapter(failures)
    answer = good(11, [2.0, 4.0], 3)
    mid = answer.metadata.reply_to_message_id
    replies = _Replies(iter([answer]), {mid: 11, "silent": 12, "gone": 13}, lost={"gone"},
                       timeout=600.0)
    arrays, _ = a.aggregate_train(1, replies)
    assert torch.allclose(arrays.to_torch_state_dict()["w"], torch.tensor([2.0, 4.0]))
    assert a.last_train["num_nodes"] == 1 and a.last_train["num_failed"] == 1
    assert [(r, node) for r, node, _ in failures] == [(1, 12)]
    assert "no reply within --round-timeout 600 s" in failures[0][2]
    # no node replied at all: the error names the timeout, not an empty reason
    with pytest.raises(RunError, match=r"any node \(node 12: no reply within --round-timeout 5 s"):
        adapter([]).aggregate_train(2, _Replies(iter([]), {"silent": 12}, timeout=5.0))
    with pytest.raises(RunError, match=r"any node \(2 nodes: no reply within --round-timeout 5 s"
                                       r"[^;]*\)$"):
        adapter([]).aggregate_train(2, _Replies(iter([]), {"a": 12, "b": 13}, timeout=5.0))


def update_reply(node, arrays, n=10):
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
    replies = [update_reply(11, {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(1)}),
               update_reply(12, {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(1)}),  # norm 5
               update_reply(13, {"w": torch.tensor([-3.0, 1.0]), "n": torch.tensor(1)}, n=30)]
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
    arrays, _ = a.aggregate_train(3, [update_reply(11, {"w": torch.tensor([10.5, 10.0]),
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
        a.aggregate_train(5, [update_reply(11, {"w": torch.tensor([1.0, 0.0]),
                                                "n": torch.tensor(0)})])


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
    replies = [update_reply(10 + i, sd, n=w) for i, (sd, w) in enumerate(updates)]
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
    from helpers.cli import run_cli

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


def test_node_level_dp_weighs_each_node_1_clips_and_counts_the_silent_as_zero(task_identity):
    """DP-FedAvg in the adapter: sample counts 10 and 1,000 play no part.

    3 nodes sampled, 2 reply: u = (3, 4) clips to (0.6, 0.8), (0.3, 0.4) stays, the silent
    third counts as 0: the mean is (0.3, 0.4) (noise far below the figures checked).
    """
    from fedavg.run.privacy import NodeLevelDP

    dp = NodeLevelDP(clip=1.0, noise=1e-9, num_nodes=3, sampled=False, delta=1e-5)
    a = make_adapter([], dp=dp)
    dp.begin_round(3)  # as configure_train does with the round's 3 messages
    arrays, _ = a.aggregate_train(1, [
        update_reply(11, {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(9)}, n=10),
        update_reply(12, {"w": torch.tensor([0.3, 0.4]), "n": torch.tensor(9)}, n=1000)])
    merged = arrays.to_torch_state_dict()
    assert merged["w"].tolist() == pytest.approx([0.3, 0.4], abs=1e-6)
    assert merged["n"].item() == 0  # integer buffers keep the round's values
    assert a.last_train["epsilon"] == pytest.approx(dp.epsilon) and dp.releases == 1


def test_a_malformed_reply_under_node_level_dp_is_left_out_not_a_crash(task_identity):
    from fedavg.run.privacy import NodeLevelDP

    failures = []
    dp = NodeLevelDP(clip=1.0, noise=1e-9, num_nodes=2, sampled=False, delta=1e-5)
    a = make_adapter(failures, dp=dp)
    dp.begin_round(2)
    arrays, _ = a.aggregate_train(1, [
        update_reply(11, {"w": torch.tensor([0.3, 0.4])}),  # lacks "n"
        update_reply(12, {"w": torch.tensor([0.3, 0.4]), "n": torch.tensor(0)})])
    assert [f[1] for f in failures] == [11] and "n" in failures[0][2]
    # the left-out node counts as a zero update: (0.3, 0.4) / 2
    assert arrays.to_torch_state_dict()["w"].tolist() == pytest.approx([0.15, 0.2], abs=1e-6)
