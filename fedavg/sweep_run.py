"""Run a sweep's points, each as its own ``fedavg simulate`` process; resumable.

Every point runs as ``python -m fedavg.cli simulate ... --output DIR/<name>``, its log (every
attempt) in ``DIR/<name>/sweep.log``: the code path of ``fedavg simulate``, in a process of its
own, so nothing of Ray or Flower carries from one point to the next. ``DIR/sweep.json``
records every point (name, settings, status, exit code, last error line, wall seconds) and is
rewritten whenever a point starts or ends.

A point whose folder holds a ``summary.json`` for the same settings is skipped; a run without
one (stopped half-way) goes on from its last round (``--resume``) when its checkpoint reads
and holds the same settings, else runs again from scratch (``--overwrite``); one that failed
in an earlier sweep stays failed unless ``retry_failed``.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedavg.errors import UserError
from fedavg.sweep import Point, Sweep, format_value


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

RECORD = "sweep.json"
LOG = "sweep.log"

#: What :func:`plan` decides for a point.
RUN, RERUN, RESUME, SKIP, KEEP_FAILED = "run", "rerun", "resume", "skip", "failed"
#: The actions that start a ``fedavg simulate``.
STARTS = (RUN, RERUN, RESUME)

#: Seconds a stopped point's process gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 60.0

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Planned:
    """A point and what the sweep does with it.

    ``action`` is ``run``, ``rerun``, ``resume``, ``skip`` or ``failed``; ``record`` holds
    what is known of the point (``round``: the last finished round, to resume after).
    """

    point: Point
    action: str
    record: dict[str, Any] = field(default_factory=dict)


def check_points(planned: list[Planned]) -> dict[str, str]:
    """Prepare each point that would start as its run would; return why those would fail.

    Each point's data is loaded, its merge data held out and its partitions and model built
    (:func:`fedavg.run.prepare`); points with the same data settings share one load, and one
    dataset is held at a time. Returns ``{point name: error line}`` for the points whose
    ``fedavg simulate`` would stop with that error before its first round.
    """
    from fedavg.data import data_settings, load
    from fedavg.run import prepare

    def key(p: Planned) -> str:
        d = p.point.config.data
        return json.dumps([d.dataset, data_settings(d)], sort_keys=True, default=str)

    problems: dict[str, str] = {}
    held: dict[str, Any] = {}  # the data settings loaded now: their data, or the load's error
    for p in sorted((p for p in planned if p.action in STARTS), key=key):
        d = p.point.config.data
        if key(p) not in held:
            held.clear()
            try:
                held[key(p)] = load(d.dataset, **data_settings(d))
            except UserError as exc:
                held[key(p)] = exc
        try:
            if isinstance(held[key(p)], UserError):
                raise held[key(p)]
            prepare(p.point.config, data=held[key(p)])
        except UserError as exc:
            problems[p.point.name] = str(exc)
    return problems


def plan(sweep: Sweep, out: Path, retry_failed: bool = False) -> list[Planned]:
    """Decide per point: run it, resume it, run it again from scratch, skip or keep it failed.

    Parameters
    ----------
    sweep : Sweep
        The points.
    out : pathlib.Path
        The sweep's folder (``DIR``); point ``p`` runs in ``out / p.name``.
    retry_failed : bool
        Run the points an earlier sweep recorded as failed again.

    Raises
    ------
    UserError
        A point's folder is a file or holds a finished run with other settings.
    """
    earlier = {r.get("name"): r for r in read_record(out).get("points", [])}
    planned = []
    for point in sweep.points:
        folder = out / point.name
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{folder} is a file where point {point.name}'s run folder "
                            "goes: move it away or sweep into another --output")
        summary = _read_json(folder / "summary.json")
        before = earlier.get(point.name, {})
        same = _plain(before.get("settings")) == _plain(point.settings)
        if summary is not None:
            problem = _difference(summary.get("config"), point.config.as_dict())
            done = _resumable(folder, point) if problem else None
            if done is not None:  # only `rounds` was raised: train on from the last round
                planned.append(Planned(point, RESUME, {"round": done, "finished": True}))
                continue
            if problem:
                raise UserError(f"{folder} holds a finished run with other settings "
                                f"({problem}); remove it or sweep into another --output")
            wall = before.get("wall_s") if same else None
            planned.append(Planned(point, SKIP, {"wall_s": wall if wall is not None
                                                 else summary.get("wall_s")}))
        elif same and before.get("status") == "failed" and not retry_failed:
            planned.append(Planned(point, KEEP_FAILED, {
                k: before.get(k) for k in ("exit_code", "error", "wall_s")}))
        else:
            from fedavg.output import RUN_FILES

            started = folder.is_dir() and any((folder / f).exists() for f in RUN_FILES)
            done = _resumable(folder, point) if started else None
            planned.append(Planned(point, RESUME, {"round": done}) if done is not None
                           else Planned(point, RERUN if started else RUN))
    return planned


def _resumable(folder: Path, point: Point) -> int | None:
    """Return the last finished round of the run in ``folder``, if it can go on to this point.

    That is when its checkpoint reads and holds this point's settings, ``rounds`` aside, and
    no more rounds than the point's are done (a stopped run, or a finished one whose
    ``rounds`` the config raised); ``None`` otherwise (a stopped point then runs again from
    scratch).
    """
    from fedavg import resume

    try:
        ckpt = resume.load(folder)
        given = point.config.from_flat(resume.absolute_paths(point.config.to_flat()))
        had = ckpt.run_config().replace(rounds=given.merge.rounds)
        same = had.as_dict() == given.as_dict()  # paths made absolute in both
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return None
    return ckpt.round if same and ckpt.round <= given.merge.rounds else None


def read_record(out: Path) -> dict[str, Any]:
    """Return ``out/sweep.json`` of an earlier sweep (``{}`` if none or unreadable)."""
    data = _read_json(out / RECORD)
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _difference(recorded: Any, wanted: dict[str, Any]) -> str | None:
    """Name the first settings that differ between two nested run configs, or ``None``.

    A setting the recorded config lacks (a run made before it existed) is at its default.
    """
    from fedavg.config import RunConfig

    if not isinstance(recorded, dict):
        return "no settings recorded"
    defaults = _plain(RunConfig().as_dict())
    diffs = []
    for section, values in _plain(wanted).items():
        there = recorded.get(section) if isinstance(recorded.get(section), dict) else {}
        there = {**defaults.get(section, {}), **there}
        for key, value in values.items():
            if there.get(key) != value:
                diffs.append(f"{key.replace('_', '-')} {format_value(there.get(key))} there, "
                             f"{format_value(value)} here")
    return "; ".join(diffs[:3]) or None


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
    from fedavg.output import RUN_FILES, check_folder

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
        saved = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
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
            summary = _read_json(self.out / name / "summary.json") or {}
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
