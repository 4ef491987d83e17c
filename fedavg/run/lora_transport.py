"""Send each node the adapted weights of a ``--lora-merge exact`` run as the updates it lacks.

With the exact merge (:mod:`strategies.lora`) the coordinator folds the nodes' adapters into
the adapted weights ``W`` each round, so the nodes need the new ``W``: 7 MB for MiniLM's
query and value, against 0.3 MB of adapters. A round of ``k`` nodes changes each ``W`` by a
matrix of rank at most ``k * r`` (FLoRA's stack, Wang et al. 2024, arXiv:2409.05976), which
travels as two thin factors (:func:`strategies.lora.low_rank`). Every node keeps its ``W`` in
its ``Context.state`` between rounds (:mod:`fedavg.node.lora_base`).

:class:`LoraTransport` keeps which round's ``W`` each node holds (0, the pretrained base,
for a node never heard of: every node builds it from its own install) and the last rounds'
factors; a node gets the factors of the rounds it lacks, or ``W`` in full when they are
gone (a node back after many rounds, a resumed run) or a merge was not low rank (median,
FedAdam). A node whose state is not the one the message builds on (it restarted) refuses the
round in one line, and gets ``W`` in full the round after. The coordinator's own ``W`` is
rebuilt from the factors, so coordinator and nodes hold the same values.
"""

from __future__ import annotations

from typing import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedavg.node import keys
from strategies.lora import add_low_rank, low_rank

#: Rounds of factors kept for nodes that missed some.
HISTORY = 8


def delta_key(round_: int, layer: str, factor: str) -> str:
    """Return the key of a factor (``P`` or ``Q``) of ``layer``'s update in round ``round_``."""
    return f"r{round_}:{layer}:{factor}"


class LoraTransport:
    """The coordinator's side of sending adapted weights as low-rank updates.

    Parameters
    ----------
    weights : list of str
        State-dict keys of the adapted weights ``W`` (``...base_layer.weight``).
    rank : int
        The adapters' rank ``r``.
    version : int
        The round whose ``W`` the run's model holds (a resumed run's rounds).
    """

    def __init__(self, weights: list[str], rank: int, version: int = 0) -> None:
        self.weights, self.rank, self.version = list(weights), int(rank), int(version)
        self.deltas: dict[int, dict[str, torch.Tensor]] = {}
        self.held: dict[int, int] = {}  # node id -> the round of the W it holds

    def _needs(self, node: int) -> int | None:
        """Return the round the node's update starts from, or ``None``: it needs ``W`` whole."""
        have = self.held.get(node, 0)
        missing = range(have + 1, self.version + 1)
        return have if all(r in self.deltas for r in missing) else None

    def outgoing(self, messages: Iterable[Message], arrays: ArrayRecord) -> None:
        """Give each message of a round its adapted weights: as updates, or whole.

        ``arrays`` is the round's model (with ``W``); the messages share it as sent by
        Flower's strategy and get, where a node can rebuild ``W``, a record without it.
        """
        lean = None
        records: dict[int, ArrayRecord] = {}  # by the round a node starts from: shared
        for msg in messages:
            start = self._needs(int(msg.metadata.dst_node_id))
            if start is None:
                msg.content[keys.LORA_BASE] = ConfigRecord({"from": -1, "to": self.version})
                continue
            if lean is None:
                lean = ArrayRecord({k: v for k, v in arrays.to_torch_state_dict().items()
                                    if k not in self.weights})
            if start not in records:
                records[start] = ArrayRecord({
                    key: t for r in range(start + 1, self.version + 1)
                    for key, t in self.deltas[r].items()})
            msg.content[keys.ARRAYS] = lean
            msg.content[keys.LORA_DELTAS] = records[start]
            msg.content[keys.LORA_BASE] = ConfigRecord({"from": start, "to": self.version})

    def merged(self, state: dict[str, torch.Tensor], previous: dict[str, torch.Tensor],
               num_nodes: int) -> dict[str, torch.Tensor]:
        """Record the round's update of ``W``; return ``state`` with ``W`` rebuilt from it.

        ``W = W_previous + P @ Q`` on the coordinator as on the nodes (the same values); a
        merge that is not of rank ``num_nodes * r`` keeps its ``W`` and the history is
        cleared (every node gets ``W`` whole next round).
        """
        self.version += 1
        factors: dict[str, torch.Tensor] = {}
        rebuilt = dict(state)
        for key in self.weights:
            found = low_rank(state[key] - previous[key], num_nodes * self.rank)
            if found is None or sum(t.numel() for t in found) >= state[key].numel():
                self.deltas.clear()  # not low rank (or no smaller): W travels whole
                return state
            factors[delta_key(self.version, key, "P")] = found[0].contiguous()
            factors[delta_key(self.version, key, "Q")] = found[1].contiguous()
            rebuilt[key] = add_low_rank(previous[key], *found)
        self.deltas[self.version] = factors
        for old in [r for r in self.deltas if r <= self.version - HISTORY]:
            del self.deltas[old]
        return rebuilt

    def replied(self, node: int, held: int | None) -> None:
        """Note the round of the ``W`` a node holds after its reply (``None``: unknown)."""
        if held is None:
            self.held[node] = -1  # not the base any more, not known: W whole next time
        else:
            self.held[node] = int(held)
