"""Compressed node updates and DiLoCo: accuracy against the bytes the nodes send.

Usage::

    python experiments/bench_compress.py [--data ../shared/data/mnist] [--rounds 10]
        [--legs fedavg/none fedavg/int8 ...] [--target 0.98] [--out runs/bench-compress]

Each leg is one ``fedavg simulate`` (its own process, as a user runs it) on MNIST,
Dirichlet(0.5), 10 nodes, every node every round, the ``cnn``, 1 local epoch; a leg is
``STRATEGY/CODEC`` with ``CODEC`` one of ``none``, ``int8``, ``int4``, ``topk1``, ``topk10``
(top-k of 1 % or 10 % of the entries), ``-noef`` for no error feedback and ``+down`` for the
round's weights sent as int8 too (``--compress-down int8``). DiLoCo's nodes take
``--local-steps 190`` AdamW steps, one pass over a node's ~6,000 samples at batch 32: the same
budget as FedAvg's epoch (``diloco2x``: 380 steps, two passes, for the same messages).
Reports per leg the final and best accuracy, the uplink bytes per round (node updates, as
they travelled through Flower) and against uncompressed FedAvg, the cumulative uplink bytes
when ``--target`` accuracy was first reached, and the median round time; writes
``results.md``, ``results.json`` and ``accuracy_vs_uplink.png`` in ``--out``. Then the
codecs' own cost: encode + decode of the ``cnn``'s update, against a round's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODECS = {"none": [], "int8": ["--compress", "int8"], "int4": ["--compress", "int4"],
          "topk1": ["--compress", "topk", "--topk-fraction", "0.01"],
          "topk10": ["--compress", "topk", "--topk-fraction", "0.1"]}
STRATEGIES = {"fedavg": [], "diloco": ["--strategy", "diloco", "--local-steps", "190"],
              # two passes over a node's data a round: more compute, the same messages
              "diloco2x": ["--strategy", "diloco", "--local-steps", "380"]}
DEFAULT_LEGS = ["fedavg/none", "fedavg/int8", "fedavg/int4", "fedavg/topk1", "fedavg/topk1-noef",
                "diloco/none", "diloco/int8"]
#: The settings a leg runs in: MNIST (the default) and the CIFAR-10 quick setting of
#: ``configs/methods_quick.toml`` (NIID-Bench's Dirichlet(0.5), 10 rounds x 5 local epochs).
SETTINGS = {
    "mnist": {"data": "mnist", "model": "cnn", "args": [], "target": 0.98, "ylim": (0.9, 1.0),
              "title": "MNIST, Dirichlet(0.5), 10 nodes, `cnn`"},
    "cifar10": {"data": "cifar10", "model": "cnn-cifar", "target": 0.5, "ylim": (0.2, 0.65),
                "args": ["--local-epochs", "5", "--batch-size", "64", "--optimizer", "sgd",
                         "--lr", "0.01", "--momentum", "0.9"],
                "title": "CIFAR-10 quick setting: Dirichlet(0.5), 10 nodes, `cnn-cifar`, "
                         "5 local epochs, batch 64, SGD lr 0.01 momentum 0.9"},
}


def leg_args(leg: str) -> list[str]:
    """Return the ``fedavg simulate`` options of a leg such as ``fedavg/topk1-noef+down``."""
    strategy, codec = leg.split("/")
    codec, plus, down = codec.partition("+")
    args = STRATEGIES[strategy] + CODECS[codec.removesuffix("-noef")]
    args += ["--no-error-feedback"] if codec.endswith("-noef") else []
    return args + (["--compress-down", "int8"] if plus and down == "down" else [])


def run_leg(leg: str, data: Path, rounds: int, out: Path, setting: str = "mnist") -> list[dict]:
    """Run one leg in ``setting`` (or read it back if it finished before); return its rounds."""
    folder = out / leg.replace("/", "_")
    if not (folder / "summary.json").exists():
        cmd = [sys.executable, "-m", "fedavg.cli", "simulate", "--dataset", str(data),
               "--num-nodes", "10", "--partitioner", "dirichlet", "--alpha", "0.5",
               "--model", SETTINGS[setting]["model"], "--rounds", str(rounds),
               "--output", str(folder), "--overwrite", *SETTINGS[setting]["args"],
               *leg_args(leg)]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "FEDAVG_BENCH": "1"})
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def summarise(leg: str, rounds: list[dict], target: float, baseline_up: float) -> dict:
    """One leg's row: accuracy, bytes per round and to the target, round time."""
    up = [r["bytes_from_nodes"] for r in rounds]
    reached, total = None, 0
    for r, b in zip(rounds, up):
        total += b
        if reached is None and r["accuracy"] >= target:
            reached = {"round": r["round"], "uplink_bytes": total}
    return {"leg": leg, "args": " ".join(leg_args(leg)), "final": rounds[-1]["accuracy"],
            "best": max(r["accuracy"] for r in rounds), "up_per_round": statistics.mean(up),
            "down_per_round": statistics.mean(r["bytes_to_nodes"] for r in rounds),
            "up_share": statistics.mean(up) / baseline_up, "reached": reached,
            "round_s": statistics.median(r["wall_s"] for r in rounds[1:]) if len(rounds) > 1
            else rounds[0]["wall_s"], "curve": [(r["accuracy"], b) for r, b in zip(rounds, up)]}


