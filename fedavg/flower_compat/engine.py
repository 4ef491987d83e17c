"""Patches to Flower's simulation engine (the in-process Fleet of ``run_simulation``)."""

from __future__ import annotations

import contextlib

from fedavg.flower_compat.checks import check_flower_internals


@contextlib.contextmanager
def fast_message_dispatch():
    """Within the block, the engine hands out a round's messages without polling every node.

    Flower's engine asks the link state for each simulated node's messages in turn, every
    0.1 s (``vce_api.add_messages_to_queue``), and each ask scans every stored message under
    the state's lock: with 10,000 nodes one pass costs seconds of CPU whether the round
    trains 10 nodes or all of them. Here one scan per pass finds the nodes that have
    undelivered messages, and only those are asked, in the engine's node order, so the same
    messages reach the queue in the same order.
    """
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    check_flower_internals()
    original = vce_api.add_messages_to_queue

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop) -> None:
        if not isinstance(state, InMemoryLinkState):
            return original(state, queue, nodes_mapping, f_stop)
        while not f_stop.is_set():
            with state.lock:
                waiting = {m.metadata.dst_node_id for m in state.message_ins_store.values()
                           if m.metadata.delivered_at == ""}
            if waiting:
                for node_id in [n for n in nodes_mapping if n in waiting]:
                    for msg in state.get_message_ins(node_id=node_id, limit=1):
                        queue.put(msg)
            f_stop.wait(0.1)
        return None

    vce_api.add_messages_to_queue = add_messages_to_queue
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
