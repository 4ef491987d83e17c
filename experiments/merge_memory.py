"""Peak memory of merging N copies of a ResNet-18 state dict: streaming FedAvg vs Flower's FedAvg.

Usage::

    python experiments/merge_memory.py [--copies 50]

Each method runs in its own fresh process and reports its peak resident memory above a
baseline (imports done, one template state dict built), as a multiple of one state dict's
size. Our ``strategies.get("fedavg")`` folds each node model in as it arrives (a generator
here, as replies would stream in), so its peak stays a small constant multiple (target <= 3x)
whatever N; Flower's ``aggregate_arrayrecords`` takes the list of all replies (as its
strategies receive them), so it needs N state dicts at once. Both results are compared for
equality.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, resource, sys
import torch
from torchvision.models import resnet18

method, copies = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
base = {k: v.detach().clone() for k, v in resnet18(num_classes=10).state_dict().items()}
size = sum(v.numel() * v.element_size() for v in base.values())

def rss_bytes():  # current resident set, from /proc (Linux)
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()

def copy(i):  # node i's model: a deterministic perturbation of the template
    return {k: (v + 0.001 * i if v.is_floating_point() else v + i) for k, v in base.items()}

if method == "flower":
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
else:
    import strategies
import gc; gc.collect()
baseline = rss_bytes()
if method == "ours":
    s = strategies.get("fedavg")
    s.begin(base)
    for i in range(copies):
        s.add(copy(i), weight=1.0 + i, node=str(i))
    merged = s.result().state_dict
else:
    replies = [RecordDict({"arrays": ArrayRecord(copy(i)),
                           "metrics": MetricRecord({"num-examples": 1.0 + i})})
               for i in range(copies)]
    merged = aggregate_arrayrecords(replies, "num-examples").to_torch_state_dict()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
check = {k: float(v.double().sum()) for k, v in merged.items() if v.is_floating_point()}
print(json.dumps({"method": method, "state_dict_bytes": size, "baseline": baseline,
                  "peak": peak, "checksum": check}))
"""


def measure(method: str, copies: int) -> dict:
    """Return the report of ``method`` merging ``copies`` state dicts in a fresh process."""
    # A fixed mmap threshold makes freed tensors go back to the OS at once, so resident
    # memory follows what each method holds rather than the allocator's caching.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", WORKER, method, str(copies)], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Measure both methods and print their peak memory above baseline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=50)
    args = parser.parse_args()
    rows = [measure(m, args.copies) for m in ("ours", "flower")]
    size = rows[0]["state_dict_bytes"]
    print(f"{args.copies} copies of a ResNet-18 state dict ({size / 2**20:.1f} MiB each)")
    print(f"{'method':<28} {'peak above baseline':>20} {'x one state dict':>18}")
    for r in rows:
        extra = max(r["peak"] - r["baseline"], 0)
        name = ("fedavg (streaming, ours)" if r["method"] == "ours"
                else "Flower aggregate_arrayrecords")
        print(f"{name:<28} {extra / 2**20:>16.1f} MiB {extra / size:>17.2f}x")
    ours, flower = rows
    agree = all(abs(ours["checksum"][k] - v) <= 1e-5 * max(abs(v), 1.0)
                for k, v in flower["checksum"].items() if k in ours["checksum"])
    ratio = (flower["peak"] - flower["baseline"]) / max(ours["peak"] - ours["baseline"], 1)
    print(f"same merged weights: {agree}; Flower needs {ratio:.1f}x the memory of ours")


if __name__ == "__main__":
    main()
