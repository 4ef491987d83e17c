"""Model-merging methods on node models that share a start: one shot, then per round.

Usage::

    python experiments/bench_merge.py [--setting digits] [--nodes 5] [--local-epochs 5]
        [--rounds 5] [--out runs/bench-merge] [--markdown experiments/results/merge.md]

Per setting and partition (IID, and Dirichlet(0.1): strong label skew), one run trains
``--nodes`` nodes once from the same start (``--strategy distill --rounds 1
--save-node-models``: the run's own result is the distilled model, and it keeps the node
models and their start). The same node models are then merged by every one-shot method:
the sample-weighted average, the uniform and greedy soups, task arithmetic, TIES, DARE,
DARE-TIES and the output ensemble. Fisher merging needs the nodes' estimates, sent with
their models: a second run per partition (``--strategy fisher``) gives it, beside the average
of that run's own node models (not with LoRA, whose adapted weights are frozen). Then each
parameter-merging method runs ``--rounds`` rounds on the skewed split.

Settings (``--setting``):

- ``digits``: the built-in 8x8 digits and its default model (seconds per run on a CPU);
- ``minilm``: ``--train-samples`` / ``--test-samples`` rows of the AG News sample (5,000 /
  1,000 by default, drawn at random, seeded), ``minilm`` full fine-tuning (Adam, lr 5e-5, 64
  tokens);
- ``minilm-lora``: the same with LoRA r = 8, exact merging (lr 1e-3);
- ``efficientnet``: as many CIFAR-10 images, ``efficientnet-lite0`` from ImageNet weights
  (SGD lr 0.01, momentum 0.9).

``--rounds 0`` leaves out the per-round legs; ``--distill-steps`` sets distillation's steps.

Per method: test accuracy, and bytes nodes -> coordinator per round (from the run's
``summary.json``: every method here merges the same node messages). Target (the issue's): on
the skewed one-shot split, at least one of TIES / DARE / Fisher beats the one-shot average
of the same node models by >= 2 points.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import fedavg
from fedavg.config.settings import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FEDAVG_SHARED_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(ROOT / "experiments"))

ONE_SHOT = (("average", {}), ("uniform-soup", {}), ("greedy-soup", {}),
            ("task-arithmetic", {}), ("ties", {}), ("dare", {}), ("dare-ties", {}),
            ("ensemble", {}))
PER_ROUND = ("fedavg", "task-arithmetic", "ties", "dare", "dare-ties", "fisher")
PARTITIONS = {"iid": {"partitioner": "iid"},
              "dirichlet-0.1": {"partitioner": "dirichlet", "alpha": 0.1}}


def subset(name: str, work: Path, train: int, test: int) -> str:
    """Write ``train`` / ``test`` rows of dataset ``name`` drawn at random (seeded); its path."""
    from bench_pretrained import cifar_subset

    return str(cifar_subset(work / f"{name}-{train}-{test}", train, test, source=name))


def setting(name: str, work: Path, train: int, test: int) -> tuple[str, dict]:
    """Return the dataset and the run settings of setting ``name``."""
    if name == "digits":
        return "digits", {}
    text = {"model": "minilm", "optimizer": "adam", "lr": 5e-5, "max_tokens": 64}
    if name == "minilm":
        return subset("ag_news", work, train, test), text
    if name == "minilm-lora":
        return subset("ag_news", work, train, test), {
            **text, "lr": 1e-3, "lora_rank": 8, "lora_alpha": 16.0}
    if name == "efficientnet":
        return subset("cifar10", work, train, test), {
            "model": "efficientnet-lite0", "lr": 0.01, "momentum": 0.9}
    raise SystemExit(f"error: unknown --setting {name!r}: digits, minilm, minilm-lora, "
                     "efficientnet")


def one_shot(dataset: str, settings: dict, partition: dict, args, out: Path) -> dict:
    """Train the nodes once; merge their models by every method; return accuracy by method."""
    common = dict(dataset=dataset, num_nodes=args.nodes, rounds=1, save_node_models=True,
                  local_epochs=args.local_epochs, seed=args.seed, round_timeout=86400.0,
                  **partition, **settings)
    config = RunConfig().replace(strategy="distill", distill_steps=args.distill_steps, **common)
    run = fedavg.simulate(config, output=out / "run", overwrite=True)
    summary = json.loads(run.summary_path.read_text())
    rows = {"distill": run.accuracy}
    for name, options in ONE_SHOT:
        merge = RunConfig().replace(strategy=name, seed=args.seed, validation=dataset,
                                    **options) if name == "greedy-soup" else \
            RunConfig().replace(strategy=name, seed=args.seed, **options)
        res = fedavg.merge_models([out / "run" / "nodes"], out / name, merge, dataset=dataset,
                                  overwrite=True)
        rows[name] = res["accuracy"]
        print(f"  {name}: {res['accuracy']:.4f}", flush=True)
    if settings.get("lora_rank"):  # LoRA's adapted weights are frozen: no Fisher of them
        return {"accuracy": rows, "bytes_from_nodes": summary["bytes_from_nodes"]}
    # Fisher: the nodes also send their estimate; a run of its own (the distill run keeps
    # held-out slices from its nodes, this one does not), compared with its own nodes' average
    fisher = fedavg.simulate(RunConfig().replace(strategy="fisher", **common),
                             output=out / "fisher-run", overwrite=True)
    rows["fisher"] = fisher.accuracy
    res = fedavg.merge_models([out / "fisher-run" / "nodes"], out / "fisher-average",
                              RunConfig().replace(strategy="average"), dataset=dataset,
                              overwrite=True)
    rows["average (fisher run's nodes)"] = res["accuracy"]
    print(f"  fisher: {fisher.accuracy:.4f} (its nodes' average {res['accuracy']:.4f})",
          flush=True)
    fisher_summary = json.loads(fisher.summary_path.read_text())
    return {"accuracy": rows, "bytes_from_nodes": summary["bytes_from_nodes"],
            "fisher_bytes_from_nodes": fisher_summary["bytes_from_nodes"]}


def per_round(dataset: str, settings: dict, args, out: Path) -> dict:
    """Run every parameter-merging method over ``args.rounds`` rounds on the skewed split."""
    rows = {}
    for name in PER_ROUND:
        config = RunConfig().replace(
            dataset=dataset, num_nodes=args.nodes, rounds=args.rounds, strategy=name,
            seed=args.seed, round_timeout=86400.0, **PARTITIONS["dirichlet-0.1"], **settings)
        run = fedavg.simulate(config, output=out / name, overwrite=True)
        rows[name] = run.accuracy
        print(f"  per round {name}: {run.accuracy:.4f}", flush=True)
    return rows


def markdown(results: dict, args, command: str) -> str:
    """Return the results page: one-shot tables, the per-round table, the target."""
    lines = [f"# Model merging on `{args.setting}`: {args.nodes} nodes", "",
             f"Reproduce: `{command}`", "",
             f"One shot: each node trains {args.local_epochs} local epochs from the same start; "
             "the same node models are merged by each method (test accuracy).", "",
             "| method | " + " | ".join(PARTITIONS) + " |",
             "|---|" + "---:|" * len(PARTITIONS)]
    methods = ["distill"] + [m for m, _ in ONE_SHOT] + ["fisher", "average (fisher run's nodes)"]
    for m in methods:
        if m in results["one_shot"]["iid"]["accuracy"]:  # no Fisher rows for LoRA
            lines.append(f"| {m} | " + " | ".join(
                f"{results['one_shot'][p]['accuracy'][m]:.4f}" for p in PARTITIONS) + " |")
    lines += ["", "Bytes nodes -> coordinator, the one round: " + ", ".join(
        f"{p} {results['one_shot'][p]['bytes_from_nodes']:,}" for p in PARTITIONS)
        + ("; with Fisher estimates: " + ", ".join(
            f"{p} {results['one_shot'][p]['fisher_bytes_from_nodes']:,}" for p in PARTITIONS)
           if "fisher_bytes_from_nodes" in results["one_shot"]["iid"] else "")]
    if results["per_round"]:
        lines += ["", f"Per round: {args.rounds} rounds of 1 local epoch, Dirichlet(0.1) "
                  "(test accuracy).", "", "| method | accuracy |", "|---|---:|"]
        lines += [f"| {m} | {a:.4f} |" for m, a in results["per_round"].items()]
    skew = results["one_shot"]["dirichlet-0.1"]["accuracy"]
    gains = {m: skew[m] - skew["average"] for m in ("ties", "dare", "dare-ties")}
    if "fisher" in skew:
        gains["fisher"] = skew["fisher"] - skew["average (fisher run's nodes)"]
    best = max(gains, key=gains.get)
    met = gains[best] >= 0.02
    lines += ["", f"Target: on the skewed one-shot split, TIES / DARE / Fisher beat the one-shot "
              f"average of the same nodes by >= 2 points: {'met' if met else 'not met'} "
              f"({best} {gains[best] * 100:+.1f} points).", ""]
    return "\n".join(lines)


def main() -> None:
    """Run the one-shot and per-round legs of ``--setting``; print (and write) the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="digits")
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-samples", type=int, default=5000,
                        help="train rows drawn from ag_news / cifar10 (not digits)")
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--distill-steps", type=int, default=1000)
    parser.add_argument("--out", default="runs/bench-merge")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    out = Path(args.out) / args.setting
    dataset, settings = setting(args.setting, Path(args.out), args.train_samples,
                                args.test_samples)
    results = {"one_shot": {}, "per_round": {}}
    for pname, partition in PARTITIONS.items():
        print(f"one shot, {pname}", flush=True)
        results["one_shot"][pname] = one_shot(dataset, settings, partition, args,
                                              out / f"one-shot-{pname}")
    if args.rounds > 0:
        print("per round, dirichlet-0.1", flush=True)
        results["per_round"] = per_round(dataset, settings, args, out / "per-round")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    command = "python experiments/bench_merge.py " + " ".join(sys.argv[1:])
    page = markdown(results, args, command.strip())
    print(page)
    if args.markdown:
        Path(args.markdown).write_text(page)


if __name__ == "__main__":
    main()
