"""Run a sweep's points, each as its own ``fedavg simulate`` process; resumable.

Every point runs as ``python -m fedavg.cli simulate ... --output DIR/<name>``, its log (every
attempt) in ``DIR/<name>/sweep.log``: the code path of ``fedavg simulate``, in a process of its
own, so nothing of Ray or Flower carries from one point to the next. ``DIR/sweep.json``
records every point (name, settings, status, exit code, last error line, wall seconds) and is
rewritten whenever a point starts or ends.

What each point does (run, resume, skip ...) is :mod:`fedavg.sweeps.plan`'s decision.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedavg.run.output import RUN_FILES, check_folder
from fedavg.sweeps.grid import Point, Sweep
from fedavg.sweeps.plan import (
    KEEP_FAILED,
    RECORD,
    RERUN,
    RESUME,
    SKIP,
    STARTS,
    Planned,
    read_json,
)
from fedavg.util.errors import UserError
from fedavg.util.interrupts import detach_lost_terminal, stoppers


def point_process(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start a point's command so that it gets SIGTERM when the sweep dies, even by SIGKILL.

    Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``), set in the child before it
    runs the command; the point then stops as on Ctrl-C (rounds kept, Ray stopped) instead of
    training on unwatched. Elsewhere a plain ``subprocess.Popen``.
    """
    prctl = _prctl()
    if prctl is None:
        return subprocess.Popen(cmd, **kwargs)
    return subprocess.Popen(cmd, preexec_fn=lambda: prctl(1, signal.SIGTERM), **kwargs)


def _prctl():
    """Return libc's ``prctl``, looked up here (not in the forked child), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

LOG = "sweep.log"

#: Seconds a stopped point's process gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 60.0

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cpu_note(points: list[Point], parallel: int, cores: int | None = None) -> str | None:
    """Return a note when ``parallel`` points at once want more CPU cores than there are.

    A point's simulation runs up to ``num_nodes`` nodes at once, each reserving
    ``cpus_per_node`` cores, within the machine's cores.
    """
    cores = cores or os.cpu_count() or 1
    if not points or parallel < 2:
        return None
    widest = max(points, key=lambda p: min(p.config.merge.num_nodes * p.cpus_per_node, cores))
    per_point = min(widest.config.merge.num_nodes * widest.cpus_per_node, cores)
    if parallel * per_point <= cores:
        return None
    wants = widest.config.merge.num_nodes * widest.cpus_per_node
    why = (f"{widest.config.merge.num_nodes} nodes x {widest.cpus_per_node:g} --cpus-per-node"
           + (f", capped at the {cores} cores" if wants > cores else ""))
    return (f"--parallel {parallel} x up to {per_point:g} cores per point ({why}) is more "
            f"than the {cores} cores here: points share cores and each takes longer")


def last_error(log: Path) -> str | None:
    """Return the last ``error:`` / ``run failed:`` line of a point's last attempt, or its last."""
    try:
        lines = [_ANSI.sub("", line).strip() for line in log.read_text(errors="replace")
                 .splitlines()]
    except OSError:
        return None
    lines = lines[max((i for i, ln in enumerate(lines) if ln.startswith("# fedavg ")), default=0):]
    lines = [line for line in lines if line and not line.startswith("# ")]
    for line in reversed(lines):
        if line.startswith(("error:", "run failed:", "interrupted")):
            return line
    return lines[-1] if lines else None


def check_sweep_folder(out: Path) -> None:
    """Refuse a sweep folder that is a file, lies below one or holds a run of its own.

    Raises
    ------
    UserError
        Saying which, and to choose another ``--output``.
    """
    check_folder(out)
    held = next((f for f in RUN_FILES if (out / f).is_file()), None)
    if held is not None:
        raise UserError(f"{out} holds a run ({held}), not a sweep; choose another --output")


