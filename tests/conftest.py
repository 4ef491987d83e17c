"""Shared fixtures: where the real datasets are, how to run the CLI, leaked-process checks."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

# Tests send SIGINT to the commands they start, as a Ctrl-C would. A suite started as a
# script's background job has SIGINT ignored, which its commands would inherit and keep (as
# a user's background job does): they get Python's own handler back here.
signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDAVG_SHARED_DATA", ROOT.parent / "shared" / "data"))
MNIST = SHARED_DATA / "mnist"

_NO_DATA = (f"the real datasets are not at {SHARED_DATA}: the tests that read MNIST, "
            "CIFAR-10 or AG News fail; clone the repository next to shared/ or set "
            "FEDAVG_SHARED_DATA=/path/to/shared/data")


def pytest_report_header(config):
    """Say at the top of the run when the shared datasets are missing."""
    return None if SHARED_DATA.is_dir() else f"WARNING: {_NO_DATA}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say it again under the failures, where a reader looks first."""
    if not SHARED_DATA.is_dir():
        terminalreporter.write_line(f"WARNING: {_NO_DATA}", yellow=True, bold=True)


# Names of the processes a simulation may start; none may outlive a command or a test.
ENGINE_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "flower-superlink",
                          "flower-supernode", "flwr-clientapp", "default_worker.py")


# Every process a test starts carries this worker's tag in its environment (children inherit
# it, also once re-parented), so the engine processes of parallel test workers (pytest-xdist)
# and of other jobs on the machine are told apart from this worker's own.
SESSION_TAG = "FEDAVG_TEST_SESSION"
os.environ[SESSION_TAG] = f"{os.getpid()}-{os.urandom(4).hex()}"


def tagged_processes(key: str, value: str) -> list[str]:
    """``"PID: command line"`` of the live processes whose environment has ``key=value``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status", "name"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.environ().get(key) != value:
                continue
        except (psutil.Error, OSError):
            continue
        cmd = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        found.append(f"{proc.info['pid']}: {cmd[:120]}")
    return found


def engine_processes() -> list[str]:
    """Live (non-zombie) Ray / Flower processes started by this test worker."""
    return [p for p in tagged_processes(SESSION_TAG, os.environ[SESSION_TAG])
            if any(marker in p.split(": ", 1)[1] for marker in ENGINE_PROCESS_MARKERS)]


def pytest_collection_modifyitems(config, items):
    """Put the tests marked ``long`` at even spacings, the first at the head of the list.

    pytest-xdist's ``worksteal`` schedule hands each of its N workers one contiguous share
    of the collected tests, then moves tests from a busy worker's tail to an idle one. With
    as many long tests as workers, each share begins with one: the long tests start at once,
    side by side, and the short ones fill in around them instead of queueing behind them at
    the end. The order depends only on the collected items, so every worker sees the same.
    """
    long = [item for item in items if item.get_closest_marker("long")]
    if not long:
        return
    rest = [item for item in items if not item.get_closest_marker("long")]
    spacing = len(items) // len(long)
    for i, item in enumerate(long):
        rest.insert(i * spacing, item)
    items[:] = rest


def run_cli(*args, timeout=600, check=True, env=None):
    """Run ``fedavg ARGS`` as a separate process, the way a user does."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedavg.cli.app", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"fedavg {' '.join(map(str, args))} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def assert_one_error_line(stderr: str) -> str:
    """Check that ``stderr`` is one ``error:`` line, no traceback; return it."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in re.split(r"[\r\n]+", stderr) if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves a Ray or Flower process alive."""
    before = {p.split(":")[0] for p in engine_processes()}
    yield
    leaked = [p for p in engine_processes() if p.split(":")[0] not in before]
    assert not leaked, f"processes left alive: {leaked}"


@pytest.fixture(scope="session")
def mnist_path():
    if not (MNIST / "train").exists() and not list(MNIST.glob("**/*.parquet")):
        raise AssertionError(f"MNIST not found at {MNIST}; set FEDAVG_SHARED_DATA")
    return MNIST


@pytest.fixture
def task_identity():
    """Flower messages built outside a Flower run need a task identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
