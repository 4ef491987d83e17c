"""The node role: ``fedavg node``.

A node starts a Flower SuperNode (``--isolation process``) and runs every ClientApp task of
every run in this one long-lived process (:func:`fedavg.flower_compat.run_client_task`):
torch is imported and the data loaded once, not once per round. It watches the SuperNode's
output to tell the user what happens (refused, unreachable, connected), reconnects when its
coordinator restarts, and gives up clearly when it is gone. A run's end (finished or failed,
as the coordinator announces it) is said once; waiting for the next run is quiet.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from rich.markup import escape

from fedavg import flower_compat
from fedavg.deployment.node_options import (
    check_node_options,
    describe_node,
    node_config,
    use_threads,
)
from fedavg.deployment.processes import (
    FlowerProcess,
    PrivateDir,
    flower_env,
    free_port,
    secret_file,
    signal_name,
    split_address,
)
from fedavg.deployment.tls import CA_CERT, tls_mismatch
from fedavg.errors import RunError, UserError

log = logging.getLogger("fedavg")

#: A ``--once`` node gives up on a run whose coordinator stays unreachable this long (s),
#: unless ``--max-wait-time`` says otherwise.
LOST_AFTER_S = 30.0
#: A key the coordinator holds as connected may be a node that just stopped (a crash, a
#: container restarted at once): the SuperLink lets it go after two missed heartbeats. A
#: node waits this long (s) before it calls the key in use by another node.
KEY_IN_USE_WAIT_S = 3 * flower_compat.HEARTBEAT_S


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
    model: str | None = None,
    threads: int | None = None,
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
    certs, insecure : path or None, bool
        Folder holding the coordinator's CA certificate ``ca.crt``; or ``insecure``: no TLS.
    auth_key : path, optional
        This node's private key (from ``fedavg certs --nodes``) for SuperNode authentication.
    once : bool
        Exit after the first run ends; by default the node serves runs until stopped.
    max_wait_time : float, optional
        Seconds without reaching the coordinator before giving up (retry; --once: 30 s mid-run).
    model : str, optional
        The run's user-code ``--model`` (a file: this machine's copy); needed to run it.
    threads : int, optional
        CPU threads torch trains with (default: one per core; nodes sharing cores: fewer).
    console : rich.console.Console, optional
        Where to print progress.

    Returns
    -------
    int
        Number of training tasks run.

    Raises
    ------
    UserError
        Bad options, missing data, code or certificates, or the coordinator refused the node.
    RunError
        The SuperNode stopped for another reason.
    """
    from fedavg.display import reporter
    from fedavg.run import quiet_logs

    host, port = split_address(coordinator, "--coordinator")
    certs, model = check_node_options(dataset, partition_id, num_partitions, device, certs,
                                      insecure, auth_key, max_wait_time, model, threads)
    threads = use_threads(threads)
    flower_compat.check_flower_internals()
    flower_compat.patch_pull_backoff()
    quiet_logs(False)
    say = reporter(console, certs is None)
    tmp = PrivateDir("fedavg-node-")
    node = None
    try:
        node = _Node(f"{host}:{port}",
                     node_config(dataset, device, partition_id, num_partitions, model),
                     certs, auth_key, once, max_wait_time, say, Path(tmp.name))
        say(describe_node(dataset, partition_id, num_partitions, device, threads, model,
                          f"{host}:{port}", certs is not None))
        return node.serve()
    finally:
        if node is not None:
            node.close()
        tmp.cleanup()


