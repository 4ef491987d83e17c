"""The CLI as a test runs it, and the engine processes this test worker started.

Every process a test starts carries this worker's tag in its environment (children inherit
it, also once re-parented), so the engine processes of parallel test workers (pytest-xdist)
and of other jobs on the machine are told apart from this worker's own.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]  # the repository
SHARED_DATA = Path(os.environ.get("FEDAVG_SHARED_DATA", ROOT.parent / "shared" / "data"))
MNIST = SHARED_DATA / "mnist"


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


def run_cli(*args, timeout=600, check=True, env=None):
    """Run ``fedavg ARGS`` as a separate process, the way a user does."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedavg.cli", *map(str, args)],
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
