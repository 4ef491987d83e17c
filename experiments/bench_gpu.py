"""GPU sharing: simulated nodes training side by side on one GPU, against one at a time.

Usage::

    python experiments/bench_gpu.py [--dataset ../shared/data/cifar10] [--model resnet18]
        [--num-nodes 10] [--rounds 5] [--local-epochs 1] [--batch-size 64]
        [--shares 1,10] [--device cuda] [--timeout 900] [--json FILE]

``--device cpu`` tries the script on a machine without a GPU (``k`` then only sets how
many nodes train at once on the cores, and the GPU memory columns read ``-``).

For each share count ``k`` in ``--shares`` it runs one ``fedavg simulate`` process, as a user
would, with ``--gpus-per-node 1/k`` (and ``--cpus-per-node`` the machine's cores over ``k``):
Ray then runs ``k`` node actors on the GPU at once, and ``k = 1`` is one node at a time. Every
run has the same data, partitions (IID), model, seed, rounds and local epochs; the merged model
is evaluated on the test split after each round.

While a run goes, ``nvidia-smi`` is asked every 0.5 s for the memory each process holds on the
GPU (``--query-compute-apps``); the node actors are its ``ray::ClientAppActor`` processes.

Per run it prints:

- start-up: seconds from the command's start to the start of round 1 (imports, data, Ray);
- the median round (rounds 2 on; round 1 also creates the actors and warms CUDA), seconds;
- samples/s per node: a node's partition times the local epochs over the round's longest
  node training (``train_s`` in ``metrics.jsonl``), median over rounds 2 on;
- samples/s of the run: all the round's sample-epochs over the round's wall time (training,
  transfer, merge and the test-split evaluation), median over rounds 2 on;
- peak GPU memory of the largest node actor, of the driver (which evaluates the merged
  model) and of all the run's processes together, MiB;
- the final test accuracy;

and the speed-up of each ``k`` over ``k = 1``: the ratio of the median rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import bench_memory

ROOT = Path(__file__).resolve().parents[1]
CIFAR10 = str(ROOT.parent / "shared" / "data" / "cifar10")


class GpuMemory(threading.Thread):
    """Poll ``nvidia-smi`` for the GPU memory of each process until :meth:`stop`.

    ``peak`` maps a PID to the most memory it was seen holding (MiB), ``roles`` a PID to what
    the process is (``bench_memory.role``: ``ray::ClientAppActor`` for a node actor);
    ``total_peak`` is the largest sum over the processes seen at one moment (MiB).
    """

    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.peak: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        self.total_peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self._halt.is_set():
            res = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
            now = {}
            for line in res.stdout.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    now[int(pid)] = int(mib)
            for pid, mib in now.items():
                self.peak[pid] = max(self.peak.get(pid, 0), mib)
                if pid not in self.roles:
                    self.roles[pid] = bench_memory.role(pid)
            self.total_peak = max(self.total_peak, sum(now.values()))
            self._halt.wait(self.every_s)

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._halt.set()
        self.join()


def measure(share: int, args: argparse.Namespace) -> dict:
    """Run one ``fedavg simulate`` with ``share`` nodes per GPU; return its figures."""
    cores = os.cpu_count() or 1
    extra = ["--model", args.model, "--local-epochs", str(args.local_epochs),
             "--batch-size", str(args.batch_size), "--device", args.device, "--seed", "0",
             "--cpus-per-node", f"{max(1.0, cores / share):g}"]
    if args.device != "cpu":
        extra += ["--gpus-per-node", f"{1 / share:.6g}"]
    gpu = GpuMemory()
    if args.device != "cpu":
        if shutil.which("nvidia-smi") is None:
            raise SystemExit("error: nvidia-smi not found: bench_gpu.py needs an NVIDIA GPU "
                             "(or --device cpu to try it)")
        gpu.start()
    try:
        result = bench_memory.run(args.num_nodes, 1.0, args.rounds, extra, dataset=args.dataset,
                                  timeout_s=args.timeout)
    finally:
        if gpu.is_alive():
            gpu.stop()
    rows = result["metrics"]
    later = rows[1:] or rows
    samples = result["summary"]["train_samples"] * args.local_epochs  # sample-epochs of one round
    per_node = samples / args.num_nodes
    first = result["at_round"].get(1)
    node_mib = sorted(mib for pid, mib in gpu.peak.items()
                      if gpu.roles.get(pid, "").startswith("ray::"))
    other_mib = sorted(mib for pid, mib in gpu.peak.items()
                       if not gpu.roles.get(pid, "").startswith("ray::"))
    return {
        "share": share, "gpus_per_node": 1 / share, "model": args.model,
        "num_nodes": args.num_nodes, "rounds": args.rounds,
        "startup_s": round(first["t_s"] - rows[0]["wall_s"], 2) if first else None,
        "round1_s": rows[0]["wall_s"],
        "round_median_s": round(statistics.median(r["wall_s"] for r in later), 3),
        "node_samples_per_s": round(statistics.median(
            per_node / r["train_s"] for r in later if r.get("train_s")), 1),
        "run_samples_per_s": round(statistics.median(samples / r["wall_s"] for r in later), 1),
        "node_processes_on_gpu": len(node_mib),
        "node_gpu_mib": node_mib[-1] if node_mib else None,  # the largest node actor
        "driver_gpu_mib": other_mib[-1] if other_mib else None,  # evaluates the merged model
        "gpu_roles": sorted(set(gpu.roles.values())),
        "gpu_total_peak_mib": gpu.total_peak,
        "accuracy": rows[-1]["accuracy"], "wall_s": result["wall_s"],
    }


def table(points: list[dict]) -> str:
    """One row per share count, with the speed-up over one node at a time."""
    base = next((p for p in points if p["share"] == 1), None)
    def mib(value: int | None) -> str:
        return "-" if not value else str(value)

    rows = ["nodes/GPU  start-up s  round 1 s  round s  node samples/s  run samples/s  "
            "node GPU MiB  driver GPU MiB  all GPU MiB  accuracy  speed-up"]
    for p in points:
        speed = (f"{base['round_median_s'] / p['round_median_s']:.2f}x"
                 if base and p["round_median_s"] else "")
        rows.append(f"{p['share']:>9}  {p['startup_s'] or 0:>10.1f}  {p['round1_s']:>9.1f}  "
                    f"{p['round_median_s']:>7.2f}  {p['node_samples_per_s']:>14.0f}  "
                    f"{p['run_samples_per_s']:>13.0f}  {mib(p['node_gpu_mib']):>12}  "
                    f"{mib(p['driver_gpu_mib']):>14}  "
                    f"{mib(p['gpu_total_peak_mib']):>11}  {p['accuracy']:>8.4f}  {speed:>8}")
    return "\n".join(rows)


def main() -> None:
    """Run each share count one after another and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=CIFAR10)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--num-nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shares", default="1,10",
                        help="comma-separated node actors per GPU, e.g. 1,2,5,10")
    parser.add_argument("--device", default="cuda", help="cuda (or cpu, to try the script)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    try:  # checked before any run: a typo late in the list must not cost the runs before it
        shares = [int(s) for s in args.shares.split(",")]
    except ValueError:
        shares = []
    if not shares or min(shares) < 1:
        parser.error(f"--shares must be whole numbers >= 1 separated by commas, got "
                     f"{args.shares!r}")
    points = []
    for share in shares:
        point = measure(share, args)
        print(json.dumps(point), flush=True)
        points.append(point)
    print(table(points))
    if args.json:
        args.json.write_text(json.dumps(points, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
