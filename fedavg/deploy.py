"""Training across machines on Flower's deployment engine: ``fedavg coordinator`` / ``node``.

The coordinator starts a Flower SuperLink (``--isolation process``), submits the run through
its Control API as a FAB whose run config holds every training setting, and runs our
ServerApp for it in its own process (:func:`fedavg.runtime.run_server_task`). A node starts
a Flower SuperNode (``--isolation process``) and runs every ClientApp task of every run in
its own long-lived process (:func:`fedavg.runtime.run_client_task`): torch is imported and
the data loaded once, not once per round.

Both roles own their Flower process: it is started in its own session, dies with its
parent (``PR_SET_PDEATHSIG``), and is stopped (SIGTERM, then SIGKILL) on every exit path.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from fedavg.config import RunConfig
from fedavg.errors import RunError, UserError

if TYPE_CHECKING:
    from fedavg.simulation import SimulationResult

log = logging.getLogger("fedavg")

DEFAULT_ADDRESS = "127.0.0.1:9092"
#: A ``--once`` node gives up on a run whose coordinator stays unreachable this long (s).
LOST_AFTER_S = 30.0
#: Files written by ``fedavg certs``.
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "coordinator.crt", "coordinator.key"
AUTH_KEYS = "authorized-nodes.pub"

_ACTIVE: list["FlowerProcess"] = []
#: The run folder of the coordinator running in this process (for interrupt messages).
RUN_OUTPUT: list[Path] = []
CERT_HINT = ("the coordinator cannot verify its own certificate: --certs must hold a "
             "coordinator.crt signed by its ca.crt and valid for {host} (make one with "
             "`fedavg certs DIR --host {host}`)")


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # SIGTERM, so that a SuperNode whose parent was killed still signs off at the SuperLink
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class FlowerProcess:
    """A Flower SuperLink or SuperNode child: output kept and filtered, stopped on exit.

    Parameters
    ----------
    name : str
        ``superlink`` or ``supernode`` (see :mod:`fedavg._launch`).
    args : list of str
        Its command-line arguments.
    env : dict
        Environment.
    echo : callable, optional
        Called with each output line that should be shown to the user.
    """

    def __init__(self, name: str, args: list[str], env: dict[str, str], echo=None) -> None:
        self.name = name
        self.lines: deque[str] = deque(maxlen=200)
        self.echo = echo
        # FEDAVG_FLOWER_LOG=DIR keeps every line of Flower's output in DIR/<name>-<pid>.log
        log_dir = os.environ.get("FEDAVG_FLOWER_LOG")
        self.log_file = (open(Path(log_dir) / f"{name}-{os.getpid()}.log", "a")
                         if log_dir else None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedavg._launch", name, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=_die_with_parent, text=True,
            errors="replace", bufsize=1)
        _ACTIVE.append(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = self._ANSI.sub("", raw.rstrip())
            if not line.strip():
                continue
            self.lines.append(line)
            log.debug("%s: %s", self.name, line)
            if self.log_file is not None:
                print(line, file=self.log_file, flush=True)
            if self.echo is not None:
                try:
                    self.echo(line)
                except Exception as exc:  # noqa: BLE001 - never stop reading the pipe
                    log.debug("echo: %s", exc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_error(self) -> str:
        """The most telling recent output line (an error if there is one)."""
        for line in reversed(self.lines):
            if "ERROR" in line or "Error" in line or "error" in line:
                return line.split(":", 1)[-1].strip() if line.startswith(("ERROR", "WARNING")) \
                    else line.strip()
        return self.lines[-1].strip() if self.lines else f"{self.name} exited"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout_s``."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._reader.join(2)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


def stop_all() -> None:
    """Stop every Flower process this process started (signal handlers call this)."""
    for proc in list(_ACTIVE):
        proc.stop(timeout_s=5.0)


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Fail early when another program (another coordinator?) listens on ``host:port``.

    Raises
    ------
    UserError
        The port is taken, or ``host`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as the SuperLink's server does: connections of a previous run in TIME_WAIT are fine
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == 98:
                raise UserError(f"--address {join_address(host, port)} is in use (another "
                                "coordinator?); stop it or choose another port") from None
            raise UserError(f"cannot listen on {join_address(host, port)}: {exc.strerror}; "
                            "give an address of this machine, or 0.0.0.0") from None


def check_server_certs(certs: Path) -> None:
    """Check that the coordinator's certificate and key load and belong together.

    Raises
    ------
    UserError
        A file is not PEM, or the key does not match the certificate.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate((certs / SERVER_CERT).read_bytes())
    except ValueError:
        raise UserError(f"{certs / SERVER_CERT} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key((certs / SERVER_KEY).read_bytes(), None)
    except (ValueError, TypeError):
        raise UserError(f"{certs / SERVER_KEY} is not an unencrypted PEM private key") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*fmt) != cert.public_key().public_bytes(*fmt):
        raise UserError(f"{certs / SERVER_KEY} is not the key of {certs / SERVER_CERT}")


