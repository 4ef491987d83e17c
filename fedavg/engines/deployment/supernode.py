"""A node's Flower SuperNode: started, watched through its output, restarted or given up on.

:class:`SuperNode` is the half of ``fedavg node`` (:mod:`fedavg.engines.deployment.node`) that runs
the SuperNode process and its runtime API connection; the node's task loop is the other.
The SuperNode's output is read in another thread (:meth:`SuperNode.on_line`), which only
sets the flags that the loop acts on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from rich.markup import escape

from fedavg import flower_compat
from fedavg.engines.deployment.processes import (
    FlowerProcess,
    flower_env,
    free_port,
    secret_file,
    signal_name,
    split_address,
)
from fedavg.engines.deployment.tls import CA_CERT, certificate_problem, tls_mismatch
from fedavg.util.errors import CommandError, RunError, UserError

log = logging.getLogger("fedavg")

#: A ``--once`` node gives up on a run whose coordinator stays unreachable this long (s),
#: unless ``--max-wait-time`` says otherwise.
LOST_AFTER_S = 30.0
#: A key the coordinator holds as connected may be a node that just stopped (a crash, a
#: container restarted at once): the SuperLink lets it go after two missed heartbeats. A
#: node waits this long (s) before it calls the key in use by another node: the hold, plus
#: time for a replacement started before the old node died, and for slow SuperNode starts.
KEY_IN_USE_WAIT_S = 4 * flower_compat.HEARTBEAT_S


class SuperNode:
    """A node's SuperNode process, what its output says, and its runtime API connection."""

    def __init__(self, superlink: str, node_config: list[str], certs: Path | None,
                 auth_key: Path | None, once: bool, max_wait_time: float | None,
                 say: Callable[[str], None], home: Path) -> None:
        self.superlink, self.node_config = superlink, node_config
        self.certs, self.auth_key = certs, auth_key
        self.once, self.max_wait_time = once, max_wait_time
        self.say, self.home = say, home
        self.secret_path, self.secret = secret_file(home)
        self.proc: FlowerProcess | None = None
        self.endpoint: flower_compat.Endpoint | None = None
        self.source: flower_compat.TaskSource | None = None
        self.key_retries = 0
        self.key_in_use_since: float | None = None  # refused as in use since (monotonic s)
        self.key_wait_said = False
        self.quiet = self.hinted = False
        self.tls_checked = -1e9
        self.waiting = False  # a run ended: quiet about the coordinator until it is back
        self._reset()

    def _reset(self) -> None:
        self.connected = False
        self.refused: tuple[str, str, bool] | None = None  # reason, line, key refused
        self.exit: int | None = None
        self.unreachable_since: float | None = None
        self.lost_said = False  # "lost the coordinator" said since the last connection
        self.connecting_since: float | None = None  # the SuperNode's start
        self.gave_up = False  # Flower's "Giving up": its lines after it say no more than ours

    def start_supernode(self) -> None:
        """Start a SuperNode (on a free local port for its runtime API)."""
        self._reset()
        rport = free_port()
        args = ["--superlink", self.superlink, "--isolation", "process",
                "--host", "127.0.0.1", "--port", str(rport),
                "--superexec-auth-secret-file", str(self.secret_path),
                "--node-config", " ".join(self.node_config)]
        if self.certs is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str((self.certs / CA_CERT).resolve())]
        if self.auth_key is not None:
            args += ["--auth-supernode-private-key", str(self.auth_key.resolve())]
        if self.max_wait_time is not None:
            args += ["--max-wait-time", str(self.max_wait_time)]
        self.proc = FlowerProcess("supernode", args, flower_env(self.home), echo=self.on_line)
        self.endpoint = flower_compat.Endpoint(f"127.0.0.1:{rport}", None, self.secret)

    def on_line(self, line: str) -> None:
        """Read one SuperNode output line: note what it says, tell the user what matters."""
        ev = flower_compat.parse_supernode_line(line)
        if ev.exit_code is not None:
            self.exit = ev.exit_code  # Flower is shutting the SuperNode down
        if ev.started:
            self.connecting_since = time.monotonic()
        self.gave_up = self.gave_up or ev.gave_up
        if ev.refusal:
            if self.refused is None:
                self.refused = (ev.refusal, line.strip()[:200], ev.key_refused)
            return
        if ev.attempt_failed:
            self.unreachable_since = self.unreachable_since or time.monotonic()
            self._check_tls()
        elif ev.reconnected:
            self.unreachable_since, self.lost_said = None, False
        if self.certs is None and ev.dropped and not self.hinted:
            self.hinted = True
            self.say("[yellow]node:[/] the coordinator closed the connection: if it uses TLS, "
                     "pass --certs DIR instead of --insecure")
        if ev.node_id is not None:
            self.connected, self.waiting, self.key_in_use_since = True, False, None
            self.say(f"connected to {self.superlink} as node [bold]{escape(ev.node_id)}[/]")
        elif self.quiet or self.waiting or self.refused is not None or self.gave_up:
            return
        elif ev.retry_in_s is not None and not self.connected:
            self.say(f"[yellow]node:[/] cannot reach the coordinator at {self.superlink}; "
                     f"retrying in {ev.retry_in_s:.1f} s")
        elif ev.retry_in_s is not None and not self.lost_said:  # once, not at every retry
            self.lost_said = True
            self.say(f"[yellow]node:[/] lost the coordinator at {self.superlink}; retrying "
                     + (f"for up to {self.lost_after_s:g} s" if self.once else
                        "until it is back"))
        elif ev.notable:
            self.say(f"[yellow]node:[/] {escape(ev.message)}")

    def _check_tls(self, every_s: float = 5.0) -> None:
        """Refuse at once when the node's TLS choice differs from the coordinator's.

        Checked on a failed connection attempt, at most every ``every_s`` seconds: without
        it the SuperNode would retry for ever.
        """
        if time.monotonic() - self.tls_checked < every_s or self.refused is not None:
            return
        self.tls_checked = time.monotonic()
        host, port = split_address(self.superlink, "--coordinator")
        mismatch = tls_mismatch(host, port, insecure=self.certs is None)
        if mismatch:
            self.refused = (mismatch, "", False)

    @property
    def lost_after_s(self) -> float:
        """Seconds a ``--once`` run's coordinator may stay unreachable before the node stops."""
        return LOST_AFTER_S if self.max_wait_time is None else self.max_wait_time

    def _unreachable_too_long(self) -> bool:
        since = self.unreachable_since
        return self.once and since is not None and time.monotonic() - since > self.lost_after_s

    def _stopped(self) -> bool:
        return self.refused is not None or self.exit is not None or not self.proc.alive()

    def handle_stop(self) -> None:
        """Restart a SuperNode that stopped or was refused, or raise saying why.

        Raises
        ------
        UserError
            The coordinator refused the node.
        RunError
            The coordinator was lost during a ``--once`` run, stayed unreachable past
            ``--max-wait-time``, or the SuperNode stopped for another reason.
        """
        proc = self.proc
        reason, line, key_refused = self.refused or (
            flower_compat.node_refusal(" ".join(proc.lines)), "", False)
        was_connected = self.connected
        killed = signal_name(proc.returncode())  # by something else: we stop it only below
        proc.stop()
        self._close_source()
        lost = (f"this node's SuperNode process was killed ({killed})" if killed else
                f"lost the coordinator at {self.superlink}")
        if reason and key_refused and self._key_in_use():
            self._wait_for_key()
            return
        if reason and key_refused and self.key_retries < 3:
            self.key_retries += 1
            self.say(f"[yellow]node:[/] the coordinator refused this node's key; it may still "
                     f"be starting: retrying in 3 s ({self.key_retries}/3)")
            time.sleep(3.0)
            self.start_supernode()
            return
        if reason:
            log.debug("refusal line: %s", line)
            if reason == flower_compat.TLS_REFUSAL and self.certs is not None:
                host, port = split_address(self.superlink, "--coordinator")
                reason = certificate_problem(host, port, self.certs / CA_CERT) or reason
            raise UserError(f"refused by {self.superlink}: {reason}")
        if was_connected and not self.once:
            if not self.waiting:  # else the end of the run was said already
                why = "" if killed else " (it stopped or restarted)"
                self.say(f"[yellow]node:[/] {lost}{why}; reconnecting for the next run")
            time.sleep(1.0)
            self.start_supernode()
            return
        if was_connected or killed:
            raise RunError(f"{lost} during the run" if was_connected else lost)
        self.tls_checked = -1e9
        self._check_tls()
        if self.refused is not None:
            raise UserError(f"refused by {self.superlink}: {self.refused[0]}")
        if any(flower_compat.parse_supernode_line(ln).gave_up for ln in proc.lines):
            raise CommandError(f"could not reach the coordinator at {self.superlink} within "
                           f"--max-wait-time {self.max_wait_time:g} s")
        raise RunError(f"the SuperNode stopped: {proc.last_error()}")

    def _wait_for_key(self) -> None:
        """Start the SuperNode again while the key may be a node's that just stopped.

        The coordinator lets such a node go within :data:`KEY_IN_USE_WAIT_S`. The first
        refusal of a registered key is tried again at once: keys are registered just after
        the coordinator starts listening, so it may predate the registration.

        Raises
        ------
        UserError
            The key stayed in use: another node has it.
        """
        now = time.monotonic()
        if self.key_in_use_since is None:
            self.key_in_use_since = now
        elif now - self.key_in_use_since > KEY_IN_USE_WAIT_S:
            raise UserError(f"a node with this key is already connected to "
                            f"{self.superlink}: {flower_compat.KEY_HINT}")
        else:
            if not self.key_wait_said:
                self.key_wait_said = True
                self.say(f"[yellow]node:[/] the coordinator at {self.superlink} still holds "
                         "this node's key as connected (a node that just stopped is let go "
                         f"within {2 * flower_compat.HEARTBEAT_S} s); waiting up to "
                         f"{KEY_IN_USE_WAIT_S:g} s")
            time.sleep(2.0)
        self.start_supernode()

    def _key_in_use(self) -> bool:
        """Whether the coordinator knows this node's key: then it refused it as in use."""
        return self.auth_key is not None and flower_compat.node_key_registered(
            self.superlink, None if self.certs is None else self.certs / CA_CERT,
            self.auth_key) is True

    def open_source(self) -> bool:
        """Connect to the SuperNode's runtime API; ``False`` (after 0.1 s) while it is not up."""
        if self.source is None:
            try:
                self.source = flower_compat.TaskSource(self.endpoint, flower_compat.CLIENT_TASK)
            except Exception:  # noqa: BLE001 - runtime API not up yet
                time.sleep(0.1)
                return False
        return True

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def close(self) -> None:
        """Stop the SuperNode and close the runtime API connection."""
        self._close_source()
        if self.proc is not None:
            self.proc.stop()
