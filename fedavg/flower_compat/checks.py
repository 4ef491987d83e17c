"""The guard: the installed flwr is the one fedavg was written against, with every name used.

:func:`check_flower_internals` checks the exact version, every ``from flwr... import name``
in this package, and the Flower source lines (fixed sleeps, log messages) fedavg depends on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
from pathlib import Path

FLOWER_VERSION = "1.42.0"

#: Text that must still be in Flower's sources: the fixed sleeps we shorten and the log
#: lines :func:`parse_supernode_line`, :func:`node_refusal` and
#: :func:`superlink_node_refusal` read.
_SOURCES = {
    "flwr.supernode.start_client_internal": ("time.sleep(3)", "time.sleep(0.5)",
                                             '"SuperNode ID: %s"'),
    "flwr.supercore.heartbeat": ("res = client.SendTaskHeartbeat(req)",
                                 "signal.raise_signal(signal.SIGINT)"),
    "flwr.supercore.retry.http_retry": ("if status_code == httpx.codes.UNAUTHORIZED:",
                                        "os.kill(os.getpid(), signal.SIGINT)",
                                        "Connection successful after",
                                        "Connection attempt failed, retrying in %.2f seconds",
                                        "Giving up reconnection",
                                        "exponential(max_delay=MAX_RETRY_DELAY)"),
    "flwr.superlink.grid.http_grid": ("self._retry_invoker = make_simple_http_retry_invoker()",
                                      "retry_invoker=self._retry_invoker,"),
    "flwr.supercore.error.catalog": ("All SuperNodes must be registered",
                                     "Failed to activate SuperNode."),
    "flwr.server.superlink.linkstate.in_memory_linkstate": (
        "node_id = generate_rand_int_from_bytes(", "return self.federation_manager.filter_nodes(",
        "for msg_id in list(self.message_ins_store.keys()):",
        "msg_ins.metadata.delivered_at == \"\""),
    "flwr.server.superlink.fleet.vce.vce_api": (
        "for node_id in nodes_mapping.keys():",
        "message_ins_list = state.get_message_ins(node_id=node_id, limit=1)",
        "target=add_messages_to_queue,", "messageins_queue: Queue[Message] = Queue()",
        "message: Message = messageins_queue.get(timeout=1.0)",
        "message_reply = queue.get(timeout=1.0)",
        "def _register_node_info_stores(", "node_info_store[node_id].register_context(",
        "node_info_store[node_id].update_context("),
    "flwr.server.superlink.fleet.vce.backend.raybackend": (
        "self.pool.terminate_all_actors()\n        ray.shutdown()",
        "actor_type=ClientAppActor,", "self.pool.add_actors_to_pool(self.pool.actors_capacity)"),
    "flwr.simulation.ray_transport.ray_actor": (
        "self.create_actor_fn = lambda: actor_type.options(",
        "self.pool.append(self.create_actor_fn())",
        "def __init__(self, on_actor_init_fn: Callable[[], None] | None = None) -> None:"),
    "flwr.supercore.exit.exit": ('f"Exit Code: {code}',),
    "flwr.supercore.exit.exit_code": ("could not establish a connection",),
    "flwr.supercore.error.http": ("[ApiError:{err.code}] {err.message}",),
    "flwr.superlink.servicer.fleet.fleet_handlers": (
        "Attempted to register SuperNode with public key: {request.public_key!r}",
        "{error_context}, exception: {exc}", "could not be activated.",
        "No SuperNode found with the given public key.", "Heartbeat interval {interval}"),
}
#: Text that must come in this order in a Flower function: on activation the SuperLink looks
#: up the node's key before it checks the heartbeat interval (:func:`node_key_registered`).
_IN_ORDER = {
    ("flwr.superlink.servicer.fleet.fleet_handlers", "activate_node"): (
        "state.get_node_id_by_public_key(request.public_key)",
        "No SuperNode found with the given public key.",
        "_validate_heartbeat_interval(request.heartbeat_interval)",
        "state.activate_node(node_id, request.heartbeat_interval)"),
}


@functools.cache
def check_flower_internals() -> None:
    """Fail loudly when the Flower internals fedavg relies on have changed.

    Raises
    ------
    RuntimeError
        The installed flwr is not :data:`FLOWER_VERSION`, a private name used here is gone,
        or Flower no longer logs a line (or sleeps a time) that fedavg depends on.
    """
    import flwr

    if flwr.__version__ != FLOWER_VERSION:
        raise RuntimeError(f"fedavg's warm workers are written for flwr {FLOWER_VERSION}, "
                           f"found {flwr.__version__}; install flwr=={FLOWER_VERSION}")
    for module, name in _private_names():
        if not hasattr(_module(module), name):  # a submodule is an attribute once imported
            _module(f"{module}.{name}")
    for module, needles in _SOURCES.items():
        src = inspect.getsource(_module(module))
        for needle in needles:
            if needle not in src:
                raise RuntimeError(f"{module} no longer has {needle}")
    _check_key_check()
    from flwr.supercore import heartbeat
    from flwr.supercore.inflatable import inflatable_utils as iu
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.superlink.grid import HttpGrid
    from flwr.supernode import fleet_http_connection as fhc

    for mod in (fhc, heartbeat):
        if not isinstance(getattr(mod, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)):
            raise RuntimeError(f"{mod.__name__}.HEARTBEAT_DEFAULT_INTERVAL is gone")
    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        if "initial_backoff" not in inspect.signature(fn).parameters:
            raise RuntimeError(f"{fn.__qualname__} has no initial_backoff any more")
    if not isinstance(getattr(HttpGrid, "_runtime_client", None), property):
        raise RuntimeError("flwr.superlink.grid.HttpGrid._runtime_client is gone")
    invoker = make_simple_http_retry_invoker()
    if not all(hasattr(invoker, a) for a in ("max_tries", "max_time", "should_giveup")):
        raise RuntimeError("Flower's HTTP retry invoker has no max_tries / max_time / "
                           "should_giveup any more")


def _check_key_check() -> None:
    """Check what :func:`~fedavg.flower_compat.node_key_registered` relies on."""
    from flwr.supercore.error import ApiErrorCode
    from flwr.superlink.servicer.fleet import fleet_handlers

    for (module, function), needles in _IN_ORDER.items():
        src, at = inspect.getsource(getattr(_module(module), function)), 0
        for needle in needles:
            at = src.find(needle, at)
            if at < 0:
                raise RuntimeError(f"{module}.{function} no longer has {needle} (in this order: "
                                   f"{'; '.join(needles)})")
    if not fleet_handlers.HEARTBEAT_MIN_INTERVAL > 0:
        raise RuntimeError("Flower accepts a heartbeat interval of 0 s now")
    codes = {"FLEET_SUPERNODE_REGISTRATION_DISABLED": 2001, "FLEET_INVALID_HEARTBEAT_INTERVAL":
             2003, "FLEET_NODE_ACTIVATION_FAILED": 2004}
    for name, code in codes.items():
        if getattr(ApiErrorCode, name, None) != code:
            raise RuntimeError(f"flwr.supercore.error.ApiErrorCode.{name} is not {code} any more")


def _private_names() -> list[tuple[str, str]]:
    """List ``(module, name)`` of every ``from flwr.<module> import name`` in this package."""
    import ast

    found = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("flwr."):
                found += [(node.module, alias.name) for alias in node.names]
    return sorted(set(found))


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise RuntimeError(f"{name} is gone (flwr {FLOWER_VERSION} has it)") from None


def check_ray_internals() -> None:
    """Fail loudly when a Ray internal fedavg sets or reads moved.

    Raises
    ------
    RuntimeError
        ``ray._private.auto_init_hook.enable_auto_connect``,
        ``ray._private.worker._global_node`` (and its use in ``shutdown``) or the loopback
        switch (:func:`ray_on_loopback`) is gone.
    """
    mod = _module("ray._private.auto_init_hook")
    if not isinstance(getattr(mod, "enable_auto_connect", None), bool):
        raise RuntimeError("ray._private.auto_init_hook.enable_auto_connect is gone")
    worker = _module("ray._private.worker")
    if not hasattr(worker, "_global_node") or "_global_node.kill_all_processes(" not in (
            inspect.getsource(worker.shutdown)):
        raise RuntimeError("ray._private.worker.shutdown no longer stops _global_node")
    constants, services = _module("ray._private.ray_constants"), _module("ray._private.services")
    if getattr(constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", None) != LOOPBACK_VAR or \
            not isinstance(getattr(constants, "ENABLE_RAY_CLUSTER", None), bool) or \
            "ray_constants.ENABLE_RAY_CLUSTER" not in inspect.getsource(
                services.get_node_ip_address):
        raise RuntimeError("Ray no longer takes the loopback address with its cluster mode off")


#: Off ("0"), a Ray instance started on Linux takes 127.0.0.1 as its node's address, as it
#: does on macOS and Windows, and its servers then listen on the loopback interface only.
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def ray_on_loopback():
    """Let a Ray instance started inside listen on 127.0.0.1 only, not on every interface.

    Ray's GCS, raylet and worker servers listen on every interface unless the node's
    address is the loopback one. Ray takes that address only with its multi-machine mode
    off, which it reads from :data:`LOOPBACK_VAR` when imported; its processes inherit the
    variable. Both are as before afterwards, so a later ``--ray-address`` run in the same
    process still joins its cluster.

    Raises
    ------
    RuntimeError
        See :func:`check_ray_internals`.
    """
    check_ray_internals()
    from ray._private import ray_constants

    saved = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


def disconnect_ray() -> bool:
    """``ray.shutdown()`` without Ray stopping the processes this driver started.

    Ray's own stop gives each of its processes a second to exit gracefully, one after
    another; the caller kills them instead (their graceful exit keeps nothing).

    Returns
    -------
    bool
        Whether this process had started a Ray instance (whose processes now need stopping).

    Raises
    ------
    RuntimeError
        See :func:`check_ray_internals`.
    """
    check_ray_internals()
    import ray
    from ray._private import worker

    node = worker._global_node
    own = node is not None and node.is_head()
    if own:
        worker._global_node = None  # shutdown() then disconnects only
    ray.shutdown()
    return own


def disable_ray_auto_connect() -> None:
    """Make a Ray call after ``ray.shutdown()`` fail instead of starting a new Ray instance.

    Raises
    ------
    RuntimeError
        See :func:`check_ray_internals`.
    """
    check_ray_internals()
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False