def check_node_key(path: Path) -> None:
    """Check that ``path`` is a node private key (OpenSSH, EC on a NIST curve).

    Raises
    ------
    UserError
        Missing, or not such a key (e.g. a public key).
    """
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    if not path.is_file():
        raise UserError(f"--auth-key {path} does not exist")
    try:
        key = load_ssh_private_key(path.read_bytes(), None)
    except Exception:  # noqa: BLE001 - any parse failure means: not a usable key
        key = None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UserError(f"--auth-key {path} is not a node private key (node-<i>.key from "
                        "`fedavg certs DIR --nodes N`)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_address(address: str, flag: str = "--address") -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) to ``(host, port)``.

    Raises
    ------
    UserError
        Not ``host:port`` with a port in 1..65535.
    """
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", address.strip())
    if not m or not 0 < int(m.group(2)) < 65536:
        raise UserError(f"{flag} {address!r} is not host:port (e.g. 127.0.0.1:9092)")
    return m.group(1), int(m.group(2))


def _private_dir(prefix: str) -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    os.chmod(tmp.name, 0o700)
    return tmp


def _env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _secret_file(folder: Path) -> tuple[Path, bytes]:
    secret = secrets.token_bytes(32)
    path = folder / "superexec.secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path, secret


def resolve_certs(certs: Path | None, insecure: bool, role: str) -> Path | None:
    """The certificate folder to use, or ``None`` with ``insecure``.

    Raises
    ------
    UserError
        Neither given, both given, or files missing.
    """
    if insecure:
        if certs is not None:
            raise UserError("give either --certs or --insecure, not both")
        return None
    if certs is None:
        raise UserError(f"TLS is on by default: pass --certs DIR (make one with `fedavg certs "
                        f"DIR`), or --insecure to run the {role} without TLS")
    need = [CA_CERT] + ([SERVER_CERT, SERVER_KEY] if role == "coordinator" else [])
    missing = [n for n in need if not (certs / n).is_file()]
    if missing:
        raise UserError(f"--certs {certs} lacks {', '.join(missing)}; make them with "
                        f"`fedavg certs {certs}`")
    return certs


# --------------------------------------------------------------------------- coordinator


def _reporter(console, insecure: bool):
    """``say(text)``: print rich markup to ``console`` (unwrapped) and log it; warns first
    when the traffic is not encrypted."""
    def say(text: str) -> None:
        if console is not None:
            console.print(text, highlight=False, soft_wrap=True)
        log.info(re.sub(r"\[/?[a-z ]*\]", "", text))

    if insecure:
        say("[yellow]warning:[/] --insecure: traffic between coordinator and nodes is NOT "
            "encrypted")
    return say


def write_app(folder: Path, config: RunConfig) -> Path:
    """Write the Flower app (``pyproject.toml``) whose FAB carries the run's settings.

    The FAB names our apps as components and holds no code: nodes run the installed
    ``fedavg``. Its ``[tool.flwr.app.config]`` is the run config the nodes read.
    """
    def toml_value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    from fedavg import __version__

    lines = [
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", 'name = "fedavg-run"', f'version = "{__version__}"',
        'description = "A fedavg run"', 'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fedavg"', "",
        "[tool.flwr.app.components]", 'serverapp = "fedavg.apps:server_app"',
        'clientapp = "fedavg.apps:client_app"', "",
        "[tool.flwr.app.config]",
    ]
    lines += [f'"{k}" = {toml_value(v)}' for k, v in sorted(config.to_flat().items())]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return folder


def _control_client(address: str, certs: Path | None):
    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection

    conn = SuperLinkConnection(
        name="fedavg", address=address,
        root_certificates=None if certs is None else str((certs / CA_CERT).resolve()),
        insecure=certs is None)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Using SuperLink: ..."
        return init_http_client_from_connection(conn)


def _wait_ready(link: FlowerProcess, address: str, certs: Path | None, host: str,
                timeout_s: float = 60.0):
    """Wait for the SuperLink's Control API; return a client for it."""
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not link.alive():
            raise UserError(f"the SuperLink could not start: {link.last_error()}")
        client = None
        try:
            client = _control_client(address, certs)
            client.ListRuns(ListRunsRequest())
            return client
        except Exception as exc:  # noqa: BLE001 - not listening yet
            if client is not None:
                client.close()
            last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
                raise UserError(CERT_HINT.format(host=host) + f" ({last})") from None
            time.sleep(0.3)
    raise RunError(f"the SuperLink did not answer on {address} within {timeout_s:g} s ({last})")


def load_auth_keys(path: Path) -> list[bytes]:
    """Public keys (OpenSSH ``ecdsa-sha2-nistp384 ...`` lines) of the nodes allowed in.

    ``path`` is a file with one key per line, or a folder of ``*.pub`` files.

    Raises
    ------
    UserError
        Missing path, no key, or a line that is not a NIST-curve EC public key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not path.exists():
        raise UserError(f"--auth-keys {path} does not exist")
    files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
    keys: list[bytes] = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                key = serialization.load_ssh_public_key(line.strip().encode())
            except Exception as exc:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm ...
                raise UserError(f"{f}:{n} is not an OpenSSH public key "
                                f"({str(exc).splitlines()[0][:80] if str(exc) else exc!r})"
                                ) from None
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise UserError(f"{f}:{n} is not an EC public key (make keys with "
                                "`fedavg certs DIR --nodes N`)")
            pem = key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)
            if pem not in keys:
                keys.append(pem)
    if not keys:
        raise UserError(f"--auth-keys {path} holds no public key")
    return keys


def coordinate(
    config: RunConfig,
    *,
    output: Path | None = None,
    address: str = DEFAULT_ADDRESS,
    certs: Path | None = None,
    insecure: bool = False,
    auth_keys: Path | None = None,
    min_nodes: int = 2,
    min_nodes_per_round: int | None = None,
    wait_timeout: float = 300.0,
    overwrite: bool = False,
    console=None,
) -> "SimulationResult":
    """Run the coordinator of one run across machines and save the merged model.

    Parameters
    ----------
    config : RunConfig
        Run settings (``num_nodes`` is replaced by ``min_nodes``).
    output : path, optional
        Run folder (default ``runs/<timestamp>``); same files as ``fedavg simulate``.
    address : str
        ``host:port`` the SuperLink listens on (nodes connect here). ``0.0.0.0:PORT`` to
        accept other machines.
    certs : path, optional
        Folder from ``fedavg certs`` (``ca.crt``, ``coordinator.crt``, ``coordinator.key``).
    insecure : bool
        No TLS (only when asked for; warns).
    auth_keys : path, optional
        Node public keys allowed to connect (Flower's SuperNode authentication).
    min_nodes : int
        Nodes to wait for before round 1.
    min_nodes_per_round : int, optional
        Usable replies each round needs (default: half the nodes a round samples,
        ``fraction x min_nodes``, rounded up).
    wait_timeout : float
        Seconds to wait for nodes before failing with a clear error.
    overwrite : bool
        Allow ``output`` to hold a previous run.
    console : rich.console.Console, optional
        Where to print progress.

    Returns
    -------
    fedavg.simulation.SimulationResult
        As from ``fedavg simulate``, with the Flower ``run_id``; ``wall_s`` includes
        waiting for nodes.

    Raises
    ------
    UserError
        Bad settings, certificates, keys or address (nothing is written).
    RunError
        Too few nodes in time, or a round without enough usable models; finished rounds
        stay saved.
    """
    from fedavg import runtime
    from fedavg.coordinator import Deployment, RunState, make_server_app
    from fedavg.simulation import (
        SimulationResult,
        _progress,
        _quiet_logs,
        _write_summary,
        check_output,
        make_output,
        prepare,
    )

    t0 = time.monotonic()
    if min_nodes < 1:
        raise UserError(f"--min-nodes must be at least 1, got {min_nodes}")
    if wait_timeout <= 0:
        raise UserError(f"--wait-timeout must be > 0 seconds, got {wait_timeout:g}")
    config = config.replace(num_nodes=min_nodes).validate()
    per_round = (min_nodes_per_round if min_nodes_per_round is not None
                 else max(1, -(-config.nodes_per_round // 2)))
    if not 1 <= per_round <= min_nodes:
        raise UserError(f"--min-nodes-per-round must be in 1..--min-nodes ({min_nodes}), "
                        f"got {per_round}")
    host, port = split_address(address)
    certs = resolve_certs(certs, insecure, "coordinator")
    if certs is not None:
        check_server_certs(certs)
    keys_pem = load_auth_keys(auth_keys) if auth_keys is not None else None
    if keys_pem is not None and certs is None:
        raise UserError("--auth-keys needs TLS: pass --certs, not --insecure")
    from fedavg.train import resolve_device

    resolve_device(config.train.device)
    if output is not None:
        check_output(Path(output), overwrite)
    runtime.check_flower_internals()
    runtime.patch_pull_backoff()
    prepared = prepare(config)
    check_port_free(host, port)
    _quiet_logs(False)
    say = _reporter(console, certs is None)
    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    connect = join_address(local, port)
    state = RunState()
    tmp = _private_dir("fedavg-coordinator-")
    link = None
    try:
        home = Path(tmp.name)
        secret_path, secret = _secret_file(home)
        args = ["--isolation", "process", "--host", host, "--port", str(port),
                "--superexec-auth-secret-file", str(secret_path),
                "--disable-runtime-dependency-installation"]
        if certs is None:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(certs / CA_CERT),
                     "--ssl-certfile", str(certs / SERVER_CERT),
                     "--ssl-keyfile", str(certs / SERVER_KEY)]
        if keys_pem is not None:
            args.append("--enable-supernode-auth")

        def echo(line: str) -> None:
            if re.search(r"ERROR|address already in use|Errno", line) and \
                    "ClientDisconnect" not in line:
                say(f"[red]superlink:[/] {escape(line[:160])}")

        link = FlowerProcess("superlink", args, _env(home), echo=echo)
        control = _wait_ready(link, connect, certs, local)
        out = make_output(output)  # only once the SuperLink runs: a failed start writes nothing
        RUN_OUTPUT[:] = [out]
        say(f"coordinator listening on [bold]{join_address(host, port)}[/] "
            f"({'TLS' if certs else 'NO TLS'}{', node authentication' if keys_pem else ''})")
        if keys_pem is not None:
            from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611

            for key in keys_pem:
                control.RegisterNode(RegisterNodeRequest(public_key=key))
            say(f"{len(keys_pem)} node key(s) registered")
        run_id = _start_run(control, write_app(home / "app", config))
        control.close()
        if console is not None:
            for note in prepared.data.notes:
                console.print(f"[yellow]note:[/] {note}")
        say(f"run {run_id}: model [bold]{prepared.spec.name}[/], strategy "
            f"[bold]{config.merge.strategy}[/], {config.merge.rounds} rounds; waiting for "
            f"{min_nodes} node(s) (up to {wait_timeout:g} s)")

        known: list[int] = []

        def on_nodes(nodes: list[int]) -> None:
            joined = [n for n in nodes if n not in known]
            left = [n for n in known if n not in nodes]
            known[:] = nodes
            change = ", ".join([f"+{n}" for n in joined] + [f"-{n}" for n in left])
            say(f"{len(nodes)} node(s) connected ({change})")

        deployment = Deployment(min_nodes=min_nodes, wait_timeout=wait_timeout,
                                min_nodes_per_round=per_round, on_nodes=on_nodes)
        progress, on_round, on_failure = _progress(console, config)
        server = make_server_app(config, prepared.spec, prepared.data.test, prepared.meta, out,
                                 state, on_round=on_round, on_failure=on_failure,
                                 validation=prepared.validation,
                                 distill_x=prepared.distill_x, deployment=deployment)
        endpoint = runtime.Endpoint(
            connect, None if certs is None else (certs / CA_CERT).read_bytes(), secret)
        token = _acquire_server_task(endpoint, run_id, link)
        try:
            if progress is not None:
                progress.start()
            runtime.run_server_task(endpoint, token, server)
        except (RunError, UserError):
            raise
        except Exception as exc:
            if state.error is not None and isinstance(state.error, (RunError, UserError)):
                raise state.error from None
            raise RunError(f"the run failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                           ) from exc
        finally:
            if progress is not None:
                progress.stop()
    finally:
        if link is not None:
            link.stop()
        tmp.cleanup()
    if len(state.rounds) != config.merge.rounds:
        raise RunError(f"the run stopped after {len(state.rounds)} of {config.merge.rounds} "
                       f"rounds; finished rounds are in {out}")
    wall = time.monotonic() - t0
    last = state.rounds[-1]
    summary = SimulationResult(accuracy=last.accuracy, loss=last.loss,
                               rounds=[r.as_dict() for r in state.rounds], output=out,
                               wall_s=round(wall, 3), num_nodes=min_nodes,
                               failures=state.failures, run_id=run_id)
    _write_summary(summary, prepared, config)
    if console is not None:
        from fedavg.simulation import rounds_table

        console.print(rounds_table(summary.rounds))
        console.print(f"[bold green]done[/] in {wall:.1f} s: test accuracy "
                      f"[bold]{last.accuracy:.4f}[/], loss {last.loss:.4f}; model saved in "
                      f"[bold]{out}[/]")
    return summary


def _start_run(control, app_dir: Path) -> int:
    import hashlib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.serde import fab_to_proto
    from flwr.proto.control_pb2 import StartRunRequest  # pylint: disable=E0611
    from flwr.supercore.fab import Fab

    fab_bytes = build_fab_from_disk(app_dir)
    fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
    res = control.StartRun(StartRunRequest(fab=fab_to_proto(fab)))
    if not res.HasField("run_id"):
        raise RunError("the SuperLink refused to start the run")
    return int(res.run_id)


def _acquire_server_task(endpoint, run_id: int, link: FlowerProcess,
                         timeout_s: float = 60.0) -> str:
    from fedavg import runtime

    source = runtime.TaskSource(endpoint, "flwr-serverapp")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not link.alive():
                raise RunError(f"the SuperLink stopped: {link.last_error()}")
            try:
                got = source.acquire()
            except Exception as exc:  # noqa: BLE001 - checked against the SuperLink next
                log.debug("acquire: %s", exc)
                got = None
            if got is not None:
                token, task = got
                if int(task.run_id) == run_id:
                    return token
                log.warning("ignoring task of run %s, which this coordinator did not submit",
                            task.run_id)
            time.sleep(0.1)
    finally:
        source.close()
    raise RunError(f"the SuperLink did not hand over run {run_id} within {timeout_s:g} s")


# --------------------------------------------------------------------------- node

_REFUSED = (
    (re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|unknown ca|"
                r"hostname mismatch|IP address mismatch", re.I),
     "the coordinator's TLS certificate is not signed by --certs/ca.crt or does not name "
     "this address; use the ca.crt of the coordinator's `fedavg certs` folder"),
    (re.compile(r"SuperNodes must be registered", re.I),
     "the coordinator only accepts known nodes: pass --auth-key with a node key listed in "
     "its --auth-keys"),
    (re.compile(r"Failed to activate SuperNode|PERMISSION_DENIED|UNAUTHENTICATED|"
                r"Public key not recognized", re.I),
     "the coordinator refused this node's key: add its public key to the coordinator's "
     "--auth-keys, or pass the right --auth-key"),
)


def node_refusal(line: str) -> str | None:  # noqa: D401
    """A clear reason when a SuperNode output line says the coordinator refused it."""
    for pattern, reason in _REFUSED:
        if pattern.search(line):
            return reason
    return None


def serve_node(
    coordinator: str,
    *,
    dataset: str = "digits",
    partition_id: int | None = None,
    num_partitions: int | None = None,
    device: str = "auto",
    certs: Path | None = None,
    insecure: bool = False,
    auth_key: Path | None = None,
    once: bool = False,
    max_wait_time: float | None = None,
    console=None,
) -> int:
    """Run one node: a Flower SuperNode plus a warm process that trains every task.

    Parameters
    ----------
    coordinator : str
        ``host:port`` of ``fedavg coordinator``.
    dataset : str
        The node's data: ``digits``, a local path or a hub id.
    partition_id, num_partitions : int, optional
        Train on partition ``partition_id`` of ``num_partitions`` of ``dataset`` (split as
        ``fedavg simulate`` would with the run's partitioner); default: all of it.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    certs : path, optional
        Folder holding the coordinator's CA certificate ``ca.crt``.
    insecure : bool
        No TLS (only when asked for; warns).
    auth_key : path, optional
        This node's private key (from ``fedavg certs --nodes``) for SuperNode authentication.
    once : bool
        Exit after the first run ends; by default the node serves runs until stopped.
    max_wait_time : float, optional
        Give up after this many seconds without reaching the coordinator (default: retry
        for ever, with backoff).
    console : rich.console.Console, optional
        Where to print progress.

    Returns
    -------
    int
        Number of training tasks run.

    Raises
    ------
    UserError
        Bad options, missing data or certificates, or the coordinator refused the node.
    RunError
        The SuperNode stopped for another reason.
    """
    from fedavg import runtime
    from fedavg.data import looks_like_path
    from fedavg.train import resolve_device

    host, port = split_address(coordinator, "--coordinator")
    if (partition_id is None) != (num_partitions is None):
        raise UserError("give --partition-id and --num-partitions together")
    if num_partitions is not None and num_partitions < 1:
        raise UserError(f"--num-partitions must be at least 1, got {num_partitions}")
    if partition_id is not None and not 0 <= partition_id < num_partitions:
        raise UserError(f"--partition-id must be in 0..{num_partitions - 1}, got {partition_id}")
    if looks_like_path(dataset) and not Path(dataset).expanduser().exists():
        raise UserError(f"--dataset {dataset} does not exist")
    resolve_device(device)
    certs = resolve_certs(certs, insecure, "node")
    if auth_key is not None:
        if certs is None:
            raise UserError("--auth-key needs TLS: pass --certs, not --insecure")
        check_node_key(auth_key)
    if max_wait_time is not None and max_wait_time <= 0:
        raise UserError(f"--max-wait-time must be > 0 seconds, got {max_wait_time:g}")
    runtime.check_flower_internals()
    runtime.patch_pull_backoff()
    from fedavg.apps import FINISHED_RUNS, client_app
    from fedavg.simulation import _quiet_logs

    _quiet_logs(False)
    say = _reporter(console, certs is None)
    status: dict[str, Any] = {"connected": False, "refused": None, "quiet": False,
                              "exit": None, "unreachable_since": None, "hinted": False}

    def echo(line: str) -> None:
        reason = node_refusal(line)
        if m := re.search(r"Exit Code: (\d+)", line):
            status["exit"] = int(m.group(1))  # Flower is shutting the SuperNode down
        if reason:
            if status["refused"] is None:
                status["refused"] = (reason, line.strip()[:200])
            return
        if "Connection attempt failed" in line:
            status["unreachable_since"] = status["unreachable_since"] or time.monotonic()
        elif "Connection successful" in line:
            status["unreachable_since"] = None
        if certs is None and "disconnected without sending a response" in line \
                and not status["hinted"]:
            status["hinted"] = True
            say("[yellow]node:[/] the coordinator closed the connection: if it uses TLS, pass "
                "--certs DIR instead of --insecure")
        if "SuperNode ID" in line:
            status["connected"] = True
            say(f"connected to {host}:{port} as node "
                f"[bold]{escape(line.rsplit(':', 1)[-1].strip())}[/]")
        elif status["quiet"]:
            return
        elif m := re.search(r"Connection attempt failed, retrying in ([\d.]+)", line):
            say(f"[yellow]node:[/] cannot reach the coordinator at {host}:{port}; "
                f"retrying in {float(m.group(1)):.1f} s")
        elif re.search(r"Connection successful|Giving up|could not establish|Errno", line):
            say(f"[yellow]node:[/] {escape(line.split(':', 1)[-1].strip())}")

    node_config = [f'dataset="{Path(dataset).expanduser().resolve()}"'
                   if looks_like_path(dataset) else f'dataset="{dataset}"', f'device="{device}"']
    if partition_id is not None:
        node_config += [f"partition-id={partition_id}", f"num-partitions={num_partitions}"]
    tmp = _private_dir("fedavg-node-")
    home = Path(tmp.name)
    secret_path, secret = _secret_file(home)

    def start_supernode() -> tuple[FlowerProcess, Any]:
        status.update(connected=False, refused=None, exit=None, unreachable_since=None)
        rport = free_port()
        args = ["--superlink", f"{host}:{port}", "--isolation", "process",
                "--host", "127.0.0.1", "--port", str(rport),
                "--superexec-auth-secret-file", str(secret_path),
                "--node-config", " ".join(node_config)]
        if certs is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str((certs / CA_CERT).resolve())]
        if auth_key is not None:
            args += ["--auth-supernode-private-key", str(auth_key.resolve())]
        if max_wait_time is not None:
            args += ["--max-wait-time", str(max_wait_time)]
        return (FlowerProcess("supernode", args, _env(home), echo=echo),
                runtime.Endpoint(f"127.0.0.1:{rport}", None, secret))

    proc = None
    source = None
    tasks = 0
    key_retries = 0
    try:
        say(f"node: data [bold]{dataset}[/]"
            + (f" partition {partition_id}/{num_partitions}" if partition_id is not None else "")
            + f", device {device}; connecting to {host}:{port}"
            + (" (TLS)" if certs else " (NO TLS)"))
        proc, endpoint = start_supernode()
        runs: set[int] = set()
        while True:
            lost = (once and runs and status["unreachable_since"] is not None
                    and time.monotonic() - status["unreachable_since"] > LOST_AFTER_S)
            if lost:
                raise RunError(f"lost the coordinator at {host}:{port} during run "
                               f"{', '.join(map(str, runs))} (unreachable for "
                               f"{LOST_AFTER_S:g} s)")
            if status["refused"] is not None or status["exit"] is not None or not proc.alive():
                reason, line = status["refused"] or (node_refusal(" ".join(proc.lines)), "")
                was_connected = status["connected"]
                proc.stop()
                if source is not None:
                    source.close()
                    source = None
                if reason and "Failed to activate" in line and key_retries < 3:
                    # the coordinator registers node keys just after it starts listening
                    key_retries += 1
                    say(f"[yellow]node:[/] the coordinator refused this node's key; it may still "
                        f"be starting: retrying in 3 s ({key_retries}/3)")
                    time.sleep(3.0)
                    proc, endpoint = start_supernode()
                    continue
                if reason:
                    raise UserError(f"refused by {host}:{port}: {reason} (SuperNode: {line})")
                if was_connected and not once:
                    say(f"[yellow]node:[/] lost the coordinator at {host}:{port} (it stopped or "
                        "restarted); reconnecting for the next run")
                    time.sleep(1.0)
                    proc, endpoint = start_supernode()
                    continue
                if was_connected:
                    raise RunError(f"lost the coordinator at {host}:{port} during the run")
                if any("Giving up" in ln for ln in proc.lines):
                    raise RunError(f"could not reach the coordinator at {host}:{port} within "
                                   f"--max-wait-time {max_wait_time:g} s")
                raise RunError(f"the SuperNode stopped: {proc.last_error()}")
            if source is None:
                try:
                    source = runtime.TaskSource(endpoint, "flwr-clientapp")
                except Exception:  # noqa: BLE001 - runtime API not up yet
                    time.sleep(0.1)
                    continue
            try:
                got = source.acquire()
            except Exception as exc:  # noqa: BLE001 - SuperNode starting or stopping
                log.debug("acquire: %s", exc)
                got = None
            if got is None:
                done = runs & FINISHED_RUNS
                if done:
                    runs -= done
                    key_retries = 0
                    if once:
                        status["quiet"] = True
                        time.sleep(1.0)  # let the SuperNode deliver the last acknowledgement
                        say(f"run {', '.join(map(str, done))} finished; exiting (--once)")
                        return tasks
                    say(f"run {', '.join(map(str, done))} finished; waiting for the next run")
                time.sleep(0.05)
                continue
            token, task = got
            if int(task.run_id) not in runs:
                runs.add(int(task.run_id))
                say(f"joined run {task.run_id}")
            # The task runs in a thread so that this loop keeps watching the SuperNode and the
            # coordinator: a task whose coordinator vanished mid-transfer would wait for ever.
            result: list[str | None] = []
            worker = threading.Thread(
                target=lambda ep=endpoint, tk=token: result.append(
                    runtime.run_client_task(ep, tk, client_app)),
                daemon=True)
            worker.start()
            while worker.is_alive() and proc.alive() and status["exit"] is None \
                    and not (once and status["unreachable_since"] is not None and
                             time.monotonic() - status["unreachable_since"] > LOST_AFTER_S):
                worker.join(0.2)
            if worker.is_alive():
                continue  # the checks at the top of the loop say what happened
            failure = result[0] if result else "the task stopped"
            tasks += 1
            if failure is not None:
                say(f"[red]run {task.run_id}: task failed, reported to the coordinator:[/] "
                    f"{escape(failure)}")
    finally:
        if source is not None:
            source.close()
        if proc is not None:
            proc.stop()
        tmp.cleanup()


# --------------------------------------------------------------------------- several GPUs


def plan_gpu_nodes(gpus: str, partition_id: int | None, num_partitions: int | None,
                   cuda_devices: int) -> list[tuple[str, int | None]]:
    """One node per listed GPU: ``(device, partition_id)`` for each.

    Parameters
    ----------
    gpus : str
        Comma-separated CUDA device indices, e.g. ``"0,1,2,3"``.
    partition_id, num_partitions : int, optional
        When given, GPU ``k`` of the list trains on partition ``partition_id + k``.
    cuda_devices : int
        CUDA devices this machine has.

    Raises
    ------
    UserError
        Not a list of distinct indices, an index this machine lacks, or partition ids
        beyond ``num_partitions``.
    """
    try:
        ids = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise UserError(f"--gpus takes GPU indices like 0,1,2,3, got {gpus!r}") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise UserError(f"--gpus takes distinct GPU indices like 0,1,2,3, got {gpus!r}")
    missing = [g for g in ids if g >= cuda_devices]
    if missing:
        raise UserError(f"--gpus lists GPU {missing[0]} but this machine has {cuda_devices} "
                        "CUDA device(s)")
    if partition_id is None:
        return [(f"cuda:{g}", None) for g in ids]
    if num_partitions is None or partition_id + len(ids) > num_partitions:
        raise UserError(f"--gpus starts {len(ids)} nodes on partitions {partition_id}.."
                        f"{partition_id + len(ids) - 1}, beyond --num-partitions {num_partitions}")
    return [(f"cuda:{g}", partition_id + k) for k, g in enumerate(ids)]


def serve_gpu_nodes(gpus: str, *, coordinator: str, dataset: str, partition_id: int | None,
                    num_partitions: int | None, device: str, certs: Path | None,
                    insecure: bool, auth_key: Path | None, once: bool,
                    max_wait_time: float | None, console=None) -> int:
    """Start one ``fedavg node`` process per GPU and wait for them all.

    Returns
    -------
    int
        The worst exit code of the node processes.

    Raises
    ------
    UserError
        Bad ``gpus`` (see :func:`plan_gpu_nodes`), ``--device`` or ``--auth-key`` given too.
    """
    import torch

    if device != "auto":
        raise UserError("--gpus sets each node's device (cuda:<index>); drop --device")
    if auth_key is not None:
        raise UserError("each node needs its own key: with --auth-key, start one node per GPU "
                        "(--device cuda:N --auth-key node-N.key)")
    plan = plan_gpu_nodes(gpus, partition_id, num_partitions, torch.cuda.device_count())
    base = [sys.executable, "-m", "fedavg.cli", "node", "--coordinator", coordinator,
            "--dataset", dataset]
    if certs is not None:
        base += ["--certs", str(certs)]
    if insecure:
        base.append("--insecure")
    if once:
        base.append("--once")
    if max_wait_time is not None:
        base += ["--max-wait-time", str(max_wait_time)]
    procs = []
    try:
        for dev, pid in plan:
            cmd = [*base, "--device", dev]
            if pid is not None:
                cmd += ["--partition-id", str(pid), "--num-partitions", str(num_partitions)]
            if console is not None:
                console.print(f"starting node on {dev}"
                              + (f" (partition {pid})" if pid is not None else ""))
            procs.append(subprocess.Popen(cmd, preexec_fn=_die_with_parent))
        return max(p.wait() for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
            if p.poll() is None:
                p.kill()
