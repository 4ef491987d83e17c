"""The coordinator's side of secure aggregation: each round's exchange run as Flower's SecAgg+.

:class:`SecureGrid` wraps the run's grid. Flower's strategy loop hands it a round's ``train``
messages; instead of sending them in clear it runs one round of Flower's ``SecAggPlusWorkflow``
(:func:`fedavg.flower_compat.secagg.secure_mean`) over the wrapped grid, and returns a
:class:`SecureRound`: the sample-weighted mean of the node updates, unmasked by the protocol,
and who took part. :class:`~fedavg.run.flower_adapter.FlowerAdapter` folds that mean, as the
round's starting model plus the mean update, into the run's strategy as one reply weighing
the nodes' samples together. So the coordinator never holds one node's model or update, and
only strategies that need no more than that mean take part (``Strategy.secure_sum``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from flwr.app import Message

from fedavg.flower_compat import secagg
from fedavg.node import keys
from fedavg.util.errors import RunError

log = logging.getLogger("fedavg")


@dataclass
class SecureRound:
    """One round's result of SecAgg+: what :meth:`FlowerAdapter.aggregate_train` folds in.

    Attributes
    ----------
    result : fedavg.flower_compat.secagg.SecureMean
        The unmasked weighted mean of the updates, the nodes in it and those that dropped.
    names : list of str
        The state-dict keys of ``result.mean``'s arrays, in order.
    lost : set of int
        Nodes that left the grid during the round (the protocol stopped waiting for them).
    """

    result: secagg.SecureMean
    names: list[str]
    lost: set[int] = field(default_factory=set)

    def __iter__(self):
        return iter(())  # no single reply is ever held

    def merged_state(self, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return ``reference`` plus the mean update, each tensor in its own dtype.

        Integer and boolean buffers take the rounded mean of their updates.

        Raises
        ------
        fedavg.util.errors.RunError
            The mean's tensors do not match ``reference``'s keys or shapes.
        """
        mean = self.result.mean
        if mean is None or sorted(self.names) != sorted(reference) or len(mean) != len(self.names):
            raise RunError("secure aggregation returned arrays unlike the round's model")
        out = {}
        for name, delta in zip(self.names, mean):
            ref = reference[name]
            if delta.size != ref.numel():
                raise RunError(f"secure aggregation returned {name!r} with {delta.size} "
                               f"entries, the model has {ref.numel()}")
            value = ref.double() + torch.from_numpy(delta).reshape(ref.shape)
            out[name] = value.to(ref.dtype) if ref.is_floating_point() \
                else value.round().to(ref.dtype)
        return out


class SecureGrid:
    """A grid whose ``send_and_receive`` of a round's ``train`` messages runs SecAgg+.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The grid to run the protocol's stages on (the run's :class:`StreamingGrid`: it stops
        waiting for nodes that left).
    flow : flwr.server.workflow.SecAggPlusWorkflow
        From :func:`fedavg.flower_compat.secagg.workflow`.
    """

    def __init__(self, grid, flow) -> None:
        self._grid, self.flow = grid, flow
        self._lost: set[int] = set()
        if getattr(grid, "on_lost", None) is not None:  # reported with the round's result
            grid.on_lost = lambda node: self._lost.add(int(node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message] | SecureRound:
        """Run one SecAgg+ round for ``train`` messages (any other list goes as it is)."""
        messages = list(messages)
        if not messages or any(m.metadata.message_type != "train" for m in messages):
            return self._grid.send_and_receive(messages, timeout=timeout)
        first = messages[0].content
        names = list(first[keys.ARRAYS].keys())
        arrays = [first[keys.ARRAYS][n].numpy() for n in names]
        instructions = {}
        for msg in messages:
            extra = sorted(set(msg.content.keys()) - {keys.ARRAYS, keys.CONFIG})
            if extra:
                raise RunError(f"secure aggregation sends every node the model and "
                               f"settings only (this round adds {', '.join(extra)})")
            config = dict(msg.content[keys.CONFIG])
            config[keys.SECAGG_KEYS] = names
            instructions[int(msg.metadata.dst_node_id)] = (arrays, config)
        server_round = int(first[keys.CONFIG].get(keys.SERVER_ROUND, 0))
        self.flow.timeout = timeout  # each stage waits at most the round's timeout
        sampled, lost = sorted(instructions), set()
        while True:
            self._lost = set()
            result = secagg.secure_mean(self._grid, server_round, instructions, self.flow)
            lost |= self._lost
            online = set(self._grid.get_node_ids())
            still = {n: v for n, v in instructions.items() if n in online and n not in lost}
            if result.mean is not None or not 2 <= len(still) < len(instructions):
                break
            # Flower's workflow halts when a node leaves between its setup and key-sharing
            # stages (the others hold no share of its key): the round starts again without it
            log.warning("round %d: secure aggregation halted as %d node(s) left; starting it "
                        "again with the %d still here", server_round,
                        len(instructions) - len(still), len(still))
            instructions = still
        result.sampled = sampled
        return SecureRound(result, names, lost)
