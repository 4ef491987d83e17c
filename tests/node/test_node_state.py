"""Methods whose nodes keep state: the wire, Flower's per-node context, and checkpoints."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

import strategies
from fedavg.config.settings import RunConfig
from fedavg.models.registry import build_model
from fedavg.node import keys
from fedavg.node.clientapp import node_state, node_state_records, run_train
from fedavg.node.wire import TrainSettings
from fedavg.run import resume
from fedavg.run.flower_adapter import FlowerAdapter
from strategies.scaffold import SERVER_VARIATE, VARIATE_CHANGE

SPEC = {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 3, "args": {}}
INPUT = {"kind": "image", "shape": [1, 8, 8], "mean": [0.0], "std": [1.0], "scale": 1.0}


def settings(strategy, round_):
    s = TrainSettings.for_run(RunConfig().replace(strategy=strategy, local_epochs=1,
                                                  batch_size=4, lr=0.05),
                              {"model": SPEC, "input": INPUT, "classes": ["a", "b", "c"]},
                              strategies.get(strategy))
    record = s.to_record()
    record[keys.SERVER_ROUND] = round_
    return record


def message(strategy, round_, extras=lambda model: {}):
    model = build_model("mlp", (1, 8, 8), 3)
    extras = extras(model)
    content = RecordDict({keys.ARRAYS: ArrayRecord(model.state_dict()),
                          keys.CONFIG: settings(strategy, round_)})
    for key, sd in dict(extras).items():
        content[key] = ArrayRecord(sd)
    return Message(content=content, dst_node_id=1, message_type="train"), model


def data():
    g = np.random.default_rng(0)
    return g.random((12, 1, 8, 8), dtype=np.float32), g.integers(0, 3, 12).astype(np.int64)


def test_settings_name_the_method_and_its_options():
    got = TrainSettings.from_record(settings("moon", 1))
    assert got.method == "moon" and got.method_options == {"moon_mu": 5.0, "temperature": 0.5}
    plain = TrainSettings.from_record(settings("fedavg", 1))
    assert plain.method == "" and plain.method_options == {}


def test_scaffold_node_keeps_its_variate_in_the_context_between_rounds(task_identity):
    x, y = data()
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    msg, model = message("scaffold", 1, lambda m: {SERVER_VARIATE: {
        k: torch.zeros_like(v) for k, v in m.named_parameters()}})
    reply = run_train(msg, x, y, "cpu", 0, context=context)
    change = reply.content.array_records[VARIATE_CHANGE].to_torch_state_dict()
    kept = node_state(context.state, "scaffold")
    assert set(kept) == {k for k, _ in model.named_parameters()}
    for k in kept:  # c_i was 0: its change is the new c_i
        assert torch.allclose(change[k], kept[k])
    assert context.state.config_records[keys.NODE_STATE_INFO]["round"] == 1
    assert node_state(context.state, "feddyn") is None  # another method's state is not used

    msg2, _ = message("scaffold", 2, lambda m: {SERVER_VARIATE: {
        k: torch.zeros_like(v) for k, v in kept.items()}})
    reply2 = run_train(msg2, x, y, "cpu", 0, context=context)
    change2 = reply2.content.array_records[VARIATE_CHANGE].to_torch_state_dict()
    assert reply.content.metric_records[keys.METRICS][keys.STATE_ROUND] == 0
    assert reply2.content.metric_records[keys.METRICS][keys.STATE_ROUND] == 1
    kept2 = node_state(context.state, "scaffold")
    for k in kept:  # the second round started from the kept c_i
        assert torch.allclose(kept2[k], kept[k] + change2[k], atol=1e-6)


def test_a_round_without_the_server_variate_is_an_error_reply(task_identity):
    x, y = data()
    msg, _ = message("scaffold", 1)
    with pytest.raises(strategies.MergeError, match="scaffold-c"):
        run_train(msg, x, y, "cpu", 0)


def test_fednova_reply_carries_its_factor(task_identity):
    x, y = data()
    msg, _ = message("fednova", 1)
    metrics = run_train(msg, x, y, "cpu", 0).content.metric_records[keys.METRICS]
    # 3 steps of 4 samples, constant rate, momentum 0.9: [3 - 0.9 (1 - 0.729) / 0.1] / 0.1
    assert metrics["fednova-a"] == pytest.approx((3 - 0.9 * (1 - 0.9 ** 3) / 0.1) / 0.1)


def test_adapter_sends_the_variate_and_hands_the_reply_extras_to_the_merge(task_identity):
    seen = []

    class Spy(strategies.strategy_class("scaffold")):
        def add_reply(self, sd, weight, node="?", *, arrays=None, metrics=None):
            seen.append((sorted(arrays), metrics.get("num-examples")))
            super().add_reply(sd, weight, node, arrays=arrays, metrics=metrics)

    ref = {"w": torch.zeros(2)}
    adapter = FlowerAdapter(Spy(), ref, lambda *a: None, fraction_train=1.0,
                            min_available_nodes=1, min_train_nodes=1)
    adapter.context = strategies.MergeContext(build_model=lambda: None, normalize=lambda x: x)

    class Grid:
        def get_node_ids(self):
            return [5, 6]

        def create_message(self, content, message_type, dst_node_id, group_id):
            return Message(content=content, dst_node_id=dst_node_id, message_type=message_type)

    out = list(adapter.configure_train(1, ArrayRecord(ref), ConfigRecord(), Grid()))
    assert len(out) == 2 and all(SERVER_VARIATE in m.content.array_records for m in out)
    assert adapter.context.num_nodes == 2
    content = RecordDict({keys.ARRAYS: ArrayRecord({"w": torch.ones(2)}),
                          VARIATE_CHANGE: ArrayRecord({"w": torch.ones(2)}),
                          keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 3})})
    merged, _ = adapter.aggregate_train(1, [Message(content, reply_to=out[0])])
    assert seen == [([VARIATE_CHANGE], 3)]
    assert torch.equal(merged.to_torch_state_dict()["w"], torch.ones(2))


def test_node_states_go_through_the_checkpoint(tmp_path):
    strategy = strategies.get("scaffold")
    model = {"w": torch.zeros(2)}
    strategy.to_nodes(model)
    states = {0: {"w": torch.tensor([1.0, 2.0])}, 7: {"w": torch.tensor([3.0, 4.0])}}
    ckpt = resume.capture(1, model, RunConfig().replace(strategy="scaffold", rounds=3),
                          strategy, [{"round": 1, "accuracy": 0.5, "loss": 1.0, "train_loss": 1.2,
                            "num_nodes": 2, "num_failed": 0, "wall_s": 0.1, "train_s": 0.05}], [],
                          node_states=states)
    resume.save(tmp_path, ckpt)
    back = resume.load(tmp_path)
    assert sorted(back.node_states) == [0, 7]
    assert torch.equal(back.node_states[7]["w"], torch.tensor([3.0, 4.0]))
    records = node_state_records("scaffold", back.node_states[0], back.round)
    kept = RecordDict(records)
    assert torch.equal(node_state(kept, "scaffold")["w"], torch.tensor([1.0, 2.0]))


def test_scaffold_folds_a_round_in_partition_order_whatever_the_arrival(task_identity):
    order = []

    class Spy(strategies.strategy_class("scaffold")):
        def add_reply(self, sd, weight, node="?", *, arrays=None, metrics=None):
            order.append(metrics[keys.PARTITION_ID])
            super().add_reply(sd, weight, node, arrays=arrays, metrics=metrics)

    ref = {"w": torch.zeros(2)}
    adapter = FlowerAdapter(Spy(), ref, lambda *a: None)
    sent = Message(content=RecordDict(), dst_node_id=1, message_type="train")

    def reply(pid):
        return Message(RecordDict({
            keys.ARRAYS: ArrayRecord({"w": torch.full((2,), float(pid))}),
            VARIATE_CHANGE: ArrayRecord({"w": torch.ones(2)}),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 1, keys.PARTITION_ID: pid})}),
            reply_to=sent)

    adapter.merge.to_nodes(ref)
    adapter.aggregate_train(1, iter([reply(p) for p in (2, 0, 1)]))
    assert order == [0, 1, 2]


def test_sys_exit_in_model_code_is_the_nodes_error_reply_not_its_end(monkeypatch,
                                                                     task_identity):
    """It ended the node's Ray actor: the run said ActorDiedError, with no word of the code."""
    import sys

    import fedavg.node.clientapp

    class Exits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build_model("mlp", (1, 8, 8), 3)

        def forward(self, x):
            sys.exit(3)

    monkeypatch.setattr(fedavg.node.clientapp, "_model_for", lambda spec: Exits())
    x, y = data()
    msg, _ = message("fedavg", 1, lambda m: {})
    msg.content[keys.ARRAYS] = ArrayRecord(Exits().state_dict())
    with pytest.raises(RuntimeError, match=r"^the model's code called sys.exit\(3\)$"):
        run_train(msg, x, y, "cpu", 0)
