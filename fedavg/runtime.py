"""Warm task workers on Flower's deployment engine (flwr 1.42 runtime API).

Flower runs each ServerApp or ClientApp task in a process started for that one task
(``flwr-serverapp`` / ``flwr-clientapp``), which re-imports torch every round. With the
SuperLink or SuperNode in ``--isolation process`` mode, the tasks instead wait for an
outside worker; the functions here are that worker. A long-lived ``fedavg`` process
acquires each task from the runtime API, exactly as ``flower-superexec`` does, and runs it
in-process, as ``flwr-clientapp`` / ``flwr-serverapp`` would: pull the task input, run the
app, push the reply and the task output, with the task heartbeat running meanwhile.

Only our own apps are ever run: the FAB that comes with a run is not imported, so a run
submitted by someone else cannot execute its code here.

This module uses Flower internals (the runtime protocol, the SuperNode's fixed sleeps);
:data:`FLOWER_VERSION` is the version they were written against and
:func:`check_flower_internals` fails loudly when they change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

FLOWER_VERSION = "1.42.0"

log = logging.getLogger("fedavg")

#: What the SuperNode's loop sleeps (seconds) when patched by :func:`patch_supernode_sleeps`.
IDLE_POLL_S = 0.2
REPLY_WAIT_S = 0.02
#: First retry (seconds) of Flower's object pulls, instead of 1 s.
PULL_BACKOFF_S = 0.05
#: Seconds between a SuperNode's heartbeats (Flower: 30). The SuperLink counts a node as
#: gone after two missed beats, so a crashed machine leaves its round within ~20 s.
HEARTBEAT_S = 10


def check_flower_internals() -> None:
    """Fail loudly when the Flower internals this module relies on have changed.

    Raises
    ------
    RuntimeError
        The installed flwr is not :data:`FLOWER_VERSION`, or a name used here is gone.
    """
    import inspect

    import flwr

    if flwr.__version__ != FLOWER_VERSION:
        raise RuntimeError(
            f"fedavg's warm workers are written for flwr {FLOWER_VERSION}, found "
            f"{flwr.__version__}; install flwr=={FLOWER_VERSION}"
        )
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import fleet_http_connection as fhc
    from flwr.supernode import start_client_internal as sci
    from flwr.supernode.runtime import run_clientapp as rc

    src = inspect.getsource(sci)
    for needle in ("time.sleep(3)", "time.sleep(0.5)"):
        if needle not in src:
            raise RuntimeError(f"flwr.supernode.start_client_internal no longer has {needle}")
    from flwr.supercore import heartbeat

    for mod in (fhc, heartbeat):
        if not isinstance(getattr(mod, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)):
            raise RuntimeError(f"{mod.__name__}.HEARTBEAT_DEFAULT_INTERVAL is gone")
    for name in ("pull_task_input", "push_message", "push_task_output"):
        if not hasattr(rc, name):
            raise RuntimeError(f"flwr.supernode.runtime.run_clientapp.{name} is gone")
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        if "initial_backoff" not in inspect.signature(fn).parameters:
            raise RuntimeError(f"{fn.__qualname__} has no initial_backoff any more")


class _FastTime:
    """Stand-in for the ``time`` module inside the SuperNode loop: shorter fixed sleeps."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def sleep(self, seconds: float) -> None:
        if seconds == 3:  # idle poll of the SuperLink
            seconds = IDLE_POLL_S
        elif seconds == 0.5:  # wait for the ClientApp's reply
            seconds = REPLY_WAIT_S
        self._real.sleep(seconds)


def patch_supernode() -> None:
    """In this (SuperNode) process: shorten the fixed idle poll (3 s) and reply wait (0.5 s),
    and send heartbeats every :data:`HEARTBEAT_S` seconds."""
    from flwr.supernode import fleet_http_connection as fhc
    from flwr.supernode import start_client_internal as sci

    check_flower_internals()
    if not isinstance(sci.time, _FastTime):
        sci.time = _FastTime(time)
    from flwr.supercore import heartbeat

    fhc.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_S  # announced to the SuperLink
    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_S  # and kept by the sender