def codec_cost(model: str = "cnn", shape: tuple[int, ...] = (1, 28, 28),
               repeats: int = 20) -> dict[str, float]:
    """Seconds to encode and decode one update of ``model`` (inputs ``shape``), per codec."""
    import torch

    from fedavg.models.registry import build_model
    from fedavg.node.compression import compress_update, decode_reply

    received = build_model(model, shape, 10).state_dict()
    state = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in received.items()}
    out = {}
    for codec, fraction in (("int8", 0.01), ("int4", 0.01), ("topk", 0.01), ("topk", 0.1)):
        start = time.perf_counter()
        for _ in range(repeats):
            sent, _ = compress_update(state, received, codec, fraction)
            decode_reply(sent, received)
        out[f"{codec}{'' if codec != 'topk' else f' {fraction:.0%}'}"] = \
            (time.perf_counter() - start) / repeats
    return out


def parameters(model: str, shape: tuple[int, ...]) -> int:
    """Return the number of parameters of ``model`` for inputs ``shape`` and 10 classes."""
    from fedavg.models.registry import build_model

    return sum(t.numel() for t in build_model(model, shape, 10).state_dict().values())


def digits_round(out: Path) -> float:
    """Median round seconds of the default run (digits, 5 nodes, 10 rounds), uncompressed."""
    folder = out / "digits_none"
    if not (folder / "summary.json").exists():
        subprocess.run([sys.executable, "-m", "fedavg.cli", "simulate", "--output", str(folder),
                        "--overwrite"], check=True, capture_output=True,
                       env={**os.environ, "FEDAVG_BENCH": "1"})
    walls = [json.loads(line)["wall_s"] for line in
             (folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(walls[1:])


def write(rows: list[dict], cost: dict[str, float], args, out: Path) -> None:
    """Write ``results.md``, ``results.json`` and the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        cumulative, total = [], 0
        for _, b in row["curve"]:
            total += b
            cumulative.append(total / 1e6)
        ax.plot(cumulative, [a for a, _ in row["curve"]], marker=".", label=row["leg"])
    ax.set_xscale("log")
    ax.set_xlabel("cumulative uplink (MB, all nodes)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(*SETTINGS[args.setting]["ylim"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_uplink.png", dpi=120)
    median_round = statistics.median(r["round_s"] for r in rows)
    lines = [f"Command: `python experiments/bench_compress.py --setting {args.setting} "
             f"--rounds {args.rounds} --legs {' '.join(args.legs)}`", "",
             f"{SETTINGS[args.setting]['title']}, {args.rounds} rounds; uplink = the "
             "node updates as they travelled (all nodes, one round).", "",
             f"| leg | options | final | best | uplink / round | vs fedavg/none | uplink to "
             f"{args.target:.0%} | downlink / round | median round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reach = (f"{r['reached']['uplink_bytes'] / 1e6:.1f} MB (round {r['reached']['round']})"
                 if r["reached"] else "not reached")
        lines.append(f"| {r['leg']} | `{r['args'] or '(defaults)'}` | {r['final']:.4f} | "
                     f"{r['best']:.4f} | {r['up_per_round'] / 1e6:.2f} MB | "
                     f"{r['up_share']:.1%} | {reach} | {r['down_per_round'] / 1e6:.2f} MB | "
                     f"{r['round_s']:.1f} s |")
    if cost:
        lines += codec_lines(cost, median_round, out)
    lines += ["", "![accuracy against cumulative uplink bytes](accuracy_vs_uplink.png)", ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"rows": rows, "codec_s": cost}, indent=1))
    print("\n".join(lines))


def codec_lines(cost: dict[str, float], median_round: float, out: Path) -> list[str]:
    """Return the codecs' cost as a share of an MNIST round and of the digits round."""
    digits_s = digits_round(out)
    lines = ["", f"Encode + decode of one update per node and round: the `cnn` "
              f"({parameters('cnn', (1, 28, 28)):,} parameters) against the median MNIST round "
              f"above, and digits' `mlp` ({parameters('mlp', (1, 8, 8)):,}) against the default "
              f"run's median round ({digits_s:.3f} s, uncompressed):", "",
              "| codec | cnn, seconds | share of an MNIST round | mlp, seconds | share of a "
              "digits round |", "|---|---:|---:|---:|---:|"]
    small = codec_cost("mlp", (1, 8, 8))
    lines += [f"| {c} | {s:.4f} | {s / median_round:.2%} | {small[c]:.4f} | "
              f"{small[c] / digits_s:.1%} |" for c, s in cost.items()]
    return lines


def main() -> None:
    """Run the legs, then write the table, the plot and the codecs' cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="mnist")
    parser.add_argument("--data", type=Path, help="the dataset folder (default: the setting's, "
                        "in FEDAVG_SHARED_DATA or ../shared/data)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--legs", nargs="+", default=DEFAULT_LEGS)
    parser.add_argument("--target", type=float, help="accuracy to count bytes to (default: the "
                        "setting's, 0.98 MNIST, 0.5 CIFAR-10)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-compress"))
    args = parser.parse_args()
    setting = SETTINGS[args.setting]
    shared = Path(os.environ.get("FEDAVG_SHARED_DATA", ROOT.parent / "shared" / "data"))
    args.data = args.data or shared / setting["data"]
    args.target = setting["target"] if args.target is None else args.target
    args.out.mkdir(parents=True, exist_ok=True)
    results = {leg: run_leg(leg, args.data, args.rounds, args.out, args.setting)
               for leg in args.legs}
    baseline = results.get("fedavg/none") or next(iter(results.values()))
    base_up = statistics.mean(r["bytes_from_nodes"] for r in baseline)
    rows = [summarise(leg, rounds, args.target, base_up) for leg, rounds in results.items()]
    write(rows, codec_cost() if args.setting == "mnist" else {}, args, args.out)


if __name__ == "__main__":
    main()
