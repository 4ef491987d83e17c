"""The simulation engine's message dispatch asks only the nodes that have messages."""

import queue
import threading
import time
from types import SimpleNamespace

from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from helpers.patience import within

from fedavg.flower_compat import fast_message_dispatch


class FakeState(InMemoryLinkState):
    """The two attributes the dispatch reads, and a ``get_message_ins`` that records calls."""

    def __init__(self, waiting: dict[int, str]) -> None:  # no Flower state behind it
        self.lock = threading.RLock()
        self.message_ins_store = {
            name: SimpleNamespace(name=name, metadata=SimpleNamespace(dst_node_id=node,
                                                                      delivered_at=""))
            for node, name in waiting.items()}
        self.asked: list[int] = []

    def get_message_ins(self, node_id, limit, *, run_id=None):
        """Hand out up to ``limit`` undelivered messages of ``node_id``, marked delivered."""
        self.asked.append(node_id)
        found = [m for m in self.message_ins_store.values()
                 if m.metadata.dst_node_id == node_id and m.metadata.delivered_at == ""]
        for m in found[:limit]:
            m.metadata.delivered_at = "now"
        return found[:limit]


def test_only_nodes_with_messages_are_asked_in_the_engines_node_order():
    state = FakeState({30: "for-30", 10: "for-10"})
    nodes = {n: n // 10 for n in (50, 30, 40, 10, 20)}  # the engine's node order
    out, stop = queue.Queue(), threading.Event()
    with fast_message_dispatch():
        thread = threading.Thread(target=vce_api.add_messages_to_queue,
                                  args=(state, out, nodes, stop))
        thread.start()
        deadline = time.monotonic() + within(10)
        while out.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a few more passes: nothing is handed out twice
        stop.set()
        thread.join(5)
    assert [out.get_nowait().name for _ in range(out.qsize())] == ["for-30", "for-10"]
    assert state.asked == [30, 10]  # never 50, 40 or 20, and each once
    assert vce_api.add_messages_to_queue.__module__ == vce_api.__name__  # restored
