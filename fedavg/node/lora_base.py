"""A node's side of ``--lora-merge exact``: rebuild the round's adapted weights from updates.

The coordinator sends the adapted weights ``W`` either whole (in ``arrays``) or as the
low-rank updates of the rounds this node lacks (:mod:`fedavg.run.lora_transport`); the node
keeps the ``W`` it trained on in its ``Context.state`` (:data:`~fedavg.node.keys.LORA_STATE`)
for the next round. A node without state starts from the pretrained base it built itself.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedavg.node import keys
from strategies.lora import add_low_rank

INFO = keys.LORA_STATE + "-info"


def round_weights(model: torch.nn.Module, message: Message,
                  context: Context | None) -> tuple[dict[str, torch.Tensor], int | None]:
    """Return the round's model state (``W`` included) and the round of its ``W``.

    ``(arrays, None)`` for a message without :data:`~fedavg.node.keys.LORA_BASE`.

    Raises
    ------
    RuntimeError
        The message builds on a round's ``W`` this node does not hold (it restarted, or
        missed a round it was thought to have): it refuses the round, and the coordinator
        sends ``W`` whole next time.
    """
    arrays = message.content[keys.ARRAYS].to_torch_state_dict()
    info = message.content.config_records.get(keys.LORA_BASE)
    if info is None:
        return arrays, None
    start, end = int(info["from"]), int(info["to"])
    if start < 0:  # W whole, in arrays
        return arrays, end
    held, weights = _held(model, context)
    if held != start:
        raise RuntimeError(f"this node holds round {held}'s adapted LoRA weights and the "
                           f"round's update builds on round {start}'s (a node restarted?); it "
                           "gets them whole next round")
    if end == start:
        return {**arrays, **weights}, end
    deltas = message.content.array_records[keys.LORA_DELTAS].to_torch_state_dict()
    for round_ in range(start + 1, end + 1):
        for key in weights:
            p, q = deltas[f"r{round_}:{key}:P"], deltas[f"r{round_}:{key}:Q"]
            weights[key] = add_low_rank(weights[key], p, q)
    return {**arrays, **weights}, end


def _held(model: torch.nn.Module, context: Context | None) -> tuple[int, dict]:
    """Return the round and values of the ``W`` this node holds (0: the pretrained base)."""
    if context is not None and keys.LORA_STATE in context.state.array_records:
        info = context.state.config_records[INFO]
        return int(info["round"]), context.state.array_records[
            keys.LORA_STATE].to_torch_state_dict()
    return 0, {k: t.clone() for k, t in model.pretrained_weights().items()}


def keep(context: Context | None, state: dict[str, torch.Tensor], model: torch.nn.Module,
         round_: int) -> None:
    """Keep the adapted weights of ``state`` (round ``round_``'s) in the node's state."""
    if context is None:
        return
    context.state[keys.LORA_STATE] = ArrayRecord(
        {k: state[k] for k in model.downlink_only()})
    context.state[INFO] = ConfigRecord({"round": int(round_)})