def patch_pull_backoff() -> None:
    """Start Flower's object-pull retries at :data:`PULL_BACKOFF_S` instead of 1 s."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        defaults = list(fn.__defaults__ or ())
        first = len(names) - len(defaults)
        if "initial_backoff" in names[first:]:
            defaults[names.index("initial_backoff") - first] = PULL_BACKOFF_S
            fn.__defaults__ = tuple(defaults)
        elif fn.__kwdefaults__ and "initial_backoff" in fn.__kwdefaults__:
            fn.__kwdefaults__ = {**fn.__kwdefaults__, "initial_backoff": PULL_BACKOFF_S}


@dataclass
class Endpoint:
    """A runtime API to work for: ``host:port``, TLS root certificate, SuperExec secret."""

    address: str
    root_certificates: bytes | None = None
    secret: bytes | None = None

    @property
    def insecure(self) -> bool:
        return self.root_certificates is None


def _acquire_client(endpoint: Endpoint):
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if endpoint.secret:
        interceptors.append(SuperExecAuthHttpInterceptor(
            master_secret=endpoint.secret,
            protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    return RuntimeHttpClient.from_server_address(
        server_address=endpoint.address, insecure=endpoint.insecure,
        root_certificates=endpoint.root_certificates, interceptors=interceptors,
        retry_invoker=_bounded(make_simple_http_retry_invoker(), tries=2, seconds=5.0))


def _bounded(invoker, tries: int, seconds: float):
    """Flower's HTTP retry invoker retries for ever; a local runtime API that went away must
    surface as an error instead (the caller then checks whether its Flower process died)."""
    invoker.max_tries = tries
    invoker.max_time = seconds
    return invoker


class TaskSource:
    """Acquire tasks of one type from a runtime API (what ``flower-superexec`` polls)."""

    def __init__(self, endpoint: Endpoint, task_type: str) -> None:
        self.endpoint = endpoint
        self.task_type = task_type
        self._client = _acquire_client(endpoint)

    def acquire(self):
        """``(token, task)`` of a waiting task, or ``None``."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611

        res = self._client.AcquireTask(AcquireTaskRequest(supported_task_types=[self.task_type]))
        if res.HasField("task") and res.token:
            return res.token, res.task
        return None

    def close(self) -> None:
        self._client.close()


def run_client_task(endpoint: Endpoint, token: str, app) -> str | None:
    """Run one ClientApp task in this process, as ``flwr-clientapp`` would.

    An exception raised by ``app`` becomes an error reply (Flower's
    ``CLIENT_APP_RAISED_EXCEPTION``) so that the coordinator hears of it at once.

    Returns
    -------
    str or None
        ``None`` when the app produced a normal reply, else the error (``Type: message``).
    """
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    client = RuntimeHttpClient.from_server_address(
        server_address=endpoint.address, insecure=endpoint.insecure,
        root_certificates=endpoint.root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(token)],
        retry_invoker=_bounded(make_simple_http_retry_invoker(), tries=20, seconds=60.0))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details, failure = SubStatus.FAILED, "ClientApp task failed", "task failed"
    try:
        message, context, _run, _fab = pull_task_input(client)  # the FAB is never imported
        reply = app(message=message, context=context)
        status, details, failure = SubStatus.COMPLETED, "", None
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator as an error reply
        reason = f"{type(exc)}:<'{exc}'>"
        failure = f"{type(exc).__name__}: {exc}"
        log.error("task failed: %s", failure)
        details = reason
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                            reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()
    return failure


def run_server_task(endpoint: Endpoint, token: str,
                    main: Callable[[object, object], None]) -> None:
    """Run one ServerApp task in this process, as ``flwr-serverapp`` would.

    ``main(grid, context)`` is called with Flower's HTTP Grid bound to the run. The task's
    final status (completed or failed, with the error) is pushed back either way.

    Raises
    ------
    Exception
        Whatever ``main`` raised, after the status was pushed.
    """
    from flwr.common.constant import SubStatus
    from flwr.common.serde import context_from_proto, context_to_proto, run_from_proto
    from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
        PullTaskInputRequest,
        PushTaskOutputRequest,
    )
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.grid import HttpGrid

    grid = HttpGrid(runtime_api_address=endpoint.address, insecure=endpoint.insecure,
                    root_certificates=endpoint.root_certificates, token=token)
    runtime = grid._runtime_client  # noqa: SLF001 - as flwr-serverapp does
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(runtime))
    heartbeat.start()
    context = None
    status, details = SubStatus.FAILED, "ServerApp failed"
    try:
        res = runtime.PullTaskInput(PullTaskInputRequest())
        TaskIdentity.task_id = res.task_id
        TaskIdentity.run_id = res.run.run_id
        TaskIdentity.node_id = res.context.node_id
        context = context_from_proto(res.context)
        grid.set_run(run_from_proto(res.run))
        main(grid, context)
        status, details = SubStatus.COMPLETED, ""
    except BaseException as exc:
        details = f"ServerApp failed: {exc}"[:500]
        raise
    finally:
        try:
            from flwr.app import RecordDict

            if context is not None:
                context.state = RecordDict()
            runtime.PushTaskOutput(PushTaskOutputRequest(
                context=context_to_proto(context) if context else None,
                sub_status=status, details=details))
        except Exception as exc:  # noqa: BLE001 - the SuperLink may already be gone
            log.debug("could not push the task output: %s", exc)
        finally:
            heartbeat.stop()
            grid.close()
