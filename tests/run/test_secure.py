"""Secure aggregation: Flower's SecAgg+ rounds, run in one process over a loopback grid.

The coordinator side (:class:`fedavg.run.secure.SecureGrid` under
:class:`fedavg.run.flower_adapter.FlowerAdapter`, Flower's ``SecAggPlusWorkflow``) talks to
real ClientApps with Flower's ``secaggplus_mod`` (:func:`fedavg.node.secure.node_mod`); each
node's "training" adds an update the test knows. The grid records every reply the
coordinator receives, so the tests can look for any node's update in it.
"""

import copy
import io
import uuid

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import strategies
from fedavg.config.checks import secagg_workflow
from fedavg.config.settings import RunConfig
from fedavg.node import keys
from fedavg.node.secure import check_limits, node_mod
from fedavg.run.flower_adapter import FlowerAdapter, StreamingGrid
from fedavg.run.secure import SecureGrid
from fedavg.util.errors import UserError

SAMPLES = {1: 300, 2: 500, 3: 200}  # node id -> num-examples


def _reference():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g),
            "steps": torch.tensor(7, dtype=torch.int64)}


def _updates():
    """Each node's update: entries of a few 0.01s, like an SGD round's (and 3 steps)."""
    out = {}
    for node in SAMPLES:
        g = torch.Generator().manual_seed(100 + node)
        out[node] = {"w": 0.02 * torch.randn(40, 30, generator=g),
                     "b": 0.02 * torch.randn(30, generator=g),
                     "steps": torch.tensor(3, dtype=torch.int64)}
    return out


def _client_app(updates):
    app = ClientApp(mods=[node_mod(require=True)])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        received = message.content[keys.ARRAYS].to_torch_state_dict()
        node = message.metadata.dst_node_id
        trained = {k: v + updates[node][k] for k, v in received.items()}
        metrics = MetricRecord({keys.NUM_EXAMPLES: SAMPLES[node], keys.TRAIN_LOSS: 0.5})
        return Message(RecordDict({keys.ARRAYS: ArrayRecord(trained), keys.METRICS: metrics}),
                       reply_to=message)

    return app