@contextlib.contextmanager
def locked(out: Path):
    """Hold ``out``'s writer lock for the sweep: one sweep per folder at a time.

    Raises
    ------
    UserError
        The folder cannot be made, holds a run, or another sweep holds it.
    """
    check_sweep_folder(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create sweep folder {out}: {exc.strerror}") from None
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another fedavg command is writing into {out} (a sweep still "
                            "going on?); wait for it to end or choose another --output") from None
        yield
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


class Runner:
    """Runs the planned points, ``parallel`` at a time, and keeps ``sweep.json`` current.

    Parameters
    ----------
    sweep : Sweep
        The sweep.
    planned : list of Planned
        From :func:`plan`.
    out : pathlib.Path
        The sweep folder.
    parallel : int
        Points running at once (>= 1).
    on_event : callable, optional
        ``on_event(record)`` after a point starts, ends or is skipped (for the display).
    left_out : list of Planned
        Points of the config that ``fedavg sweep --only`` leaves out: not run, but recorded
        in ``sweep.json`` as they are (``skipped`` if finished, else ``pending`` or
        ``failed``), so that the record still holds every point.
    """

    def __init__(self, sweep: Sweep, planned: list[Planned], out: Path, parallel: int,
                 on_event=None, left_out: list[Planned] = ()) -> None:
        self.sweep, self.out, self.parallel = sweep, out, parallel
        self.on_event = on_event or (lambda record: None)
        self.records = {p.point.name: self._first_record(p) for p in planned}
        self.left_out = {p.point.name: self._first_record(p) for p in left_out}
        self.queue = [p for p in planned if p.action in STARTS]
        self.running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
        self.started = time.time()
        self.stop_signal: int | None = None

    def _first_record(self, p: Planned) -> dict[str, Any]:
        status = {SKIP: "skipped", KEEP_FAILED: "failed"}.get(p.action, "pending")
        return {"name": p.point.name, "settings": p.point.settings, "status": status,
                "exit_code": p.record.get("exit_code", 0 if p.action == SKIP else None),
                "error": p.record.get("error"), "wall_s": p.record.get("wall_s"),
                "ran": False}

    def run(self) -> int:
        """Run every queued point; return 0, 1 (a point failed) or 130 (stopped by a signal)."""
        for record in self.records.values():
            if record["status"] != "pending":
                self.on_event(record)
        self._save("running")
        saved = {s: signal.signal(s, self._on_signal) for s in stoppers()}
        try:
            while (self.queue or self.running) and self.stop_signal is None:
                while self.queue and len(self.running) < self.parallel:
                    self._start(self.queue.pop(0))
                self._reap()
                time.sleep(0.2)
        finally:
            if self.running:  # a signal (or an error here): stop the points' processes
                self._stop_all()
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        failed = any(r["status"] == "failed" for r in self.records.values())
        status = "interrupted" if self.stop_signal is not None else (
            "failed" if failed else "done")
        self._save(status)
        return 130 if self.stop_signal is not None else (1 if failed else 0)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writes to it would fail
            detach_lost_terminal()
        if self.stop_signal is None:
            self.stop_signal = signum

    def _start(self, p: Planned) -> None:
        folder = self.out / p.point.name
        folder.mkdir(parents=True, exist_ok=True)
        args = ["simulate", *p.point.simulate_args(), "--output", str(folder)]
        if p.action == RERUN:
            args.append("--overwrite")  # a half-finished run: from scratch
        elif p.action == RESUME:
            args += ["--resume", str(folder)]  # from its last finished round
        log = open(folder / LOG, "a")  # an earlier attempt's lines stay above
        log.write(f"# fedavg {' '.join(args)}\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": os.getenv("COLUMNS", "120")}
        proc = point_process([sys.executable, "-m", "fedavg.cli", *args], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.running[p.point.name] = (proc, time.monotonic(), log)
        record = self.records[p.point.name]
        record.update(status="running", pid=proc.pid, ran=True, exit_code=None, error=None)
        self._save("running")
        self.on_event(record)

    def _reap(self) -> None:
        for name, (proc, started, log) in list(self.running.items()):
            code = proc.poll()
            if code is not None:
                status = "done" if code == 0 else "failed"
                self._ended(name, code, "interrupted" if self.stop_signal and code else status)

    def _ended(self, name: str, code: int, status: str) -> None:
        proc, started, log = self.running.pop(name)
        log.close()
        record = self.records[name]
        record.pop("pid", None)
        record.update(status=status, exit_code=code, wall_s=round(time.monotonic() - started, 3),
                      error=None if code == 0 else last_error(self.out / name / LOG))
        if code == 0:
            summary = read_json(self.out / name / "summary.json") or {}
            record["accuracy"] = summary.get("accuracy")
        self._save("running")
        self.on_event(record)

    def _stop_all(self) -> None:
        """SIGTERM every running point's process (by PID), wait for it, record it."""
        for proc, _, _ in self.running.values():
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, (proc, _, _) in list(self.running.items()):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            self._ended(name, code, "interrupted")

    def _save(self, status: str) -> None:
        write_json(self.out / RECORD, {
            "config": str(self.sweep.path),
            "status": status,
            "started": _dt.datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - self.started, 3),
            "varying": list(self.sweep.varying),
            "points": [*self.records.values(), *self.left_out.values()],
        })

    def counts(self) -> dict[str, int]:
        """Return how many points are in each status now."""
        out: dict[str, int] = {}
        for record in self.records.values():
            out[record["status"]] = out.get(record["status"], 0) + 1
        return out
