"""Patches to Flower's simulation engine (the in-process Fleet of ``run_simulation``)."""

from __future__ import annotations

import contextlib
import queue
from typing import Any, Callable

from fedavg.flower_compat.checks import check_flower_internals

#: The longest a simulation engine thread waits on its queue before it looks at the stop
#: event (Flower: 1 s, so every run ended up to a second after its last round).
QUEUE_WAIT_S = 0.05


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


class _PromptQueue(queue.Queue):
    """A queue whose timed ``get`` waits at most :data:`QUEUE_WAIT_S` seconds."""

    def get(self, block=True, timeout=None):
        """Return an item; with a timeout, raise ``queue.Empty`` after at most 0.05 s."""
        if timeout is not None:
            timeout = min(timeout, QUEUE_WAIT_S)
        return super().get(block, timeout)


@contextlib.contextmanager
def prompt_stop():
    """Within the block, the engine stops as soon as the ServerApp is done, leaving Ray up.

    Flower's engine threads wait up to 1 s on their queues before they see the stop event,
    and its Ray backend then runs ``ray.shutdown()``, which gives every Ray process a second
    to exit, one after another (about 1.4 s). Here the threads wait at most
    :data:`QUEUE_WAIT_S` seconds, and the backend only ends its actors: the caller stops Ray
    (:func:`fedavg.engines.simulation.ray_cleanup.shutdown_ray`).
    """
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    check_flower_internals()
    original_queue, original_terminate = vce_api.Queue, RayBackend.terminate

    def terminate(self) -> None:
        if self.pool:
            self.pool.terminate_all_actors()

    vce_api.Queue, RayBackend.terminate = _PromptQueue, terminate
    try:
        yield
    finally:
        vce_api.Queue, RayBackend.terminate = original_queue, original_terminate


def node_actors(client_resources: dict[str, float], on_init: Callable[[], None]) -> list:
    """Create as many node actors as Flower's Ray actor pool would, each running ``on_init``.

    Parameters
    ----------
    client_resources : dict
        ``num_cpus`` and ``num_gpus`` of each actor, as in the backend config.
    on_init : callable
        Run in each actor's own process as it starts (a module-level function).

    Returns
    -------
    list
        Handles of Flower's ``ClientAppActor``; this call does not wait for them to start.
    """
    from flwr.simulation.ray_transport.ray_actor import ClientAppActor, pool_size_from_resources

    check_flower_internals()
    return [ClientAppActor.options(**client_resources).remote(on_actor_init_fn=on_init)
            for _ in range(pool_size_from_resources(client_resources))]


@contextlib.contextmanager
def prestarted_actors(actors: list):
    """Within the block, Flower's Ray actor pool takes ``actors`` before creating its own.

    Flower's Ray backend creates its node actors when the engine builds its pool, just
    before the first round, and each then spends seconds importing (see
    :mod:`fedavg.engines.simulation.ray_start`). Actors created earlier with the pool's resources
    (:func:`node_actors`) join the pool in their place; the pool creates
    only the ones still missing.
    """
    from flwr.simulation.ray_transport import ray_actor

    check_flower_internals()
    original = ray_actor.BasicActorPool.__init__
    spare = list(actors)

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        create = self.create_actor_fn
        self.create_actor_fn = lambda: spare.pop(0) if spare else create()

    ray_actor.BasicActorPool.__init__ = __init__
    try:
        yield
    finally:
        ray_actor.BasicActorPool.__init__ = original


class NodeContexts:
    """The simulated nodes' Flower contexts, read and seeded from the ServerApp's side.

    Flower's engine keeps one ``Context`` per simulated node in the process that runs the
    ServerApp (``vce_api``'s node info stores); a node's ``Context.state`` lasts from one
    of its rounds to the next. Within :meth:`attached`, the engine's stores are kept here
    when it registers its nodes, and each node's state starts as ``initial`` gives it (a
    resumed run's).

    Parameters
    ----------
    initial : dict, optional
        Partition id to ``{record key: record}`` put into that node's ``Context.state``.
    """

    def __init__(self, initial: dict[int, dict[str, Any]] | None = None) -> None:
        self.initial = initial or {}
        self._stores: dict[int, Any] = {}
        self._run_id: int | None = None

    def states(self, pick: Callable[[Any], Any]) -> dict[int, Any]:
        """Return ``pick(context.state)`` of each node by partition id, where not ``None``."""
        out = {}
        for store in list(self._stores.values()):
            context = store.retrieve_context(self._run_id)
            value = pick(context.state)
            if value is not None:
                out[int(context.node_config["partition-id"])] = value
        return out

    @contextlib.contextmanager
    def attached(self):
        """Within the block, the engine's node contexts are reachable through this object."""
        from flwr.server.superlink.fleet.vce import vce_api

        check_flower_internals()
        original = vce_api._register_node_info_stores

        def register(nodes_mapping, run, app_dir=None):
            stores = original(nodes_mapping, run, app_dir)
            for store in stores.values():
                context = store.retrieve_context(run.run_id)
                for key, record in self.initial.get(
                        int(context.node_config["partition-id"]), {}).items():
                    context.state[key] = record
                store.update_context(run.run_id, context)
            self._stores, self._run_id = stores, run.run_id
            return stores

        vce_api._register_node_info_stores = register
        try:
            yield self
        finally:
            vce_api._register_node_info_stores = original
