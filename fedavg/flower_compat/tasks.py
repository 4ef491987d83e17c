"""Warm task workers on the runtime API of a SuperLink or SuperNode.

Flower runs each ServerApp or ClientApp task in a process started for that one task
(``flwr-serverapp`` / ``flwr-clientapp``), which re-imports torch every round. With the
SuperLink or SuperNode in ``--isolation process`` mode, the tasks instead wait for an outside
worker: a long-lived ``fedavg`` process acquires each task (:class:`TaskSource`), exactly as
``flower-superexec`` does, and runs it in-process, as ``flwr-clientapp`` / ``flwr-serverapp``
would: pull the task input, run the app, push the reply and the task output, with the task
heartbeat running meanwhile. Only our own apps are ever run: the FAB that comes with a run
is not imported, so a run submitted by someone else cannot execute its code here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("fedavg")

#: Task types of the runtime API.
CLIENT_TASK, SERVER_TASK = "flwr-clientapp", "flwr-serverapp"


@dataclass
class Endpoint:
    """A runtime API to work for: ``host:port``, TLS root certificate, SuperExec secret."""

    address: str
    root_certificates: bytes | None = None
    secret: bytes | None = None

    @property
    def insecure(self) -> bool:
        """No TLS root certificate: plain HTTP."""
        return self.root_certificates is None


#: How :func:`run_client_task` begins a failure to deliver a task's reply.
UNDELIVERED = "the reply could not be delivered"


def _runtime_client(endpoint: Endpoint, interceptors: list, tries: int, seconds: float):
    """Connect to a runtime API, giving up after ``tries`` / ``seconds``.

    Flower's HTTP invoker retries for ever; a local runtime API that went away must surface
    as an error instead (the caller then checks whether its Flower process died). A 401 (the
    runtime API voided the task's token, or another process with another secret now holds
    the port of a SuperNode that stopped) fails the call: Flower's invoker SIGINTs the
    process instead, which would stop a warm node or a coordinator.
    """
    import httpx
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    invoker = make_simple_http_retry_invoker()
    invoker.max_tries = tries
    invoker.max_time = seconds
    flower_giveup = invoker.should_giveup

    def should_giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError) \
                and exc.response.status_code == httpx.codes.UNAUTHORIZED:
            return True
        return flower_giveup(exc)

    invoker.should_giveup = should_giveup
    return RuntimeHttpClient.from_server_address(
        server_address=endpoint.address, insecure=endpoint.insecure,
        root_certificates=endpoint.root_certificates, interceptors=interceptors,
        retry_invoker=invoker)


class TaskSource:
    """Acquire tasks of one type from a runtime API (what ``flower-superexec`` polls).

    Parameters
    ----------
    endpoint : Endpoint
        The SuperLink's or SuperNode's runtime API.
    task_type : str
        :data:`CLIENT_TASK` or :data:`SERVER_TASK`.
    """

    def __init__(self, endpoint: Endpoint, task_type: str) -> None:
        from flwr.supercore.interceptors import (
            RuntimeVersionHttpInterceptor,
            SuperExecAuthHttpInterceptor,
        )

        self.endpoint = endpoint
        self.task_type = task_type
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if endpoint.secret:
            interceptors.append(SuperExecAuthHttpInterceptor(
                master_secret=endpoint.secret,
                protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
        self._client = _runtime_client(endpoint, interceptors, tries=2, seconds=5.0)

    def acquire(self):
        """``(token, task)`` of a waiting task (``task.run_id`` its run), or ``None``."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611

        res = self._client.AcquireTask(AcquireTaskRequest(supported_task_types=[self.task_type]))
        if res.HasField("task") and res.token:
            return res.token, res.task
        return None

    def close(self) -> None:
        """Close the connection."""
        self._client.close()


def _task_heartbeat_fn(client) -> Callable[[], bool]:
    """Return a task heartbeat function that never interrupts this process.

    Flower's (``make_task_heartbeat_fn_http``) raises SIGINT in the process when the runtime
    API no longer knows the task: right for a ``flwr-clientapp`` process of that one task,
    but a warm node would exit 130 (for example when its SuperNode gives up on a lost
    coordinator). Here the task just goes on; its next call to the runtime API fails.
    """
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611

    def fn() -> bool:
        try:
            res = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as err:
            if err.response.status_code in (httpx.codes.SERVICE_UNAVAILABLE,
                                            httpx.codes.GATEWAY_TIMEOUT):
                return False
            raise
        if not res.success:
            log.debug("the runtime API no longer knows this task")
        return True

    return fn


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
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    client = _runtime_client(
        endpoint, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                   RuntimeTokenHttpInterceptor(token)], tries=20, seconds=60.0)
    heartbeat = HeartbeatSender(_task_heartbeat_fn(client))
    heartbeat.start()
    message = reply = context = None
    status, details, failure = SubStatus.FAILED, "ClientApp task failed", "task failed"
    try:
        message, context, _run, _fab = pull_task_input(client)  # the FAB is never imported
        reply = app(message=message, context=context)
        status, details, failure = SubStatus.COMPLETED, "", None
    except Exception as exc:  # noqa: BLE001 - reported to the coordinator as an error reply
        details = f"{type(exc)}:<'{exc}'>"
        failure = f"{type(exc).__name__}: {exc}"
        log.error("task failed: %s", failure)
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                            reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        except Exception as exc:  # noqa: BLE001 - the SuperNode voided the task or went away
            log.debug("could not deliver the task's reply: %s", exc)
            failure = failure or f"{UNDELIVERED} ({type(exc).__name__})"
        finally:
            heartbeat.stop()
            client.close()
    return failure


def run_server_task(endpoint: Endpoint, token: str, main: Callable[[object, object], None],
                    alive: Callable[[], bool] | None = None) -> None:
    """Run one ServerApp task in this process, as ``flwr-serverapp`` would.

    ``main(grid, context)`` is called with Flower's HTTP Grid bound to the run. The task's
    final status (completed or failed, with the error) is pushed back either way. With
    ``alive`` (whether the SuperLink process runs), a request to a SuperLink that has
    stopped fails at once, where Flower's retries would wait for it for ever.

    Raises
    ------
    Exception
        Whatever ``main`` raised, after the status was pushed.
    """
    from flwr.app import RecordDict
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
    if alive is not None:
        invoker = grid._retry_invoker  # noqa: SLF001 - the runtime client's too
        giveup = invoker.should_giveup
        invoker.should_giveup = lambda exc: not alive() or bool(giveup and giveup(exc))
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
        if heartbeat.is_running:  # before the token is void: a heartbeat with it SIGINTs us
            heartbeat.stop()
        try:
            if context is not None:
                context.state = RecordDict()
            runtime.PushTaskOutput(PushTaskOutputRequest(
                context=context_to_proto(context) if context else None,
                sub_status=status, details=details))
        except Exception as exc:  # noqa: BLE001 - the SuperLink may already be gone
            log.debug("could not push the task output: %s", exc)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            grid.close()
