"""Compressed node updates: codecs against hand-computed values, error feedback, the wire."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

import strategies
from fedavg.config.settings import RunConfig
from fedavg.models.registry import build_model
from fedavg.node import compression, keys
from fedavg.node.clientapp import node_records, run_train, saved_node_state
from fedavg.node.compression import (
    BLOCK,
    MIN_NUMEL,
    compress_update,
    decode,
    decode_reply,
    encode,
)
from fedavg.node.wire import TrainSettings

X = torch.tensor([1.0, -0.5, 0.25, 0.0])


def test_int8_by_hand():
    # scale 1/127: x/s = 127, -63.5, 31.75, 0 -> 127, -64 (half to even), 32, 0
    parts = encode(X, "int8")
    assert parts["q8"][:4].tolist() == [127, -64, 32, 0] and parts["q8"].numel() == BLOCK
    assert parts["s"].tolist() == pytest.approx([1 / 127])
    assert decode(parts, X).tolist() == pytest.approx([1.0, -64 / 127, 32 / 127, 0.0])


def test_int4_by_hand():
    # scale 7/7 = 1: x/s = 7, -3, 1.5, -0.4 -> 7, -3, 2 (half to even), 0; two values a byte
    x = torch.tensor([7.0, -3.0, 1.5, -0.4])
    parts = encode(x, "int4")
    assert parts["q4"].dtype == torch.uint8 and parts["q4"].numel() == BLOCK // 2
    assert parts["q4"][:2].tolist() == [(7 + 8) | (-3 + 8) << 4, (2 + 8) | (0 + 8) << 4]
    assert parts["s"].tolist() == [1.0]
    assert decode(parts, x).tolist() == [7.0, -3.0, 2.0, 0.0]


def test_topk_by_hand():
    x = torch.tensor([0.1, -3.0, 2.0, 0.5])
    parts = encode(x, "topk", fraction=0.5)  # ceil(0.5 * 4) = 2 entries
    assert parts["i"].tolist() == [1, 2] and parts["v"].tolist() == [-3.0, 2.0]
    assert decode(parts, x).tolist() == [0.0, -3.0, 2.0, 0.0]


def test_bytes_per_codec():
    x = torch.randn(64, 256)  # 16 blocks
    size = {c: sum(p.numel() * p.element_size() for p in encode(x, c, 0.01).values())
            for c in ("int8", "int4", "topk")}
    full = x.numel() * 4
    assert size["int8"] == x.numel() + 16 * 4  # 25.1 % of float32
    assert size["int4"] == x.numel() // 2 + 16 * 4
    assert size["topk"] == 164 * 8  # ceil(0.01 * 16384) = 164 entries, index + value
    assert size["int8"] / full < 0.26 and size["topk"] / full < 0.021


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.floats(1e-6, 1e3), st.integers(0, 2**31 - 1))
def test_quantisation_error_is_at_most_half_a_step(n, magnitude, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * magnitude
    blocks = torch.nn.functional.pad(x, (0, (-n) % BLOCK)).reshape(-1, BLOCK)
    step = (blocks.abs().amax(dim=1) / 127).repeat_interleave(BLOCK)[:n]
    error = (decode(encode(x, "int8"), x) - x).abs()
    assert bool((error <= step / 2 * (1 + 1e-5) + 1e-12).all())
    step4 = (blocks.abs().amax(dim=1) / 7).repeat_interleave(BLOCK)[:n]
    error4 = (decode(encode(x, "int4"), x) - x).abs()
    assert bool((error4 <= step4 / 2 * (1 + 1e-5) + 1e-12).all())


def test_small_and_integer_tensors_travel_as_they_are():
    received = {"w": torch.zeros(40, 40), "b": torch.zeros(40), "n": torch.tensor(3),
                "w2": torch.zeros(MIN_NUMEL)}
    state = {"w": torch.ones(40, 40), "b": torch.ones(40), "n": torch.tensor(5),
             "w2": torch.ones(MIN_NUMEL), "new": torch.ones(2000)}
    sent, left = compress_update(state, received, "int8")
    assert set(sent) == {"w#q8", "w#s", "w2#q8", "w2#s", "b", "n", "new"}
    assert set(left) == {"w", "w2"}
    back = decode_reply(sent, received)
    assert set(back) == set(state)
    for key in state:
        assert torch.allclose(back[key], state[key].to(back[key].dtype)), key


def test_error_feedback_carries_what_was_left_out():
    g = torch.Generator().manual_seed(0)
    received = {"w": torch.zeros(4096)}
    u1, u2 = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    sent1, left1 = compress_update({"w": u1}, received, "topk", 0.01)
    sent2, left2 = compress_update({"w": u2}, received, "topk", 0.01, residual=left1)
    got = decode_reply(sent1, received)["w"] + decode_reply(sent2, received)["w"]
    # nothing lost, only delayed: what arrived plus what is still held is every update
    assert torch.allclose(got + left2["w"], u1 + u2, atol=1e-5)
    assert left1["w"].abs().sum() > 0 and (left2["w"] != 0).sum() < 4096
    without, _ = compress_update({"w": u2}, received, "topk", 0.01)
    assert not torch.equal(decode_reply(without, received)["w"],
                           decode_reply(sent2, received)["w"])


@pytest.mark.parametrize("arrays,message", [
    ({"w#q8": torch.zeros(10, dtype=torch.int8), "w#s": torch.ones(1)}, "1024 entries"),
    ({"w#q8": torch.zeros(BLOCK, dtype=torch.int8)}, "lacks its 's' part"),
    ({"w#q8": torch.zeros(BLOCK), "w#s": torch.ones(1)}, "not torch.int8"),
    ({"w#i": torch.tensor([BLOCK], dtype=torch.int32), "w#v": torch.ones(1)}, "indices outside"),
    ({"w#i": torch.tensor([1], dtype=torch.int32), "w#v": torch.ones(2)}, "of 1 entries"),
    ({"w#zz": torch.ones(1)}, "unknown parts"),
    ({"x#q8": torch.zeros(BLOCK, dtype=torch.int8), "x#s": torch.ones(1)}, "did not send"),
    ({"w#q8": torch.zeros(BLOCK, dtype=torch.int8), "w#s": torch.tensor([float("nan")])},
     "non-finite"),
])
def test_a_malformed_update_is_refused(arrays, message):
    with pytest.raises(ValueError, match=message):
        decode_reply(arrays, {"w": torch.zeros(BLOCK)})


SPEC = {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 3, "args": {}}
INPUT = {"kind": "image", "shape": [1, 8, 8], "mean": [0.0], "std": [1.0], "scale": 1.0}


def _message(model, round_, **options):
    s = TrainSettings.for_run(RunConfig().replace(local_epochs=1, batch_size=4, lr=0.05,
                                                  **options),
                              {"model": SPEC, "input": INPUT, "classes": ["a", "b", "c"]},
                              strategies.get("fedavg"))
    record = s.to_record()
    record[keys.SERVER_ROUND] = round_
    content = RecordDict({keys.ARRAYS: ArrayRecord(model.state_dict()), keys.CONFIG: record})
    return Message(content=content, dst_node_id=1, message_type="train")


def test_a_node_sends_its_update_encoded_and_keeps_the_rest(task_identity):
    g = np.random.default_rng(0)
    x, y = g.random((12, 1, 8, 8), dtype=np.float32), g.integers(0, 3, 12).astype(np.int64)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    model = build_model("mlp", (1, 8, 8), 3)
    start = model.state_dict()
    reply = run_train(_message(model, 1, compress="int8"), x, y, "cpu", 0, context=context)
    arrays = reply.content.array_records[keys.ARRAYS].to_torch_state_dict()
    assert any(k.endswith("#q8") for k in arrays)
    plain = run_train(_message(model, 1), x, y, "cpu", 0)  # the same training, uncompressed
    trained = plain.content.array_records[keys.ARRAYS].to_torch_state_dict()
    rebuilt = decode_reply(arrays, start)
    assert set(rebuilt) == set(trained)
    left = context.state.array_records[keys.COMPRESS_RESIDUAL].to_torch_state_dict()
    for key, value in left.items():
        assert torch.allclose(rebuilt[key] + value, trained[key], atol=1e-6), key
    # a checkpoint saves the leftover with the node, and a resumed node gets it back
    saved = saved_node_state(context.state, "")
    assert set(saved) == {f"residual/{k}" for k in left}
    restored = node_records("", saved, 1)[keys.COMPRESS_RESIDUAL].to_torch_state_dict()
    assert all(torch.equal(restored[k], left[k]) for k in left)


def test_without_error_feedback_the_node_keeps_nothing(task_identity):
    g = np.random.default_rng(0)
    x, y = g.random((12, 1, 8, 8), dtype=np.float32), g.integers(0, 3, 12).astype(np.int64)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    model = build_model("mlp", (1, 8, 8), 3)
    run_train(_message(model, 1, compress="topk", error_feedback=False), x, y, "cpu", 0,
              context=context)
    assert keys.COMPRESS_RESIDUAL not in context.state.array_records


def test_the_downlink_sends_quantised_weights_and_the_merge_moves_them_back_by_hand():
    """``--compress-down int8``: w = (1.27, 0.004, 0 ...) in one block: scale 0.01.

    The node gets q = (1.27, 0.0, 0 ...): 0.004 rounds to 0. It trains entry 1 to 0.1 (an
    update of +0.1 from what it got); its model is taken as 0.1 + (0.004 - 0) = 0.104. A
    10-entry bias travels as it is and is left alone.
    """
    w = torch.zeros(1024)
    w[0], w[1] = 1.27, 0.004
    bias = torch.arange(10, dtype=torch.float32)
    sent, lost = compression.compress_weights({"w": w, "b": bias}, "int8")
    assert sorted(sent) == ["b", "w#q8", "w#s"] and sent["b"] is bias
    assert sent["w#s"].tolist() == pytest.approx([0.01])
    assert sent["w#q8"][:2].tolist() == [127, 0]
    got = compression.decode_weights(sent, {"w": torch.empty(1024), "b": torch.empty(10)})
    assert got["w"][:2].tolist() == pytest.approx([1.27, 0.0])
    assert torch.equal(got["b"], bias)
    assert lost["w"][1].item() == pytest.approx(0.004) and set(lost) == {"w"}
    trained = {"w": got["w"].clone(), "b": bias + 1}
    trained["w"][1] = 0.1
    merged_in = compression.rebase(trained, lost)
    assert merged_in["w"][1].item() == pytest.approx(0.104)
    assert merged_in["w"][0].item() == pytest.approx(1.27)
    assert torch.equal(merged_in["b"], bias + 1)
    # a compressed update (--compress with --compress-down) is decoded onto the exact w
    update, _ = compression.compress_update(trained, got, "int8")
    rebuilt = compression.decode_reply(compression.rebase(update, lost), {"w": w, "b": bias})
    assert rebuilt["w"][1].item() == pytest.approx(0.104, abs=0.01 / 2 + 1e-6)


def test_weights_without_encoded_entries_are_read_as_they_are():
    state = {"w": torch.ones(2048)}
    assert compression.decode_weights(state, state) is state
    assert compression.rebase(state, {}) is state


def test_a_node_clipping_its_own_update_sends_it_clipped_and_weighs_one(task_identity):
    """--dp-clip-on node: the reply is start + clip(trained - start), num-examples 1."""
    g = np.random.default_rng(0)
    x, y = g.random((12, 1, 8, 8), dtype=np.float32), g.integers(0, 3, 12).astype(np.int64)
    model = build_model("mlp", (1, 8, 8), 3)
    start = model.state_dict()
    plain = run_train(_message(model, 1), x, y, "cpu", 0)
    trained = plain.content.array_records[keys.ARRAYS].to_torch_state_dict()
    norm = strategies.update_norm(start, trained)
    clip = norm / 4
    reply = run_train(_message(model, 1, dp_noise=1.0, dp_clip=clip, dp_clip_on="node"),
                      x, y, "cpu", 0)
    sent = reply.content.array_records[keys.ARRAYS].to_torch_state_dict()
    assert strategies.update_norm(start, sent) == pytest.approx(clip, rel=1e-4)
    for key in start:  # the same direction, a quarter of the length
        assert torch.allclose(sent[key] - start[key], (trained[key] - start[key]) / 4,
                              atol=1e-6), key
    assert reply.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES] == 1
    assert plain.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES] == 12
