"""Robust aggregation under attack: 2 of 10 nodes send scaled or sign-flipped updates every round.

Usage::

    python experiments/bench_robust.py [--data ../shared/data/mnist] [--rounds 5]
        [--attacks none scale sign-flip] [--max-update-norm 20]

MNIST, Dirichlet(0.5), 10 nodes, all nodes every round. Nodes 0 and 1 are attackers: their
update ``w - w_round`` reaches the coordinator multiplied by ``--scale`` (``scale``) or by
-1 (``sign-flip``). The attack is injected in this process, where the coordinator reads the
replies (a wrapper of ``fedavg.run.flower_adapter.parse_reply``), so the nodes train honestly
and every defence sees exactly what a real attacker would send. Prints one table of final
test accuracy per method and attack, and the median honest update norm (to choose
``--max-update-norm``); writes ``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import fedavg
import strategies
from fedavg.run import flower_adapter

ATTACKERS = (0, 1)
#: method label -> settings of ``fedavg.simulate``
METHODS = {
    "fedavg": {"strategy": "fedavg"},
    "fedmedian": {"strategy": "fedmedian"},
    "trimmed-mean (beta 0.2)": {"strategy": "trimmed-mean", "beta": 0.2},
    "krum (f=2)": {"strategy": "krum", "num_malicious": 2},
    "multi-krum (f=2)": {"strategy": "multi-krum", "num_malicious": 2},
    "fedavg + max-update-norm": {"strategy": "fedavg"},
}


class Attack:
    """Rewrite the replies of the attacking partitions as they reach the coordinator."""

    def __init__(self) -> None:
        self.kind = "none"
        self.factor = 1.0
        self.reference: dict[str, torch.Tensor] | None = None
        self.honest_norms: list[float] = []
        self._parse = flower_adapter.parse_reply
        self._configure = flower_adapter.FlowerAdapter.configure_train

    def install(self) -> None:
        """Wrap the coordinator's reply parser and round start."""
        attack = self

        def configure_train(adapter, *args, **kwargs):
            out = attack._configure(adapter, *args, **kwargs)
            attack.reference = adapter.reference
            return out

        def parse_reply(msg):
            state, weight, metrics = attack._parse(msg)
            partition = int(metrics.get("partition-id", -1))
            if attack.reference is None:
                return state, weight, metrics
            if partition in ATTACKERS and attack.kind != "none":
                state = {k: (attack.reference[k] + attack.factor * (v - attack.reference[k])
                             if v.is_floating_point() else v) for k, v in state.items()}
            elif partition not in ATTACKERS:
                attack.honest_norms.append(strategies.update_norm(attack.reference, state))
            return state, weight, metrics

        flower_adapter.FlowerAdapter.configure_train = configure_train
        flower_adapter.parse_reply = parse_reply


def main() -> None:
    """Run every method under every attack, print the table and write the results."""
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(root.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--max-update-norm", type=float, default=20.0)
    parser.add_argument("--attacks", nargs="+", default=["none", "scale", "sign-flip"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--out", default="runs/bench-robust")
    args = parser.parse_args()

    console = Console()
    attack = Attack()
    attack.install()
    results: dict[str, dict[str, float]] = {}
    out = Path(args.out)
    for kind in args.attacks:
        attack.kind = kind
        attack.factor = {"none": 1.0, "scale": args.scale, "sign-flip": -1.0}[kind]
        for label in args.methods:
            settings = dict(METHODS[label])
            if label.endswith("max-update-norm"):
                settings["max_update_norm"] = args.max_update_norm
            console.rule(f"{label}, attack {kind}")
            attack.honest_norms.clear()
            res = fedavg.simulate(dataset=args.data, partitioner="dirichlet", alpha=args.alpha,
                                  num_nodes=args.nodes, rounds=args.rounds, model=args.model,
                                  output=out / kind / label.split()[0].replace("+", "norm"),
                                  overwrite=True, console=console, **settings)
            results.setdefault(label, {})[kind] = res.accuracy
            if kind == "none" and attack.honest_norms:
                results[label]["median_honest_update_norm"] = statistics.median(
                    attack.honest_norms)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title=f"{Path(args.data).name}, Dirichlet({args.alpha}), {args.nodes} nodes "
                        f"(2 attackers), {args.rounds} rounds, model {args.model}; final test "
                        f"accuracy")
    table.add_column("method")
    for kind in args.attacks:
        table.add_column({"scale": f"scaled x{args.scale:g}"}.get(kind, kind), justify="right")
    for label, row in results.items():
        table.add_row(label, *(f"{row[k]:.4f}" if k in row else "-" for k in args.attacks))
    console.print(table)
    norms = [r["median_honest_update_norm"] for r in results.values()
             if "median_honest_update_norm" in r]
    if norms:
        console.print(f"median honest update norm: {statistics.median(norms):.3f} "
                      f"(--max-update-norm {args.max_update_norm:g})")


if __name__ == "__main__":
    main()
