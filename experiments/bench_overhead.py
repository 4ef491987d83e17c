"""Overhead: ``fedavg simulate`` beside a plain Flower app (``flwr run``) and plain PyTorch.

Usage::

    python experiments/bench_overhead.py [--nodes 10] [--rounds 5] [--json FILE]

The same work three ways, one after another in this one invocation, on MNIST
(``../shared/data/mnist`` or ``--dataset``): the ``cnn`` network (``fedavg``'s, and the same
layers in ``experiments/plain_flower``), SGD lr 0.05 momentum 0.9, batch 32, IID partitions
from flwr-datasets, one local epoch per round, every node in every round, the merged model
evaluated on the test split after each round:

- ``fedavg``: ``fedavg simulate`` (Flower's simulation engine on Ray), one CPU per node, so
  as many nodes train at a time as there are cores;
- ``fedavg-1``: the same with every core per node: one node at a time, with as many torch
  threads as cores (the parallel speed-up is its steady round over ``fedavg``'s);
- ``flower``: ``experiments/plain_flower``, a plain Flower app laid out as Flower's PyTorch
  quickstart, run with ``flwr run --stream`` on a ``flower-superlink --simulation`` this
  script starts on free loopback ports and stops afterwards, with what it started (by PID:
  the processes whose environment holds this run's ``FEDAVG_BENCH_TAG``), one CPU per node;
- ``pytorch``: one process training one model over all the training data, ``rounds`` epochs
  (the same sample-epochs), evaluating after each.

Each leg's wall time is split into start-up (the command's start to the start of round 1),
round 1 (which also starts Ray's node actors), the median later round, and the end (the last
evaluation to the command's exit). The machine's limit is the one-thread training throughput
of the same network (samples per second, measured here first) times the cores; each leg's
throughput is its sample-epochs over its whole wall time.

With ``--repeats K`` every leg runs K times, the legs in the order above, then reversed, and
so on (each leg as often early as late), and each figure is the median of its K runs; the
walls of every run are printed too. One run of each can be off by several seconds on a
shared machine (the first round of any leg, plain PyTorch's included, was 1-8 s slower than
its later rounds in one run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedavg.engines.deployment.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "experiments" / "plain_flower"
sys.path.insert(0, str(APP))


def one_thread_limit(steps: int = 150, batch: int = 32) -> float:
    """Training samples per second of the network on one thread (random MNIST-sized input)."""
    import torch
    from plain_flower.task import Net

    torch.set_num_threads(1)
    net, loss_fn = Net(), torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    for i in range(20 + steps):
        if i == 20:
            start = time.perf_counter()
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return steps * batch / (time.perf_counter() - start)


def phases(launched: float, ended: float, starts: list[float], ends: list[float]) -> dict:
    """Split a leg's wall time (``time.time()`` stamps) into start-up, rounds and end."""
    rounds = [e - s for s, e in zip(starts, ends)]
    return {"wall_s": round(ended - launched, 2), "startup_s": round(starts[0] - launched, 2),
            "round1_s": round(rounds[0], 2),
            "round_s": round(statistics.median(rounds[1:]), 2) if len(rounds) > 1 else None,
            "end_s": round(ended - ends[-1], 2)}


