"""Stopping a simulation's Ray instance so that nothing outlives the command.

:func:`shutdown_ray` at the end of a run (normal, error, Ctrl-C); :func:`abort_active_runs`
from a signal handler, when no Ray call is safe any more. Processes are told apart from other
runs' by their process group and this run's Ray folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Callable

from fedavg.flower_compat import disconnect_ray

log = logging.getLogger(__name__)

_ACTIVE: list[Callable[[], None]] = []
#: Seconds by which a run's start is moved back before processes are told apart by start time.
CLOCK_SLACK_S = 2.0


@contextlib.contextmanager
def abortable(folders: list[str], marker: str):
    """Register how to clean up this run if the process must stop at once (signal).

    ``folders`` are removed; ``marker`` is this run's Ray folder (see :func:`_ray_processes`).
    """
    # A process's start time as psutil reads it (the boot time, in whole seconds, plus its
    # start ticks) can be up to a second before time.time() at the same moment.
    since = time.time() - CLOCK_SLACK_S

    def abort() -> None:
        # From a signal handler, while Flower's threads still use Ray: any Ray call now can
        # make Ray's core worker end this process, and once the raylet is gone it will (with
        # exit code 1). So: no Ray call; freeze every Ray process, remove the temporary data,
        # and leave the killing to a child that waits for this process to exit first.
        kill_after_exit(since, marker)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    _ACTIVE.append(abort)
    try:
        yield since
    finally:
        _ACTIVE.remove(abort)


def free_engine_threads(actors: list, before: set, timeout_s: float = 5.0) -> None:
    """After a run stopped early, let the engine's threads end before Ray is stopped.

    Flower's engine threads wait for their node actors' results with no timeout; with Ray
    stopped they would wait for ever, and a Python process that called
    :func:`fedavg.simulate` could not exit. Killing the ``actors`` ends those waits with an
    error, after which the threads see the engine's stop; threads not in ``before`` (those
    started since) are then joined, for at most ``timeout_s`` seconds in all.
    """
    import threading

    import ray

    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread not in before and not thread.daemon and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def abort_active_runs() -> None:
    """Stop the engines of runs in progress and remove their temporary files.

    For signal handlers: after this the process can exit at once (``os._exit``) without
    leaving Ray processes or temporary data behind. Finished rounds stay in the run folder.
    """
    for abort in reversed(list(_ACTIVE)):
        with contextlib.suppress(Exception):
            abort()


def _ray_processes(since: float, marker: str) -> list:
    """Return this run's Ray processes.

    These are the processes started at or after ``since`` (epoch seconds), in our process
    group, and using this run's Ray folder ``marker`` (command line or open files).

    Ray's agents can be respawned by a raylet that is shutting down and then outlive it,
    re-parented away from us; they keep our process group and their log files in our Ray
    folder, which is how they are found without touching another run's Ray.
    """
    import psutil

    me, pgid = os.getpid(), os.getpgid(0)
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time", "status"]):
        info = proc.info
        if proc.pid == me or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if (info["create_time"] or 0) < since:
            continue
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
        except OSError:
            continue
        name = info["name"] or ""
        cmd = " ".join(info["cmdline"] or [])
        if not (name.startswith(("ray::", "raylet", "gcs_server")) or "ray::" in cmd
                or f"{os.sep}ray{os.sep}" in cmd):
            continue
        try:
            if marker in cmd or any(f.path.startswith(marker) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_after_exit(since: float, marker: str) -> None:
    """Freeze this run's Ray processes now; kill them once this process has exited.

    All are frozen at once (SIGSTOP), so that none can react (the raylet respawning its
    agents, our own core worker noticing a dead raylet and ending this process with code
    1). A forked child sends the SIGKILLs once this process has exited (at most 5 seconds
    later), so that this process's exit code is its own.
    """
    import signal

    import psutil

    procs = {p.pid: p for p in psutil.Process().children(recursive=True)}
    procs.update({p.pid: p for p in _ray_processes(since, marker)})
    order = []
    for pid, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            if proc.create_time() >= since:
                order.append(pid)
    for pid in order:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    parent = os.getpid()
    if os.fork() != 0:
        return
    try:  # the child: only plain system calls from here
        # When this process leads its terminal's session (`ssh -t host fedavg ...`, a tmux
        # pane), its exit hangs the terminal up: the kernel's SIGHUP would end this child
        # before its SIGKILLs, and leave the frozen processes stopped for good.
        for hangup in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            signal.signal(hangup, signal.SIG_IGN)
        deadline = time.monotonic() + 5.0
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.005)
        for pid in order:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)


def _wait_gone(procs: list, timeout_s: float) -> list:
    """Wait until every process has exited (a zombie counts as gone); return those left."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        if not alive or time.monotonic() >= deadline:
            return alive
        procs = alive
        time.sleep(0.02)


def shutdown_ray(since: float, marker: str, timeout_s: float = 0.0) -> None:
    """Stop Ray if this process started it, and wait until its processes are gone.

    ``ray.shutdown()`` gives Ray's processes a second each to exit, one after another, and
    still returns while some are exiting; Ray's agents can outlive a raylet that died first.
    This disconnects from Ray (:func:`fedavg.flower_compat.disconnect_ray`), gives the
    processes it started (our descendants, and the Ray processes using this run's Ray folder
    ``marker``, started at or after ``since``, epoch seconds) ``timeout_s`` seconds to exit,
    then freezes whatever is still alive and kills it, so that nothing outlives the command.
    (Their graceful exit takes seconds and keeps nothing: the run's Ray folder is removed
    next.)
    """
    import psutil

    me = psutil.Process()

    def ours() -> dict:
        procs = {}
        for p in me.children(recursive=True) + _ray_processes(since, marker):
            with contextlib.suppress(psutil.Error):  # a zombie has exited: nothing to stop
                if p.create_time() >= since and p.status() != psutil.STATUS_ZOMBIE:
                    procs[p.pid] = p
        return procs

    procs = ours()
    try:
        import ray

        if ray.is_initialized():
            disconnect_ray()
    except Exception:  # noqa: BLE001 - clean up the processes below in any case
        log.debug("ray.shutdown failed", exc_info=True)
    for attempt in range(3):
        procs.update(ours())
        if not procs:
            return
        alive = _wait_gone(list(procs.values()), timeout_s if attempt == 0 else 2.0)
        for proc in alive:  # all frozen first: none can respawn another or react
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _wait_gone(alive, 2.0)
        for proc in alive:  # reap our own children (Ray no longer holds them: detached)
            with contextlib.suppress(OSError):
                os.waitpid(proc.pid, os.WNOHANG)
        time.sleep(0.1)  # let a respawn race show itself
        procs = {}
