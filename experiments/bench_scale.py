"""Scale: start-up, round time and memory from 10 to 10,000 simulated nodes, in one run.

Usage::

    python experiments/bench_scale.py [--rounds 6] [--points 10:digits,100:digits,...]
                                      [--json FILE]

Each point is one ``fedavg simulate`` process, run one after another as a user would
(``bench_memory.run``: its own temporary folder, the memory of every process it starts
sampled from ``/proc``). The fraction is ``10 / nodes``, so 10 nodes train in every round
whatever the number of nodes; the defaults are 10, 100 and 1,000 nodes on digits (1,438
training samples: one or two per node at 1,000) and 100, 1,000 and 10,000 nodes on MNIST (6
per node at 10,000). A round's time includes evaluating the merged model on the test split
(359 digits, or 10,000 MNIST images with the ``cnn``), so rounds compare within a dataset.

Per point it prints:

- start-up: seconds from the command's start to the start of round 1 (imports, data,
  partitioning, Ray);
- round 1 (which also spawns Ray's node actors) and the median of the later rounds, in
  seconds, from the run's own ``metrics.jsonl``;
- end: seconds from the last round's line to the command's exit (model saved, Ray stopped);
- peak PSS of all the run's processes, and PSS after the last round, in MiB.

and, against the 100-node point of the same dataset, the ratios of the peak memory and of
the median round (flat scale: within 1.2 and 1.3 up to 10,000 nodes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import bench_memory

MIB = 1024 * 1024
MNIST = "../shared/data/mnist"
DEFAULT_POINTS = f"10:digits,100:digits,1000:digits,100:{MNIST},1000:{MNIST},10000:{MNIST}"


def measure(num_nodes: int, dataset: str, rounds: int, extra: list[str]) -> dict:
    """Run one point; return its figures (seconds, bytes)."""
    fraction = min(1.0, 10 / num_nodes)
    result = bench_memory.run(num_nodes, fraction, rounds, extra, dataset=dataset,
                              timeout_s=1800.0)
    rows = result["metrics"]
    first = result["at_round"].get(1)
    last = result["at_round"].get(len(rows))
    later = [r["wall_s"] for r in rows[1:]]
    return {
        "num_nodes": num_nodes, "dataset": dataset, "fraction": fraction,
        "trained_per_round": [r["num_nodes"] for r in rows],
        "startup_s": round(first["t_s"] - rows[0]["wall_s"], 2) if first else None,
        "round1_s": rows[0]["wall_s"],
        "round_median_s": round(statistics.median(later), 3) if later else None,
        "end_s": round(result["wall_s"] - last["t_s"], 2) if last else None,
        "wall_s": result["wall_s"],
        "peak_pss": result["peak"]["pss"] if result["peak"] else None,
        "last_pss": last["pss"] if last else None,
        "accuracy": rows[-1]["accuracy"],
    }


def table(points: list[dict]) -> str:
    """One row per point, with the ratios to the 100-node point of its dataset, if any."""
    bases = {p["dataset"]: p for p in points if p["num_nodes"] == 100}
    head = ("nodes  dataset  start-up s  round 1 s  round s  end s  wall s  peak MiB  "
            "last MiB  accuracy  peak/100  round/100")
    rows = [head]
    for p in points:
        ratios, base = ["", ""], bases.get(p["dataset"])
        if base is not None and base["peak_pss"] and base["round_median_s"]:
            ratios = [f"{p['peak_pss'] / base['peak_pss']:.2f}",
                      f"{p['round_median_s'] / base['round_median_s']:.2f}"]
        rows.append(f"{p['num_nodes']:>5}  {Path(p['dataset']).name:>7}  "
                    f"{p['startup_s']:>10.1f}  {p['round1_s']:>9.1f}  "
                    f"{p['round_median_s']:>7.2f}  {p['end_s']:>5.1f}  {p['wall_s']:>6.1f}  "
                    f"{p['peak_pss'] / MIB:>8.0f}  {p['last_pss'] / MIB:>8.0f}  "
                    f"{p['accuracy']:>8.4f}  {ratios[0]:>8}  {ratios[1]:>9}")
    return "\n".join(rows)


def parse_points(text: str) -> list[tuple[int, str]]:
    """``"10:digits,10000:PATH"`` -> ``[(10, "digits"), (10000, "PATH")]``."""
    points = []
    for item in filter(None, text.split(",")):
        nodes, _, dataset = item.partition(":")
        if not nodes.isdigit() or int(nodes) < 1 or not dataset:
            raise SystemExit(f"error: --points item {item!r} is not NODES:DATASET")
        points.append((int(nodes), dataset))
    return points


def main(argv: list[str] | None = None) -> int:
    """Run every point, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=DEFAULT_POINTS,
                        help="comma-separated NODES:DATASET (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("extra", nargs="*", help="more `fedavg simulate` options (after --)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is reported apart)")
    points, failed = [], None
    for nodes, dataset in parse_points(args.points):
        try:
            points.append(measure(nodes, dataset, args.rounds, args.extra))
        except (RuntimeError, KeyboardInterrupt) as exc:  # keep the points measured so far
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "interrupted"
            reason = reason.removeprefix("error: ")
            failed = f"error: {nodes} nodes on {dataset}: {reason}"
            break
        print(f"{nodes} nodes on {dataset}: {points[-1]['wall_s']:.1f} s", flush=True)
    if points:
        print(f"fedavg simulate, 10 nodes trained per round, {args.rounds} rounds")
        print(table(points))
        if args.json is not None:
            args.json.write_text(json.dumps(points, indent=1) + "\n")
    if failed is not None:
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
