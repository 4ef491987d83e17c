"""The Flower processes a role owns, their private folder and secret, and addresses.

A SuperLink or SuperNode child is started in its own session, dies with its parent
(``PR_SET_PDEATHSIG``), and is stopped (SIGTERM, then SIGKILL) on every exit path; the
signal handlers of the CLI stop every one still running (:func:`stop_all`). Its private
folder (:class:`fedavg.util.tempdirs.PrivateDir`) goes too, even when its owner was killed
outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from fedavg import flower_compat
from fedavg.engines.deployment.certs import host_problem
from fedavg.util.errors import UserError
from fedavg.util.tempdirs import PrivateDir as PrivateDir  # the roles' folders
from fedavg.util.tempdirs import remove_all

log = logging.getLogger("fedavg")

DEFAULT_ADDRESS = "127.0.0.1:9092"

_ACTIVE: list[FlowerProcess] = []
_COMMANDS: list[subprocess.Popen] = []  # whole fedavg commands started by this one (--gpus)


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (``preexec_fn``).

    SIGTERM, so that a SuperNode whose parent was killed still signs off at the SuperLink.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def signal_name(returncode: int | None) -> str | None:
    """``SIGKILL`` for a process killed by signal 9 (return code -9); else ``None``."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


class FlowerProcess:
    """A Flower SuperLink or SuperNode child: output kept and filtered, stopped on exit.

    Parameters
    ----------
    name : str
        ``superlink`` or ``supernode`` (see :mod:`fedavg.engines.deployment.launch`).
    args : list of str
        Its command-line arguments.
    env : dict
        Environment.
    echo : callable, optional
        Called with each (ANSI-free, non-blank) output line.
    """

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, name: str, args: list[str], env: dict[str, str], echo=None) -> None:
        self.name = name
        self.lines: deque[str] = deque(maxlen=200)
        self.echo = echo
        # FEDAVG_FLOWER_LOG=DIR keeps every line of Flower's output in DIR/<name>-<pid>.log
        log_dir = os.environ.get("FEDAVG_FLOWER_LOG")
        try:
            self.log_file = (open(Path(log_dir) / f"{name}-{os.getpid()}.log", "a")
                             if log_dir else None)
        except OSError as exc:
            raise UserError(f"FEDAVG_FLOWER_LOG={log_dir}: {exc.strerror}; give an existing "
                            "folder or unset it") from None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedavg.engines.deployment.launch", name, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=die_with_parent, text=True,
            errors="replace", bufsize=1)
        _ACTIVE.append(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

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

    def ended(self) -> str:
        """How the process ended: ``was killed (SIGKILL)`` or ``exited with code N``."""
        code = self.proc.poll()
        name = signal_name(code)
        return f"was killed ({name})" if name else f"exited with code {code}"

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        """Return the exit code once it has exited (``-N``: killed by signal N), else ``None``."""
        return self.proc.poll()

    def last_error(self) -> str:
        """Return the most telling recent output line (an error if there is one)."""
        return flower_compat.most_telling_line(self.lines) or f"{self.name} exited"

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


def start_command(args: list[str]) -> subprocess.Popen:
    """Start ``python -m fedavg.cli ARGS`` (e.g. a node per GPU); :func:`stop_all` stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli", *args],
                            preexec_fn=die_with_parent)
    _COMMANDS.append(proc)
    return proc


def stop_commands(timeout_s: float = 15.0) -> None:
    """SIGTERM the commands of :func:`start_command` and wait for them to clean up.

    Each removes its own folders and Flower processes on SIGTERM; one still running after
    ``timeout_s`` seconds is killed. Safe in a signal handler that interrupted a wait on
    them (waits by pid, not through :class:`subprocess.Popen`'s lock).
    """
    procs = list(_COMMANDS)
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        if not _reap(proc, deadline - time.monotonic()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            _reap(proc, 5.0)
        _COMMANDS.remove(proc)


def _reap(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``proc`` to exit; ``True`` once it has."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return True
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stop_all() -> None:
    """Stop every command and Flower process this process started; remove its folders.

    The CLI's signal handlers call this before they exit.
    """
    stop_commands()
    for proc in list(_ACTIVE):
        proc.stop(timeout_s=5.0)
    remove_all()


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Return the environment for a Flower child: its own ``FLWR_HOME``, no telemetry."""
    env = dict(os.environ)
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def secret_file(folder: Path) -> tuple[Path, bytes]:
    """Write a new SuperExec secret (32 random bytes, mode 600); return its path and value."""
    secret = secrets.token_bytes(32)
    path = folder / "superexec.secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path, secret


# --------------------------------------------------------------------------- addresses


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str, flag: str = "--address") -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) to ``(host, port)``.

    Raises
    ------
    UserError
        Not ``host:port`` with a port in 1..65535 and a host name or IP address as host
        (``http://...``, spaces).
    """
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", address)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise UserError(f"{flag} {address!r} is not host:port (e.g. 127.0.0.1:9092)")
    problem = host_problem(m.group(1))
    if problem:
        raise UserError(f"{flag} {address!r}: {m.group(1)!r} {problem}")
    return m.group(1), int(m.group(2))


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


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
