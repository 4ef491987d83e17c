"""Adapted LoRA weights sent as low-rank updates (run/lora_transport.py, node/lora_base.py)."""

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedavg.node import keys, lora_base
from fedavg.run.lora_transport import HISTORY, LoraTransport

W = "layer.base_layer.weight"


class _Model:
    """What the node side asks of a LoRA model: its built W and which keys are W."""

    def __init__(self, w):
        self.w = w

    def pretrained_weights(self):
        return {W: self.w}

    def downlink_only(self):
        return {W}

    def state_dict(self):
        return {W: self.w, "head": torch.zeros(1)}


def _messages(transport, state, nodes):
    msgs = [Message(content=RecordDict({keys.ARRAYS: ArrayRecord(state)}), dst_node_id=n,
                    message_type="train") for n in nodes]
    transport.outgoing(msgs, ArrayRecord(state))
    return msgs


def _context():
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


def test_round_one_sends_no_weights_then_rank_k_r_updates_the_nodes_rebuild_exactly(task_identity):
    torch.manual_seed(0)
    w0 = torch.randn(6, 6)
    state0 = {W: w0, "head": torch.zeros(1)}
    transport = LoraTransport([W], rank=1)
    (msg,) = _messages(transport, state0, [7])
    assert W not in msg.content[keys.ARRAYS] and dict(msg.content[keys.LORA_BASE]) == {
        "from": 0, "to": 0}
    ctx, model = _context(), _Model(w0)
    got, held = lora_base.round_weights(model, msg, ctx)  # round 0: its own base
    assert held == 0 and torch.equal(got[W], w0)
    lora_base.keep(ctx, got, model, held)
    transport.replied(7, held)
    # two nodes' rank-1 products, merged: a rank-2 change
    change = torch.outer(torch.randn(6), torch.randn(6)) + torch.outer(torch.randn(6),
                                                                       torch.randn(6))
    state1 = transport.merged({W: w0 + change, "head": torch.ones(1)}, state0, num_nodes=2)
    assert torch.allclose(state1[W], w0 + change, atol=1e-5)
    (msg,) = _messages(transport, state1, [7])
    deltas = msg.content[keys.LORA_DELTAS]
    assert tuple(deltas["r1:layer.base_layer.weight:P"].shape) == (6, 2)
    got, held = lora_base.round_weights(model, msg, ctx)
    assert held == 1 and torch.equal(got[W], state1[W])  # the coordinator's values, bit for bit


def test_a_node_that_missed_rounds_gets_each_update_and_one_gone_too_long_gets_w_whole(
        task_identity):
    transport = LoraTransport([W], rank=1)
    state = {W: torch.zeros(4, 4)}
    transport.replied(1, 0)
    transport.replied(2, 0)
    for round_ in range(1, HISTORY + 2):
        new = {W: state[W] + torch.outer(torch.ones(4), torch.arange(4.0)) * round_}
        state = transport.merged(new, state, num_nodes=1)
        transport.replied(1, round_)  # node 1 trains every round; node 2 never again
    fresh, back, stale = _messages(transport, state, [1, 2, 3])
    assert dict(fresh.content[keys.LORA_BASE]) == {"from": HISTORY + 1, "to": HISTORY + 1}
    assert dict(back.content[keys.LORA_BASE])["from"] == -1  # its updates are gone: W whole
    assert W in back.content[keys.ARRAYS]
    assert dict(stale.content[keys.LORA_BASE])["from"] == -1  # never seen: round 0 is gone


def test_a_merge_that_is_not_low_rank_sends_w_whole_to_everyone(task_identity):
    transport = LoraTransport([W], rank=1)
    transport.replied(1, 0)
    torch.manual_seed(1)
    state = transport.merged({W: torch.randn(8, 8)}, {W: torch.zeros(8, 8)}, num_nodes=2)
    (msg,) = _messages(transport, state, [1])
    assert dict(msg.content[keys.LORA_BASE]) == {"from": -1, "to": 1}
    got, held = lora_base.round_weights(_Model(torch.zeros(8, 8)), msg, _context())
    assert held == 1 and torch.equal(got[W], state[W])


def test_a_node_whose_state_is_not_the_one_the_update_builds_on_refuses_the_round(task_identity):
    transport = LoraTransport([W], rank=1)
    transport.replied(5, 0)
    state = transport.merged({W: torch.outer(torch.ones(3), torch.ones(3))},
                             {W: torch.zeros(3, 3)}, num_nodes=1)
    transport.replied(5, 1)
    (msg,) = _messages(transport, state, [5])  # builds on round 1, node restarted: no state
    with pytest.raises(RuntimeError, match="holds round 0's adapted LoRA weights and the "
                                           "round's update builds on round 1's"):
        lora_base.round_weights(_Model(torch.zeros(3, 3)), msg, _context())
    transport.replied(5, None)  # its failed reply
    (msg,) = _messages(transport, state, [5])
    assert dict(msg.content[keys.LORA_BASE])["from"] == -1
