"""Round wall time on the deployment engine: our warm node beside a plain Flower SuperNode.

Both setups run in this one invocation, on localhost, against a ``fedavg coordinator`` on
digits with the same settings:

- ``fedavg node``: Flower SuperNode in process isolation, every task run in one warm
  process (torch imported and data loaded once);
- ``flower-supernode`` with Flower's default isolation: every message starts a fresh
  ClientApp process (the same ``fedavg.node.deployed:client_app``), which re-imports torch.

Every process runs torch on one thread (``OMP_NUM_THREADS=1`` unless set), as a simulated
node does. Printed per round: wall time at the coordinator (send to merged), the slowest
node's training time, and the overhead (wall minus training). Summary: medians, excluding
round 1, which also loads and partitions the data. Usage::

    python experiments/deploy_rounds.py --nodes 3 --rounds 6 --plain-rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedavg.engines.deployment.processes import free_port


def run(kind: str, nodes: int, rounds: int, tmp: Path) -> list[dict]:
    """Run one coordinator with ``nodes`` nodes of ``kind``; return its per-round records."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    out = tmp / f"run-{kind}"
    bindir = os.path.dirname(sys.executable)  # flower-supernode starts flower-superexec
    env = {**os.environ, "FLWR_HOME": str(tmp / f"flwr-{kind}"), "COLUMNS": "150",
           "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    # one thread per process, as a simulated node gets one CPU: with torch's default (all
    # cores each), 3 nodes on 2 cores fight over them (0.5-2 s a round instead of 0.03 s)
    env.setdefault("OMP_NUM_THREADS", "1")
    coord = subprocess.Popen(
        [sys.executable, "-m", "fedavg.cli", "coordinator", "--address", address, "--insecure",
         "--rounds", str(rounds), "--min-nodes", str(nodes), "--output", str(out)],
        stdout=open(tmp / f"coordinator-{kind}.log", "w"), stderr=subprocess.STDOUT, env=env)
    procs = []
    time.sleep(1.0)
    for i in range(nodes):
        if kind == "fedavg":
            cmd = [sys.executable, "-m", "fedavg.cli", "node", "--coordinator", address,
                   "--insecure", "--partition-id", str(i), "--num-partitions", str(nodes)]
        else:
            cmd = [os.path.join(bindir, "flower-supernode"),
                   "--insecure", "--superlink", address, "--port", str(free_port()),
                   "--node-config",
                   f'dataset="digits" partition-id={i} num-partitions={nodes} device="cpu"']
        procs.append(subprocess.Popen(cmd, stdout=open(tmp / f"node{i}-{kind}.log", "w"),
                                      stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
    try:
        code = coord.wait(60 + rounds * 120)
        if code != 0:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}"
                             for f in sorted(tmp.glob(f"*-{kind}.log")))
            raise SystemExit(f"{kind}: coordinator exited {code}\n{logs}")
    finally:
        if coord.poll() is None:
            coord.terminate()
            coord.wait(30)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    """Run both setups and print the per-round table and the medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6, help="rounds with fedavg node")
    ap.add_argument("--plain-rounds", type=int, default=3,
                    help="rounds with plain flower-supernode (about 25 s each); 0 skips it")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedavg-bench-") as tmp:
        for kind, rounds in (("fedavg", args.rounds), ("flower", args.plain_rounds)):
            if rounds == 0:
                continue
            t0 = time.monotonic()
            results[kind] = run(kind, args.nodes, rounds, Path(tmp))
            print(f"{kind}: {rounds} rounds in {time.monotonic() - t0:.1f} s (incl. start-up)",
                  flush=True)
    print(f"\n{args.nodes} nodes on localhost, digits, coordinator = fedavg coordinator")
    print(f"{'node':<28}{'round':>6}{'wall s':>9}{'train s':>9}{'overhead s':>12}")
    label = {"fedavg": "fedavg node (warm)", "flower": "flower-supernode (default)"}
    medians = {}
    for kind, recs in results.items():
        for r in recs:
            train = r.get("train_s") or 0.0
            print(f"{label[kind]:<28}{r['round']:>6}{r['wall_s']:>9.2f}{train:>9.3f}"
                  f"{r['wall_s'] - train:>12.2f}")
        later = recs[1:] or recs
        medians[kind] = (statistics.median(r["wall_s"] for r in later),
                         statistics.median(r["wall_s"] - (r.get("train_s") or 0) for r in later))
    print()
    for kind, (wall, over) in medians.items():
        print(f"median round (rounds 2+), {label[kind]:<28} wall {wall:6.2f} s  "
              f"overhead {over:6.2f} s")
    if len(medians) == 2:
        ratio = medians["flower"][0] / medians["fedavg"][0]
        print(f"plain Flower rounds take {ratio:.1f}x as long as fedavg node rounds")


if __name__ == "__main__":
    main()