class _Node:
    """One node's SuperNode and task loop; :meth:`serve` is the loop, the rest its steps.

    The SuperNode's output is read in another thread (:meth:`on_line`), which only sets the
    flags that the loop acts on.
    """

    def __init__(self, superlink: str, node_config: list[str], certs: Path | None,
                 auth_key: Path | None, once: bool, max_wait_time: float | None,
                 say: Callable[[str], None], home: Path) -> None:
        from fedavg.apps import FAILED_RUNS, FINISHED_RUNS, client_app

        self.superlink, self.node_config = superlink, node_config
        self.certs, self.auth_key = certs, auth_key
        self.once, self.max_wait_time = once, max_wait_time
        self.say, self.home = say, home
        self.app, self.finished_runs, self.failed_runs = client_app, FINISHED_RUNS, FAILED_RUNS
        self.secret_path, self.secret = secret_file(home)
        self.proc: FlowerProcess | None = None
        self.endpoint: flower_compat.Endpoint | None = None
        self.source: flower_compat.TaskSource | None = None
        self.runs: set[int] = set()
        self.tasks, self.key_retries = 0, 0
        self.task_failures: list[str] = []  # of the run being served
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

    # ------------------------------------------------------------------ the SuperNode

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
        if ev.refusal:
            if self.refused is None:
                self.refused = (ev.refusal, line.strip()[:200], ev.key_refused)
            return
        if ev.attempt_failed:
            self.unreachable_since = self.unreachable_since or time.monotonic()
            self._check_tls()
        elif ev.reconnected:
            self.unreachable_since = None
        if self.certs is None and ev.dropped and not self.hinted:
            self.hinted = True
            self.say("[yellow]node:[/] the coordinator closed the connection: if it uses TLS, "
                     "pass --certs DIR instead of --insecure")
        if ev.node_id is not None:
            self.connected, self.waiting, self.key_in_use_since = True, False, None
            self.say(f"connected to {self.superlink} as node [bold]{escape(ev.node_id)}[/]")
        elif self.quiet or self.waiting or self.refused is not None:
            return
        elif ev.retry_in_s is not None:
            self.say(f"[yellow]node:[/] cannot reach the coordinator at {self.superlink}; "
                     f"retrying in {ev.retry_in_s:.1f} s")
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
            raise RunError(f"could not reach the coordinator at {self.superlink} within "
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

    # ------------------------------------------------------------------ tasks

    def open_source(self) -> bool:
        """Connect to the SuperNode's runtime API; ``False`` (after 0.1 s) while it is not up."""
        if self.source is None:
            try:
                self.source = flower_compat.TaskSource(self.endpoint, flower_compat.CLIENT_TASK)
            except Exception:  # noqa: BLE001 - runtime API not up yet
                time.sleep(0.1)
                return False
        return True

    def next_task(self):
        """``(token, task)`` of a waiting task, or ``None``."""
        try:
            return self.source.acquire()
        except Exception as exc:  # noqa: BLE001 - SuperNode starting or stopping
            log.debug("acquire: %s", exc)
            return None

    def finished(self) -> bool:
        """Note runs the coordinator announced as over; ``True``: leave (``--once``).

        Raises
        ------
        RunError
            A ``--once`` node's run failed (the coordinator's reason), or one of its tasks did.
        """
        failed = {run: self.failed_runs[run] for run in self.runs if run in self.failed_runs}
        done = (self.runs & self.finished_runs) | set(failed)
        if not done:
            return False
        self.runs -= done
        self.key_retries, self.key_in_use_since = 0, None
        failures, self.task_failures = self.task_failures, []
        if self.once:
            self.quiet = True
            time.sleep(1.0)  # let the SuperNode deliver the last acknowledgement
            if failed:
                raise RunError(next(iter(failed.values())))
            if failures:  # the run went on without this node's work
                raise RunError(f"run {', '.join(map(str, done))} finished, but "
                               f"{len(failures)} of this node's {self.tasks} task(s) failed "
                               f"(the last: {failures[-1]})")
            self.say(f"run {', '.join(map(str, done))} finished; exiting (--once)")
            return True
        self.waiting = True
        for run in sorted(done):
            end = f"failed: {escape(failed[run])}" if run in failed else "finished"
            self.say(f"run {run} {end}; waiting for the next run")
        return False

    def run_task(self, token: str, task) -> None:
        """Run one task in a worker thread while watching the SuperNode and the coordinator.

        A task whose coordinator vanished mid-transfer would wait for ever; it is abandoned
        (the loop's checks then say what happened).
        """
        if int(task.run_id) not in self.runs:
            self.runs.add(int(task.run_id))
            self.say(f"joined run {task.run_id}")
        result: list[str | None] = []
        endpoint = self.endpoint
        worker = threading.Thread(
            target=lambda: result.append(flower_compat.run_client_task(endpoint, token, self.app)),
            daemon=True)
        worker.start()
        while worker.is_alive() and self.proc.alive() and self.exit is None \
                and not self._unreachable_too_long():
            worker.join(0.2)
        if worker.is_alive():
            return
        failure = result[0] if result else "the task stopped"
        self.tasks += 1
        if failure is not None:
            self.task_failures.append(failure)
            self.say(f"[red]run {task.run_id}: task failed, reported to the coordinator:[/] "
                     f"{escape(failure)}")

    def serve(self) -> int:
        """Serve runs until ``--once`` ends or an error; return the number of tasks run."""
        self.start_supernode()
        while True:
            if (self.runs or self.connected) and self._unreachable_too_long():
                when = (f"during run {', '.join(map(str, self.runs))}" if self.runs else
                        "before its run started")  # connected, then the coordinator went
                raise RunError(f"lost the coordinator at {self.superlink} {when} "
                               f"(unreachable for {self.lost_after_s:g} s)")
            if self._stopped():
                self.handle_stop()
                continue
            if not self.open_source():
                continue
            got = self.next_task()
            if got is None:
                if self.finished():
                    return self.tasks
                time.sleep(0.05)
                continue
            self.run_task(*got)

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def close(self) -> None:
        """Stop the SuperNode and close the runtime API connection."""
        self._close_source()
        if self.proc is not None:
            self.proc.stop()