class LoopbackGrid:
    """Delivers each message to its node's ClientApp in this process; records the replies.

    ``silent_after``: node id -> how many messages it answers before it goes silent (it
    dropped out: no reply, as a node that left).
    """

    def __init__(self, app, silent_after=None):
        self.app = app
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(),
                                    run_config={}) for n in SAMPLES}
        self.silent_after = silent_after or {}
        self.answered = {n: 0 for n in SAMPLES}
        self.received = []  # every reply the coordinator got
        self._replies = {}

    def get_node_ids(self):
        """Return the nodes still here (a node gone silent has left)."""
        return [n for n in self.contexts
                if self.answered[n] < self.silent_after.get(n, 1 << 30)]

    def push_messages(self, messages):
        """Deliver each message now; keep the replies for :meth:`pull_messages`."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as Flower's grids do
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if self.answered[node] >= self.silent_after.get(node, 1 << 30):
                continue  # gone
            self.answered[node] += 1
            try:  # a copy, as if it came over the network (a stage shares one content)
                reply = self.app(copy.deepcopy(msg), self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - as Flower turns it into an error reply
                reply = Message(Error(0, str(exc)), reply_to=msg)
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, ids):
        """Return (and record) the replies to ``ids`` that are in."""
        out = [self._replies.pop(i) for i in list(ids) if i in self._replies]
        self.received += out
        return out


def _run_round(grid, dp=None, **merge):
    reference = _reference()
    left_out = []
    adapter = FlowerAdapter(strategies.get("fedavg"), reference,
                            lambda r, node, why: left_out.append((node, why)),
                            fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3,
                            min_evaluate_nodes=0, dp=dp)
    config = RunConfig.from_flat({"secure-aggregation": True, "num-nodes": 3, **merge})
    streaming = StreamingGrid(grid, poll_s=0.01, node_check_s=0.0,
                              on_lost=lambda node: left_out.append((node, "lost")))
    secure = SecureGrid(streaming, secagg_workflow(config.merge))
    merged = {}

    def keep(server_round, arrays):
        merged[server_round] = arrays.to_torch_state_dict()

    adapter.start(grid=secure, initial_arrays=ArrayRecord(reference), num_rounds=1,
                  timeout=30, evaluate_fn=keep)
    return reference, merged[1], adapter, left_out


def _expected(reference, updates, nodes):
    total = sum(SAMPLES[n] for n in nodes)
    return {k: reference[k].double() + sum(SAMPLES[n] * updates[n][k].double()
                                           for n in nodes) / total for k in ("w", "b")}


def _numbers_in(msg):
    """Every array and every byte string of numbers in a reply, as float64 vectors."""
    found = []
    for record in msg.content.array_records.values():
        found += [np.asarray(a.numpy(), dtype=np.float64).ravel() for a in record.values()]
    for record in msg.content.config_records.values():
        for value in record.values():
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, bytes):
                    try:
                        found.append(np.load(io.BytesIO(v)).astype(np.float64)
                                     .ravel())
                    except (ValueError, OSError, EOFError):
                        pass  # a key or a share, not an array
    return found


def test_the_coordinator_gets_the_weighted_mean_and_never_one_nodes_update(task_identity):
    updates = _updates()
    grid = LoopbackGrid(_client_app(updates))
    reference, merged, adapter, left_out = _run_round(grid)

    # the merge is the sample-weighted mean, to Flower's quantisation step (16 / 2**22 / r)
    expected = _expected(reference, updates, SAMPLES)
    for k in ("w", "b"):
        assert torch.allclose(merged[k].double(), expected[k], atol=1e-4), k
        assert not torch.allclose(merged[k].double(), expected[k], atol=1e-9)  # quantised
    assert merged["steps"].item() == 10 and merged["steps"].dtype == torch.int64
    assert left_out == [] and adapter.last_train["num_nodes"] == 3
    assert adapter.last_merged.num_models == 3

    # what the coordinator received: no array in clear, masked vectors unlike any update
    assert grid.received and not any(msg.has_error() for msg in grid.received)
    assert all(len(r) == 0 for msg in grid.received for r in msg.content.array_records.values())
    vectors = [v for msg in grid.received for v in _numbers_in(msg)]
    masked = [v for v in vectors if v.size == 40 * 30]
    assert len(masked) == 3  # one masked weight matrix per node, nothing else of that size
    for v in masked:
        assert v.max() > 2**31  # spread over the mask's modulus, far beyond 3 x 2**22
        for node, upd in updates.items():
            for k in ("w", "b"):
                u = upd[k].double().ravel().numpy()
                if u.size == v.size:
                    assert abs(np.corrcoef(v, u)[0, 1]) < 0.2, node
                    assert not np.allclose(v, u, atol=1e-3)


def test_a_node_that_drops_out_mid_protocol_leaves_the_others_mean(task_identity):
    """Node 3 shares its keys, then goes silent: SecAgg+ unmasks the mean of nodes 1 and 2."""
    updates = _updates()
    grid = LoopbackGrid(_client_app(updates), silent_after={3: 2})
    reference, merged, adapter, left_out = _run_round(grid)

    expected = _expected(reference, updates, (1, 2))
    for k in ("w", "b"):
        assert torch.allclose(merged[k].double(), expected[k], atol=1e-4), k
    assert left_out == [(3, "node disconnected during the round")]  # reported once
    assert adapter.last_train["num_nodes"] == 2 and adapter.last_train["num_failed"] == 1


def test_a_node_that_leaves_right_after_setup_restarts_the_round_without_it(task_identity):
    """Node 3 answers setup only: the round runs again with nodes 1 and 2.

    Flower's workflow halts there (no one holds a share of node 3's key).
    """
    updates = _updates()
    grid = LoopbackGrid(_client_app(updates), silent_after={3: 1})
    reference, merged, adapter, left_out = _run_round(grid)

    expected = _expected(reference, updates, (1, 2))
    for k in ("w", "b"):
        assert torch.allclose(merged[k].double(), expected[k], atol=1e-4), k
    assert left_out == [(3, "node disconnected during the round")]
    assert adapter.last_train["num_nodes"] == 2


def test_a_round_fails_in_one_line_when_too_few_nodes_stay(task_identity):
    grid = LoopbackGrid(_client_app(_updates()), silent_after={2: 2, 3: 2})
    with pytest.raises(Exception, match="secure aggregation halted"):
        _run_round(grid)


def test_a_node_that_requires_secure_aggregation_refuses_a_plain_round(task_identity):
    app = _client_app(_updates())
    msg = Message(RecordDict({keys.ARRAYS: ArrayRecord(_reference())}), dst_node_id=1,
                  message_type="train")
    msg.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(Exception, match="only under secure aggregation"):
        app(msg, context)


def test_a_node_refuses_what_flowers_quantisation_would_clip():
    check_limits([np.full(3, 0.5)], 100, 1000.0, 8.0)  # 0.05 of 8: fine
    with pytest.raises(ValueError, match="--secagg-max-weight"):
        check_limits([np.zeros(3)], 1001, 1000.0, 8.0)
    with pytest.raises(ValueError, match="--secagg-clipping-range"):
        check_limits([np.array([0.0, -20.0])], 500, 1000.0, 8.0)


@pytest.mark.parametrize("flat, says", [
    ({"strategy": "scaffold"}, "scaffold's merge needs more"),
    ({"strategy": "fedmedian"}, "use one of average, diloco"),
    ({"strategy": "uniform-soup", "rounds": 1}, "uniform-soup's merge"),
    ({"dp-noise": 1.0, "dp-clip": 1.0}, "--dp-noise with --secure-aggregation"),
    ({"max-update-norm": 5.0}, "--max-update-norm with"),
    ({"save-node-models": True}, "--save-node-models with"),
    ({"compress": "int8"}, "--compress with"),
    ({"compress-down": "int8"}, "--compress-down with"),
    ({"num-nodes": 1}, "at least 2 nodes per round"),
    ({"secagg-num-shares": 2}, "--secagg-num-shares as an integer must be greater than 2"),
    ({"secagg-num-shares": 3.5}, "--secagg-num-shares above 1 is a count"),
    ({"secagg-reconstruction-threshold": 3}, "must be less than --secagg-num-shares"),
    ({"secagg-max-weight": 0}, "--secagg-max-weight must be > 0"),
])
def test_what_secure_aggregation_refuses_is_said_in_one_line(flat, says):
    with pytest.raises(UserError, match=says.replace("+", r"\+")) as exc:
        RunConfig.from_flat({"secure-aggregation": True, **flat}).validate()
    assert "\n" not in str(exc.value)


def test_strategies_that_need_only_the_weighted_mean_take_it():
    secure = sorted(n for n, k in strategies.available().items() if k.secure_sum)
    assert {"fedavg", "fedprox", "fedavgm", "fedadam", "diloco"} <= set(secure)
    assert not {"scaffold", "fednova", "uniform-soup", "krum", "ties"} & set(secure)
    for name in ("fedavg", "fedavgm", "fedadam", "diloco"):
        RunConfig.from_flat({"secure-aggregation": True, "strategy": name}).validate()


def test_node_level_dp_clipped_on_the_nodes_merges_their_clipped_mean_weighing_each_one(
        task_identity):
    """--dp-clip-on node under SecAgg+: each node clips its own update and weighs 1.

    The updates' norms are about 0.7; clipped to 0.35 each is about halved. The merge is
    ``w + sum_k clip(u_k) / 3`` whatever the nodes' samples (300, 500, 200), plus the
    round's noise (here z = 1e-6, far below the figures checked), to SecAgg+'s step at a
    weight of 1 (``--secagg-max-weight`` taken as 1: 16 / 2**22).
    """
    from fedavg.node.clientapp import clipped_on_node
    from fedavg.run.privacy import NodeLevelDP

    updates = _updates()
    app = ClientApp(mods=[node_mod(require=True)])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        received = message.content[keys.ARRAYS].to_torch_state_dict()
        trained = {k: v + updates[message.metadata.dst_node_id][k] for k, v in received.items()}
        metrics = MetricRecord({keys.NUM_EXAMPLES: 1, keys.TRAIN_LOSS: 0.5})
        return Message(RecordDict({keys.ARRAYS: ArrayRecord(clipped_on_node(
            trained, received, 0.35)), keys.METRICS: metrics}), reply_to=message)

    dp = NodeLevelDP(clip=0.35, noise=1e-6, num_nodes=3, sampled=False, delta=1e-5,
                     clip_on="node")
    reference, merged, adapter, left_out = _run_round(
        LoopbackGrid(app), dp=dp, **{"dp-noise": 1e-6, "dp-clip": 0.35, "dp-clip-on": "node"})
    clipped = {n: strategies.clip_update({k: reference[k] + u[k] for k in u}, reference,
                                         0.35)[0] for n, u in updates.items()}
    for k in ("w", "b"):
        expected = sum(clipped[n][k].double() for n in SAMPLES) / 3
        assert torch.allclose(merged[k].double(), expected, atol=1e-4), k
        weighted = _expected(reference, updates, SAMPLES)[k]
        assert not torch.allclose(merged[k].double(), weighted, atol=1e-3)  # not by samples
    assert merged["steps"].item() == 7  # an integer buffer keeps the round's value
    assert left_out == [] and adapter.last_train["epsilon"] > 0