def run_fedavg(dataset: str, nodes: int, rounds: int, tmp: Path, cpus: int = 1) -> dict:
    """``fedavg simulate``; round ends are when each ``metrics.jsonl`` line appears."""
    out = tmp / f"fedavg-{cpus}"
    cmd = [sys.executable, "-m", "fedavg.cli", "simulate", "--dataset", dataset,
           "--model", "cnn", "--num-nodes", str(nodes), "--rounds", str(rounds),
           "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9",
           "--partitioner", "iid", "--cpus-per-node", str(cpus), "--output", str(out)]
    launched, seen, ends = time.time(), 0, []
    log = open(tmp / f"fedavg-{cpus}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    while proc.poll() is None:
        path = out / "metrics.jsonl"
        lines = path.read_bytes().count(b"\n") if path.exists() else 0
        ends += [time.time()] * (lines - seen)
        seen = lines
        time.sleep(0.02)
    ended = time.time()
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"fedavg simulate exited {proc.returncode}: "
                           f"{(tmp / f'fedavg-{cpus}.log').read_text()[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ends += [ended] * (len(rows) - len(ends))
    starts = [ends[0] - rows[0]["wall_s"], *ends[:-1]]
    return {**phases(launched, ended, starts, ends), "accuracy": rows[-1]["accuracy"]}


def tagged(tag: str) -> list[int]:
    """PIDs of the live processes whose environment holds ``FEDAVG_BENCH_TAG=tag``."""
    found, marker = [], f"FEDAVG_BENCH_TAG={tag}".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0") and int(entry) != os.getpid():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _stop(proc: subprocess.Popen, tag: str) -> None:
    """Stop the SuperLink, then whatever it started (detached: found by ``tag``), by PID."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tagged(tag):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)


def run_flower(dataset: str, nodes: int, rounds: int, tmp: Path) -> dict:
    """Run the plain Flower app with ``flwr run --stream`` on a SuperLink of our own."""
    home, timing = tmp / "flwr-home", tmp / "flower-rounds.jsonl"
    home.mkdir()
    control = f"127.0.0.1:{free_port()}"  # one HTTP port: Control, Runtime and Fleet APIs
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "{control}"\n'
        "insecure = true\n")
    bindir, tag = Path(sys.executable).parent, f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FEDAVG_BENCH_TAG": tag,
           "RAY_TMPDIR": str(tmp),  # Flower's Ray session folder goes away with ours
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    launched = time.time()
    link = subprocess.Popen(
        [str(bindir / "flower-superlink"), "--insecure", "--simulation", "--isolation",
         "subprocess", "--host", "127.0.0.1", "--port", control.split(":")[1], "--database",
         str(home / "state.db"), "--disable-runtime-dependency-installation"],
        stdout=open(tmp / "superlink.log", "w"), stderr=subprocess.STDOUT, env=env,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # the Control API listens
            try:
                socket.create_connection(control.split(":"), timeout=1).close()
                break
            except OSError:
                if link.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("flower-superlink did not start: "
                                       + (tmp / "superlink.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        config = (f"num-server-rounds={rounds} dataset='{Path(dataset).resolve()}' "
                  f"timing-file='{timing}'")
        res = subprocess.run(
            [str(bindir / "flwr"), "run", str(APP), "bench", "--stream", "--run-config", config,
             "--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1"],
            env=env, capture_output=True, text=True, timeout=3600)
        ended = time.time()
    finally:
        _stop(link, tag)
    evals = ([json.loads(line) for line in timing.read_text().splitlines()]
             if timing.exists() else [])
    if res.returncode != 0 or len(evals) != rounds + 1:
        raise RuntimeError(f"flwr run exited {res.returncode} after {len(evals)} evaluations: "
                           f"{(res.stdout + res.stderr)[-2000:]}")
    stamps = [e["time"] for e in evals]  # round 0 is the initial model's evaluation
    return {**phases(launched, ended, stamps[:-1], stamps[1:]),
            "accuracy": evals[-1]["accuracy"]}


def torch_leg(dataset: str, rounds: int) -> None:
    """In a process of its own: ``rounds`` epochs over all the data; print the stamps."""
    import torch
    from plain_flower import task

    train, test = task.load_partition(dataset, 0, 1), task.load_test(dataset)
    net, stamps = task.Net(), [time.time()]
    torch.manual_seed(0)
    for _ in range(rounds):
        task.train(net, train, 1, 32, 0.05, 0.9)
        _, accuracy = task.evaluate(net, test)
        stamps.append(time.time())
    print(json.dumps({"stamps": stamps, "accuracy": accuracy}))


def run_torch(dataset: str, rounds: int, tmp: Path) -> dict:
    """Plain PyTorch in one process (this script with ``--torch-leg``)."""
    launched = time.time()
    res = subprocess.run([sys.executable, __file__, "--torch-leg", "--dataset", dataset,
                          "--rounds", str(rounds)], capture_output=True, text=True,
                         timeout=3600)
    ended = time.time()
    if res.returncode != 0:
        raise RuntimeError(f"the PyTorch leg exited {res.returncode}: {res.stderr[-2000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    stamps = got["stamps"]
    return {**phases(launched, ended, stamps[:-1], stamps[1:]), "accuracy": got["accuracy"]}


def medians(runs: list[dict]) -> dict:
    """Each figure of a leg's runs (``phases`` and ``accuracy``): its median over the runs."""
    return {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}


def table(result: dict) -> str:
    """Format the legs side by side: throughput against the machine's limit, the ratios."""
    limit, work = result["limit_samples_s"], result["sample_epochs"]
    rows = [f"machine limit: {result['one_thread_samples_s']:.0f} samples/s on one thread x "
            f"{result['cores']} cores = {limit:.0f} samples/s; the work: {work:,} "
            f"sample-epochs, {work / limit:.1f} s at the limit",
            "leg       wall s  start-up s  round 1 s  round s  end s  accuracy  samples/s  "
            "of limit"]
    for name in ("fedavg", "fedavg-1", "flower", "pytorch"):
        leg = result[name]
        rows.append(f"{name:<8}  {leg['wall_s']:>6.1f}  {leg['startup_s']:>10.1f}  "
                    f"{leg['round1_s']:>9.1f}  {leg['round_s']:>7.1f}  {leg['end_s']:>5.1f}  "
                    f"{leg['accuracy']:>8.4f}  {work / leg['wall_s']:>9.0f}  "
                    f"{work / leg['wall_s'] / limit:>8.1%}")
    if any(len(walls) > 1 for walls in result.get("walls_s", {}).values()):
        rows.append("medians of " + "; ".join(
            f"{name} {', '.join(f'{w:.1f}' for w in walls)}"
            for name, walls in result["walls_s"].items()) + " (wall s of each run)")
    ours = result["fedavg"]["wall_s"]
    rows.append(f"fedavg / plain Flower: {ours / result['flower']['wall_s']:.2f}; "
                f"fedavg / plain PyTorch: {ours / result['pytorch']['wall_s']:.2f}; "
                f"speed-up of {result['cores']} nodes at a time over one: "
                f"{result['fedavg-1']['round_s'] / result['fedavg']['round_s']:.2f} (steady "
                "rounds)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Measure the limit, run the three legs, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "mnist"))
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each leg, in alternating order; medians are reported")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--torch-leg", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torch_leg:
        torch_leg(args.dataset, args.rounds)
        return 0
    if args.rounds < 2 or args.nodes < 1 or args.repeats < 1:
        parser.error("--rounds must be >= 2 (round 1 is reported apart), --nodes and "
                     "--repeats >= 1")
    if not Path(args.dataset).is_dir():
        parser.error(f"no dataset folder {args.dataset} (give --dataset)")
    tmp = Path(tempfile.mkdtemp(prefix="fedavg-bench-", dir="/tmp"))
    result: dict = {}
    runs: dict[str, list[dict]] = {}
    try:
        import datasets

        datasets.disable_progress_bars()
        train_rows = datasets.load_dataset(args.dataset, split="train").num_rows
        cores = os.cpu_count() or 1
        one = one_thread_limit()
        result = {"one_thread_samples_s": round(one, 1), "cores": cores,
                  "limit_samples_s": round(one * cores, 1),
                  "sample_epochs": train_rows * args.rounds, "nodes": args.nodes,
                  "rounds": args.rounds}
        legs = (("fedavg", lambda d: run_fedavg(args.dataset, args.nodes, args.rounds, d)),
                ("fedavg-1", lambda d: run_fedavg(args.dataset, args.nodes, args.rounds, d,
                                                  cores)),
                ("flower", lambda d: run_flower(args.dataset, args.nodes, args.rounds, d)),
                ("pytorch", lambda d: run_torch(args.dataset, args.rounds, d)))
        runs.update({name: [] for name, _ in legs})
        for repeat in range(args.repeats):
            for name, leg in (legs if repeat % 2 == 0 else legs[::-1]):
                folder = tmp / f"{name}-{repeat + 1}"  # each run's files of its own
                folder.mkdir()
                runs[name].append(leg(folder))
                print(f"{name}: {runs[name][-1]['wall_s']:.1f} s", flush=True)
        result.update({name: medians(got) for name, got in runs.items()})
        result["walls_s"] = {name: [r["wall_s"] for r in got] for name, got in runs.items()}
    except (RuntimeError, ValueError, OSError) as exc:  # a leg or the dataset failed
        done = {k: [r["wall_s"] for r in v] for k, v in runs.items() if v}
        print(f"error: {str(exc).strip().splitlines()[-1]} (legs done: {done})",
              file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
