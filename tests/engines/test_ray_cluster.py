"""``fedavg simulate --ray-address``: the nodes run on an existing Ray cluster.

The test starts a Ray head of its own (``ray start --head --block`` in a session of its own,
its folder under /tmp, ``RAY_TMPDIR`` pointing there so that nothing lands in /tmp/ray),
runs a small simulation against it, checks that the nodes ran on that cluster and that the
cluster outlives the run, then stops the head by its PID and checks that none of its
processes is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers.cli import assert_one_error_line, run_cli
from helpers.patience import within


@dataclass
class Head:
    """A Ray head started by the test: its address, folder and `ray start` process."""

    address: str
    folder: Path
    proc: subprocess.Popen

    def processes(self) -> list[psutil.Process]:
        """Live processes of the head's session (the head and what it started)."""
        found = []
        for p in psutil.process_iter(["status", "cmdline"]):  # read now: it may exit soon
            try:
                if os.getsid(p.pid) == self.proc.pid and p.info["status"] != "zombie":
                    found.append(p)
            except (OSError, psutil.Error):
                continue
        return found

    def stop(self) -> None:
        """SIGTERM to ``ray start --block`` (it stops what it started); kill what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        deadline = time.monotonic() + within(15)
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in self.processes():
            p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    folder = Path(tempfile.mkdtemp(prefix="fedavg-rayhead-", dir="/tmp"))  # short socket paths
    port = _free_port()
    log = open(folder / "head.log", "w")  # noqa: SIM115 - closed below
    ray_cli = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={folder / 'ray'}", "--block"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_TMPDIR": str(folder)})
    head = Head(f"127.0.0.1:{port}", folder, proc)
    try:
        deadline = time.monotonic() + within(120)
        while "block forever" not in (folder / "head.log").read_text():
            assert proc.poll() is None, (folder / "head.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        yield head
    finally:
        head.stop()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.e2e
def test_simulation_runs_on_an_existing_ray_cluster_which_outlives_it(ray_head, tmp_path,
                                                                       no_leaks):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "run"
    started = time.time()
    run_cli("simulate", "--ray-address", ray_head.address, "--num-nodes", 4, "--rounds", 2,
            "--output", out, env={"TMPDIR": str(tmp)})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["num_nodes"] == 4
    assert summary["accuracy"] > 0.5
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_nodes"] for r in rounds] == [4, 4]
    # The run was a job of this cluster: its driver and node workers logged in the head's
    # session folder, after the run started.
    logs = list((ray_head.folder / "ray").glob("session_*/logs/*"))
    drivers = [f for f in logs if f.name.startswith("python-core-driver-")
               and f.stat().st_mtime >= started]
    workers = [f for f in logs if f.name.startswith("python-core-worker-")
               and f.stat().st_mtime >= started]
    assert drivers and workers, sorted(f.name for f in logs)
    # The cluster is still up, the run's node actors are gone, and the run left no folder.
    assert ray_head.proc.poll() is None
    deadline = time.monotonic() + within(20)
    while any("ClientAppActor" in " ".join(p.info["cmdline"] or [])
              for p in ray_head.processes()):
        assert time.monotonic() < deadline, "node actors outlived the run"
        time.sleep(0.5)
    assert list(tmp.iterdir()) == []
    ray_head.stop()
    assert ray_head.processes() == []


def test_an_address_nothing_answers_at_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        proc = run_cli("simulate", "--ray-address", f"127.0.0.1:{port}", "--rounds", 1,
                       "--output", tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert "no Ray cluster answers at" in assert_one_error_line(proc.stderr)
    assert not (tmp_path / "run").exists()
    proc = run_cli("simulate", "--ray-address", "head-without-port", "--rounds", 1,
                   "--output", tmp_path / "run", check=False)
    assert "write HOST:PORT" in assert_one_error_line(proc.stderr)


def test_auto_is_the_cluster_ray_start_recorded_never_any_running_instance(tmp_path,
                                                                          monkeypatch):
    from fedavg.engines.simulation.simulate import cluster_address
    from fedavg.util.errors import UserError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with pytest.raises(UserError, match="no cluster started with `ray start`"):
        cluster_address("auto")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address + "\n")
        assert cluster_address("auto") == address
        assert cluster_address(f" {address} ") == address
        monkeypatch.setenv("RAY_ADDRESS", address)
        (tmp_path / "ray" / "ray_current_cluster").unlink()
        assert cluster_address("auto") == address
    for bad in ("", "  ", "::1", "127.0.0.1:99999", "ray://127.0.0.1:10001", "h:0"):
        with pytest.raises(UserError, match="write HOST:PORT"):
            cluster_address(bad)
