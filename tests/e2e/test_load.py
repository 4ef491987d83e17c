"""End-to-end load: 100 simulated nodes, 10 % of them per round, 20 rounds on digits.

The run's memory (the command and every process it started: Ray's GCS server, raylet,
workers) must not grow with the rounds: after round 19 (taken while round 20 runs; the
sample at round 20's end may race the run's shutdown) it is within 10 % of that after
round 5, in anonymous + shared memory (the PSS of heaps, tensors and Ray's object store,
which a leak grows) and in RSS. Measured by ``experiments/bench_memory.py``, which runs the
real CLI. (The whole PSS also moves when unrelated processes that map torch's libraries
start or stop on the machine, so it is reported, not asserted.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a real simulation on Ray

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def test_memory_does_not_grow_over_20_rounds_of_100_nodes(tmp_path):
    """Completes, reports the peak, and memory after round 19 <= 1.10 x after round 5."""
    figures = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_memory.py"), "--num-nodes", "100",
         "--fraction", "0.1", "--rounds", "20", "--compare", "5", "--json", str(figures),
         "--keep", str(tmp_path)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)  # the table, for the log
    result = json.loads(figures.read_text())
    run = tmp_path / "run"
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, 21))
    assert all(r["num_nodes"] == 10 for r in rounds)  # 10 % of 100 nodes
    assert json.loads((run / "summary.json").read_text())["rounds"] == 20
    after5, after19 = result["at_round"]["5"], result["at_round"]["19"]
    # both samples saw the whole run, node actors included
    assert after5["processes"] == after19["processes"], (after5, after19)
    assert any(name.startswith(("raylet", "gcs_server")) for name in after19["processes"])
    assert after19["processes"].get("ray::ClientAppActor", 0) >= 1
    assert sum(after19["processes"].values()) >= 4
    peak = result["peak"]
    assert peak["pss"] >= max(after5["pss"], after19["pss"])
    assert "peak" in proc.stdout and "after round 19 / after round 5" in proc.stdout
    for key in ("anon", "rss"):
        assert after19[key] <= 1.10 * after5[key], (
            f"{key} grew from {after5[key] / MIB:.0f} MiB after round 5 to "
            f"{after19[key] / MIB:.0f} MiB after round 19")
    assert result["tmp_left"] == [] or all(
        name.startswith("torchinductor_") for name in result["tmp_left"])
