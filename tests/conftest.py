"""Shared fixtures: where the real datasets are, how to run the CLI, leaked-process checks."""

import signal

import pytest
from helpers.cli import (  # noqa: F401  (the fixtures' and hooks' own)
    MNIST,
    ROOT,
    SESSION_TAG,
    SHARED_DATA,
    assert_one_error_line,
    engine_processes,
    run_cli,
    tagged_processes,
)

# Tests send SIGINT to the commands they start, as a Ctrl-C would. A suite started as a
# script's background job has SIGINT ignored, which its commands would inherit and keep (as
# a user's background job does): they get Python's own handler back here.
signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _scale_time_limits(config, items) -> None:
    """Scale each test's time limit (pytest-timeout's) to this machine's speed now.

    A limit is set for a quiet 2-core machine; on a busy one (two suites side by side) it
    grows by :func:`helpers.patience.slowness`, measured once per test process.
    """
    from helpers.patience import slowness

    factor = slowness()
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker is not None and marker.args else default
        if limit > 0:
            item.add_marker(pytest.mark.timeout(limit * factor), append=False)


def pytest_collection_modifyitems(config, items):
    """Put the tests marked ``long`` at even spacings, the first at the head of the list.

    pytest-xdist's ``worksteal`` schedule hands each of its N workers one contiguous share
    of the collected tests, then moves tests from a busy worker's tail to an idle one. With
    as many long tests as workers, each share begins with one: the long tests start at once,
    side by side, and the short ones fill in around them instead of queueing behind them at
    the end. The order depends only on the collected items, so every worker sees the same.
    """
    _scale_time_limits(config, items)
    long = [item for item in items if item.get_closest_marker("long")]
    if not long:
        return
    rest = [item for item in items if not item.get_closest_marker("long")]
    spacing = len(items) // len(long)
    for i, item in enumerate(long):
        rest.insert(i * spacing, item)
    items[:] = rest


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
