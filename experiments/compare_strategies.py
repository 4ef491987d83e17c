"""Multi-round strategies side by side on one dataset and partition, in one run.

Usage::

    python experiments/compare_strategies.py [--data ../shared/data/mnist] [--alpha 0.5]
        [--nodes 10] [--rounds 10] [--strategies fedavg fedprox fedadam fedmedian]

Every strategy sees the same partitions (same seed), model initialisation and node
settings. Prints final and best test accuracy, the first round reaching ``--target`` and wall
time per strategy, and writes ``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

import fedavg


def main() -> None:
    """Run every strategy on the same partitions, print the table and write the results."""
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(root.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--partitioner", default="dirichlet")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--strategies", nargs="+",
                        default=["fedavg", "fedprox", "fedadam", "fedmedian"])
    parser.add_argument("--out", default="runs/compare-strategies")
    args = parser.parse_args()

    console = Console()
    results = {}
    for name in args.strategies:
        console.rule(name)
        res = fedavg.simulate(dataset=args.data, partitioner=args.partitioner, alpha=args.alpha,
                              num_nodes=args.nodes, rounds=args.rounds,
                              local_epochs=args.local_epochs, model=args.model, strategy=name,
                              output=Path(args.out) / name, console=console)
        accs = [r["accuracy"] for r in res.rounds]
        reached = next((r["round"] for r in res.rounds if r["accuracy"] >= args.target), None)
        results[name] = {"final": accs[-1], "best": max(accs), "round_reaching_target": reached,
                         "wall_s": res.wall_s, "accuracy_per_round": accs}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title=f"{Path(args.data).name}, {args.partitioner}"
                        f"{f'({args.alpha})' if args.partitioner == 'dirichlet' else ''}, "
                        f"{args.nodes} nodes, {args.rounds} rounds, model {args.model}")
    for col in ("strategy", "final acc", "best acc", f"first round >= {args.target}", "wall s"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['final']:.4f}", f"{r['best']:.4f}",
                      str(r["round_reaching_target"] or "-"), f"{r['wall_s']:.0f}")
    console.print(table)


if __name__ == "__main__":
    main()
