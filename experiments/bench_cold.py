"""Cold start: the default ``fedavg simulate`` (digits), its wall time and start-up phases.

Usage::

    python experiments/bench_cold.py [--runs 5] [--against DIR] [--json FILE]

One warm-up run of each source tree first (so the OS has the files cached), then ``--runs``
measured runs. With ``--against DIR`` (another checkout of fedavg, for example one made with
``git worktree add /tmp/before <commit>``) the runs of this checkout and of ``DIR``
alternate, so that both see the same machine, and the ratio of their median wall times is
printed. Every run is ``python -m fedavg.cli simulate`` with its source tree first on
``PYTHONPATH`` and a temporary folder of its own (removed afterwards, checked to hold none of
our folders).

Printed per tree, as medians over the runs (seconds):

- wall: from the command's start to its exit;
- the ``startup_s`` phases of ``summary.json`` (:mod:`fedavg.util.timeline`): ``imports``,
  ``prepare``, ``node_data``, ``ray_start``, ``engine_start``, ``round1``, ``stop``;
- round: the median of rounds 2 and later (``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("imports", "prepare", "node_data", "ray_start", "engine_start", "round1", "stop")


def run_once(tree: Path, timeout_s: float = 300.0) -> dict:
    """Run the default ``fedavg simulate`` from ``tree``; return its wall time and phases.

    Raises
    ------
    RuntimeError
        The run failed, ran past ``timeout_s`` or left a folder of ours in its ``TMPDIR``.
    """
    work = Path(tempfile.mkdtemp(prefix="bc", dir="/tmp"))  # short: Ray's socket paths
    try:
        (work / "tmp").mkdir()
        env = {**os.environ, "TMPDIR": str(work / "tmp"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(tree),
                                                           os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "fedavg.cli", "simulate", "--output", str(work / "run")]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                              cwd=work)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{tree}: fedavg simulate exited {proc.returncode}:\n"
                               f"{(proc.stdout + proc.stderr)[-2000:]}")
        left = list((work / "tmp").glob("fedavg-*"))  # torch's own cache folder may stay
        if left:
            raise RuntimeError(f"{tree}: the run left {left} in its TMPDIR")
        summary = json.loads((work / "run" / "summary.json").read_text())
        rounds = [json.loads(line) for line in
                  (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steady = [r["wall_s"] for r in rounds if r.get("round", 0) >= 2 and "wall_s" in r]
        return {"wall": wall, **summary.get("startup_s", {}),
                "round": statistics.median(steady) if steady else float("nan"),
                "accuracy": summary["accuracy"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def medians(runs: list[dict]) -> dict:
    """Return the median of every figure over ``runs``."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def table(results: dict[str, dict]) -> str:
    """Format the per-tree medians, one row per tree."""
    cols = ("wall", *PHASES, "round")
    lines = ["tree      " + "".join(f"{c:>13}" for c in cols),
             *(f"{name:<10}" + "".join(f"{m.get(c, float('nan')):>13.2f}" for c in cols)
               for name, m in results.items())]
    return "\n".join(lines)


def main() -> int:
    """Run the benchmark; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured runs per tree")
    parser.add_argument("--against", type=Path, help="another fedavg checkout to compare")
    parser.add_argument("--json", type=Path, help="also write the runs here")
    args = parser.parse_args()
    trees = {"this": ROOT}
    if args.against is not None:
        if not (args.against / "fedavg" / "__init__.py").exists():
            print(f"error: {args.against} is not a fedavg checkout", file=sys.stderr)
            return 2
        trees["against"] = args.against.resolve()
    for tree in trees.values():
        run_once(tree)  # warm-up: the OS cache, Python's bytecode
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(run_once(tree))
            print(f"run {i + 1} {name}: {runs[name][-1]['wall']:.2f} s", flush=True)
    results = {name: medians(r) for name, r in runs.items()}
    print(table(results))
    if "against" in results:
        ratio = results["this"]["wall"] / results["against"]["wall"]
        print(f"wall time, this / against: {ratio:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()},
                                         "runs": runs, "medians": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
