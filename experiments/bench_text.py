"""Text classification on AG News: federated against centralised, with the same budget.

Usage::

    python experiments/bench_text.py [--data ../shared/data/ag_news] [--nodes 5]
        [--rounds 10] [--out runs/bench-text] [--markdown experiments/results/text.md]

Every run trains the default text model (``fasttext``: hashed word + bigram embeddings,
summed, then linear; Joulin et al. 2016) with SGD (lr 0.05, momentum 0.9, batch 32: the
defaults) for the same number of sample-epochs: ``rounds`` passes over the 5,000 training
texts.

- centralised: one node holding all the data, ``rounds`` rounds of one local epoch;
- FedAvg IID and Dirichlet(0.5): ``--nodes`` nodes, ``rounds`` rounds of one local epoch;
- one-shot: the same nodes train ``rounds`` local epochs once; their models are merged by
  an output ensemble, and each node model is scored alone (``--save-node-models``).

Test accuracy on the 1,000-row test split, and each run's wall time (Ray start included).
Targets: FedAvg IID >= 0.85 and within 2 points of centralised; the one-shot ensemble
above the best single node.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

import fedavg
from fedavg.config.settings import RunConfig

SGD = {"lr": 0.05, "momentum": 0.9, "batch_size": 32}  # the defaults


def _run(name: str, out: Path, console: Console, **settings) -> dict:
    config = RunConfig().replace(**SGD, **settings)
    result = fedavg.simulate(config, output=out / name, console=console, overwrite=True)
    return {"run": name, "accuracy": result.accuracy, "wall_s": round(result.wall_s, 1),
            "rounds": len(result.rounds)}


def _single_nodes(run: Path) -> dict[str, float]:
    scores = {}
    for folder in sorted((run / "nodes").iterdir()):
        scores[folder.name] = fedavg.evaluate_model(folder)["accuracy"]
    return scores


def main() -> None:
    """Run the four settings one after another and print one table."""
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(root.parent / "shared" / "data" / "ag_news"))
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="runs/bench-text")
    parser.add_argument("--markdown", default=None, help="Also write the table here")
    args = parser.parse_args()
    console, out = Console(), Path(args.out)
    common = {"dataset": args.data, "seed": 0}
    rows = [
        _run("centralised", out, console, num_nodes=1, rounds=args.rounds, **common),
        _run("fedavg-iid", out, console, num_nodes=args.nodes, rounds=args.rounds, **common),
        _run("fedavg-dirichlet-0.5", out, console, num_nodes=args.nodes, rounds=args.rounds,
             partitioner="dirichlet", alpha=0.5, **common),
        _run("one-shot-ensemble", out, console, num_nodes=args.nodes, rounds=1,
             local_epochs=args.rounds, strategy="ensemble", save_node_models=True, **common),
    ]
    singles = _single_nodes(out / "one-shot-ensemble")
    best = max(singles, key=singles.get)
    rows.append({"run": f"one-shot: best single node ({best})", "accuracy": singles[best],
                 "wall_s": None, "rounds": 1})
    acc = {r["run"]: r["accuracy"] for r in rows}
    checks = {
        "FedAvg IID >= 0.85": acc["fedavg-iid"] >= 0.85,
        "FedAvg IID within 2 points of centralised":
            acc["centralised"] - acc["fedavg-iid"] <= 0.02,
        "ensemble > best single node": acc["one-shot-ensemble"] > singles[best],
    }
    table = Table(title=f"AG News (5,000 train / 1,000 test), fasttext, {args.rounds} "
                        "epochs of budget per run")
    for col in ("run", "test accuracy", "wall s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        table.add_row(r["run"], f"{r['accuracy']:.2%}",
                      "" if r["wall_s"] is None else f"{r['wall_s']:.1f}")
    console.print(table)
    for what, ok in checks.items():
        console.print(f"{'[green]met[/]' if ok else '[red]not met[/]'}: {what}")
    (out / "results.json").write_text(json.dumps(
        {"rows": rows, "single_nodes": singles, "targets": checks}, indent=2) + "\n")
    if args.markdown:
        lines = ["| run | test accuracy | wall s |", "|---|---:|---:|"]
        lines += [f"| {r['run']} | {r['accuracy']:.2%} | "
                  f"{'' if r['wall_s'] is None else r['wall_s']} |" for r in rows]
        lines += [""] + [f"- {'met' if ok else 'NOT met'}: {what}" for what, ok in checks.items()]
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
