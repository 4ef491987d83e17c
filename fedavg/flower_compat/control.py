"""The SuperLink's Control API: wait for it, register node keys, submit a run (a FAB)."""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from fedavg.flower_compat.logs import is_certificate_failure
from fedavg.util.errors import RunError


class CertificateRejected(RuntimeError):
    """TLS verification of the SuperLink's certificate failed (message: the first line)."""


def control_client(address: str, ca_cert: Path | None):
    """Connect to the SuperLink's Control API at ``address`` (TLS unless ``ca_cert`` is None)."""
    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection

    conn = SuperLinkConnection(
        name="fedavg", address=address,
        root_certificates=None if ca_cert is None else str(Path(ca_cert).resolve()),
        insecure=ca_cert is None)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Using SuperLink: ..."
        return init_http_client_from_connection(conn)


def wait_control_ready(address: str, ca_cert: Path | None, check_alive: Callable[[], None],
                       timeout_s: float = 60.0):
    """Poll the Control API until it answers; return a client for it.

    Parameters
    ----------
    address, ca_cert
        As for :func:`control_client`.
    check_alive : callable
        Called before every try; raises to stop waiting (the SuperLink died).
    timeout_s : float
        Seconds to wait.

    Raises
    ------
    CertificateRejected
        The SuperLink's certificate does not verify against ``ca_cert``.
    TimeoutError
        No answer within ``timeout_s``; the message is the last error's first line.
    """
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        check_alive()
        client = None
        try:
            client = control_client(address, ca_cert)
            client.ListRuns(ListRunsRequest())
            return client
        except Exception as exc:  # noqa: BLE001 - not listening yet
            if client is not None:
                client.close()
            last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if is_certificate_failure(str(exc)):
                raise CertificateRejected(last) from None
            time.sleep(0.3)
    raise TimeoutError(last)


def register_node_keys(client, keys: Iterable[bytes]) -> None:
    """Allow the SuperNodes holding these public keys (PEM) in (``--enable-supernode-auth``)."""
    from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611

    for key in keys:
        client.RegisterNode(RegisterNodeRequest(public_key=key))


def start_run(client, app_dir: Path) -> int:
    """Build the FAB of the app in ``app_dir``, start a run of it and return its run id.

    Raises
    ------
    RunError
        The SuperLink gave no run id.
    """
    import hashlib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.serde import fab_to_proto
    from flwr.proto.control_pb2 import StartRunRequest  # pylint: disable=E0611
    from flwr.supercore.fab import Fab

    with warnings.catch_warnings():  # pathspec's deprecation notes, made visible by
        warnings.simplefilter("ignore", DeprecationWarning)  # flwr.simulation's filter
        fab_bytes = build_fab_from_disk(app_dir)
    fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
    res = client.StartRun(StartRunRequest(fab=fab_to_proto(fab)))
    if not res.HasField("run_id"):
        raise RunError("the SuperLink refused to start the run")
    return int(res.run_id)
