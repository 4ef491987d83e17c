"""Differential privacy on MNIST: accuracy against epsilon, record level and node level.

Usage::

    python experiments/bench_privacy.py [--data ../shared/data/mnist] [--rounds 10]
        [--legs plain sgd-z1.3 sgd-z0.8 ...] [--out runs/bench-privacy]

Each leg is one ``fedavg simulate`` (its own process, as a user runs it) on MNIST with the
``cnn``; every leg but ``node-*`` trains 10 IID nodes, all in every round, 1 local epoch at
batch 256 with SGD (lr 0.5, momentum 0.5):

- ``plain``: no DP, the same settings: what the noise costs.
- ``sgd-zZ``: record-level DP, DP-SGD on every node (``--dp-sgd``) at noise multiplier
  ``Z``, each sample's gradient clipped to L2 1. A node of 6,000 samples samples each at
  ``q = 1/24`` and takes 24 steps a round.
- ``node-zZ``: node-level DP (DP-FedAvg) with 1,000 nodes of 60 samples, 10 % sampled a
  round, each update clipped to ``--clip`` (default 0.5), noise multiplier ``Z``; nodes
  train 1 local epoch at batch 32, SGD lr 0.1, momentum 0.
- ``node-plain``: that setting without DP.
- ``digits-plain-N`` / ``digits-secagg-N``: secure aggregation's cost, on built-in digits
  with the ``mlp``, N IID nodes, 5 rounds, without and with ``--secure-aggregation``
  (Flower's SecAgg+); the table gives the median round time and, beside it, the slowest
  node's training time: what is left is the round's messaging (SecAgg+'s four exchanges,
  its key agreement, sharing and masking).

Epsilon is reported at delta 1e-5. Writes ``results.md``, ``results.json`` and
``accuracy_vs_epsilon.png`` (each DP leg's accuracy after every round against the epsilon
spent by then) in ``--out``; a leg that finished before is read back, not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RECORD = ["--num-nodes", "10", "--batch-size", "256", "--lr", "0.5", "--momentum", "0.5"]
NODE = ["--num-nodes", "1000", "--fraction", "0.1", "--batch-size", "32", "--lr", "0.1",
        "--momentum", "0"]
DEFAULT_LEGS = ["plain", "sgd-z1.3", "sgd-z0.8", "node-plain", "node-z1.0"]


def leg_args(leg: str, clip: float) -> list[str]:
    """Return the ``fedavg simulate`` options of a leg such as ``sgd-z1.3``."""
    if leg.startswith("digits-"):
        _, kind, nodes = leg.split("-")
        return ["--num-nodes", nodes, "--rounds", "5"] + (
            ["--secure-aggregation"] if kind == "secagg" else [])
    if leg == "plain":
        return RECORD
    if leg == "node-plain":
        return NODE
    kind, _, z = leg.partition("-z")
    if kind == "sgd":
        return RECORD + ["--dp-sgd", "--dp-noise", z, "--dp-max-grad-norm", "1",
                         "--dp-delta", "1e-5"]
    if kind == "node":
        return NODE + ["--dp-noise", z, "--dp-clip", str(clip), "--dp-delta", "1e-5"]
    raise SystemExit(f"unknown leg {leg!r}: plain, node-plain, sgd-zZ or node-zZ")


def run_leg(leg: str, data: Path, rounds: int, out: Path, clip: float) -> list[dict]:
    """Run one leg (or read it back if it finished before); return its rounds."""
    folder = out / leg
    if not (folder / "summary.json").exists():
        where = [] if leg.startswith("digits-") else ["--dataset", str(data), "--model", "cnn",
                                                         "--rounds", str(rounds)]
        cmd = [sys.executable, "-m", "fedavg.cli", "simulate", *where, "--output",
               str(folder), "--overwrite", *leg_args(leg, clip)]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "FEDAVG_BENCH": "1"})
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def summarise(leg: str, rounds: list[dict]) -> dict:
    """One leg's row: epsilon, final and best accuracy, round time."""
    return {"leg": leg, "rounds": len(rounds),
            "epsilon": rounds[-1].get("epsilon"),
            "final": rounds[-1]["accuracy"], "best": max(r["accuracy"] for r in rounds),
            "median_round_s": statistics.median(r["wall_s"] for r in rounds),
            "median_train_s": statistics.median(r.get("train_s") or 0.0 for r in rounds),
            "curve": [(r.get("epsilon"), r["accuracy"]) for r in rounds]}


def write_results(rows: list[dict], out: Path, command: str) -> None:
    """Write the table, the JSON and the accuracy-against-epsilon plot."""
    lines = ["| leg | rounds | epsilon (delta 1e-5) | final accuracy | best | median round | "
             "its slowest node's training |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        lines.append(f"| {r['leg']} | {r['rounds']} | {eps} | {r['final']:.4f} | "
                     f"{r['best']:.4f} | {r['median_round_s']:.2f} s | "
                     f"{r['median_train_s']:.2f} s |")
    text = f"```\n{command}\n```\n\n" + "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        points = [(e, a) for e, a in r["curve"] if e is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=r["leg"])
    ax.set_xlabel("epsilon spent (delta 1e-5)")
    ax.set_ylabel("test accuracy")
    ax.set_title("MNIST, cnn: accuracy against epsilon, round by round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=110)


def main() -> None:
    """Run the legs asked for (or read them back) and write the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path,
                   default=Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--clip", type=float, default=0.5, help="node-level legs' --dp-clip")
    p.add_argument("--legs", nargs="+", default=DEFAULT_LEGS)
    p.add_argument("--out", type=Path, default=Path("runs/bench-privacy"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = [summarise(leg, run_leg(leg, a.data, a.rounds, a.out, a.clip)) for leg in a.legs]
    write_results(rows, a.out, "python experiments/bench_privacy.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
