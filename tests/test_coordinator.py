"""The coordinator's adapter: Flower replies in, our merge out; malformed updates left out."""

import time

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict

import strategies
from fedavg.flower_compat import error_summary
from fedavg.run.flower_adapter import FlowerAdapter
from fedavg.util.errors import RunError


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
