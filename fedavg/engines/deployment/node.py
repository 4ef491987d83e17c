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

from rich.markup import escape

from fedavg import flower_compat
from fedavg.engines.deployment.node_options import NodeOptions, use_threads
from fedavg.engines.deployment.processes import PrivateDir, split_address
from fedavg.engines.deployment.supernode import SuperNode
from fedavg.run.display import reporter
from fedavg.run.lifecycle import quiet_logs
from fedavg.util.errors import CommandError, RunError

log = logging.getLogger("fedavg")


def serve_node(options: NodeOptions, console=None) -> int:
    """Run one node: a Flower SuperNode plus a warm process that trains every task.

    Parameters
    ----------
    options : NodeOptions
        Where the coordinator is, the node's data, device, TLS and model code.
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
    host, port = split_address(options.coordinator, "--coordinator")
    certs, model = options.check()
    threads = use_threads(options.threads)
    flower_compat.check_flower_internals()
    flower_compat.patch_pull_backoff()
    quiet_logs(False)
    say = reporter(console, certs is None)
    tmp = PrivateDir("fedavg-node-")
    node = None
    try:
        node = _Node(f"{host}:{port}", options.node_config(model), certs, options.auth_key,
                     options.once, options.max_wait_time, say, Path(tmp.name))
        say(options.describe(threads, model, f"{host}:{port}", certs is not None))
        return node.serve()
    finally:
        if node is not None:
            node.close()
        tmp.cleanup()


class _Node(SuperNode):
    """One node's SuperNode and task loop; :meth:`serve` is the loop, the rest its steps."""

    def __init__(self, *args, **kwargs) -> None:
        # lazy: loads cryptography, flwr, which only this path needs
        from fedavg.node.deployed import FAILED_RUNS, FINISHED_RUNS, client_app

        super().__init__(*args, **kwargs)
        self.app, self.finished_runs, self.failed_runs = client_app, FINISHED_RUNS, FAILED_RUNS
        self.runs: set[int] = set()
        self.tasks = 0
        self.task_failures: list[str] = []  # of the run being served

    def _overdue(self) -> str | None:
        """Why to stop waiting for the coordinator, or ``None``.

        Connected once (``--once``): unreachable past :attr:`lost_after_s`. Never connected:
        ``--max-wait-time`` (+5 s) past the SuperNode's start; Flower checks its time only
        between attempts, and an attempt on a server that never answers hangs 30 s.
        """
        if (self.runs or self.connected) and self._unreachable_too_long():
            when = (f"during run {', '.join(map(str, self.runs))}" if self.runs else
                    "before its run started")
            return f"lost the coordinator at {self.superlink} {when} " \
                f"(unreachable for {self.lost_after_s:g} s)"
        since, limit = self.connecting_since, self.max_wait_time
        if since is not None and limit is not None and not self.connected and \
                time.monotonic() - since > limit + 5.0:
            return f"could not reach the coordinator at {self.superlink} within " \
                f"--max-wait-time {limit:g} s"
        return None

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
        if failure is not None and failure.startswith(flower_compat.UNDELIVERED) \
                and int(task.run_id) in self.finished_runs:
            # the run's end notice, acknowledged after the coordinator stopped waiting for
            # acknowledgements (announce_end): the run's work was delivered before it
            log.debug("end notice of run %s: %s", task.run_id, failure)
            failure = None
        if failure is not None:
            self.task_failures.append(failure)
            self.say(f"[red]run {task.run_id}: task failed, reported to the coordinator:[/] "
                     f"{escape(failure)}")

    def serve(self) -> int:
        """Serve runs until ``--once`` ends or an error; return the number of tasks run."""
        self.start_supernode()
        while True:
            if why := self._overdue():  # never connected: it joined no run to fail
                raise (RunError if self.runs or self.connected else CommandError)(why)
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
