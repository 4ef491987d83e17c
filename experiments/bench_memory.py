"""Memory of a long simulation, round by round (does it grow with the rounds?).

Usage::

    python experiments/bench_memory.py [--num-nodes 100] [--fraction 0.1] [--rounds 20]
                                       [--compare 5] [--json FILE]

Runs ``fedavg simulate`` on digits as a user would (a separate process, its own output and
temporary folder) and samples the memory of the run's processes, the command and every
process it started (Ray's GCS server, raylet, workers and actors: its descendants, found by
walking ``/proc``), from ``/proc/PID/smaps_rollup``:

- PSS: each page split among the processes that map it, so the sum counts a page once;
- anon: the anonymous and shared-memory part of PSS (heaps, tensors, Ray's object store),
  what a leak grows; unlike the whole PSS it does not move when unrelated processes that map
  the same libraries (torch) start or stop elsewhere on the machine;
- USS (pages of one process only) and RSS (every resident page of each process).

A sample is taken whenever a round's line appears in ``metrics.jsonl`` and about every
0.2 s in between, for the peak. It prints one row per round (the sample taken as its line
appeared) and the ratios of the memory after the last round but one to that after round
``--compare``: the last round's line is followed at once by the run's shutdown, so its
sample may miss actors that are already stopping (the next-to-last round's sample is taken
while the last round runs). Ray workers that keep memory across rounds (a known Flower pain
point) would show as a ratio well above 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


@dataclass
class Sample:
    """Memory of a process tree at one moment (bytes), and which processes it holds."""

    round: int
    t_s: float
    pss: int
    anon: int
    uss: int
    rss: int
    processes: dict[str, int] = field(default_factory=dict)  # role -> count


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it, by the parent pids in ``/proc/PID/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def role(pid: int) -> str:
    """Name what process ``pid`` is: ``raylet``, ``gcs_server``, ``ray::ClientAppActor`` ..."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    first = argv[0].split()[0]
    if first.startswith("ray::"):  # an actor or Ray agent: ray::Name, or ray::Name.method
        return first.split(".")[0]
    name = os.path.basename(first)
    if not name.startswith("python"):
        return name
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    if script.endswith("default_worker.py"):
        return "ray idle worker"
    return f"python {os.path.basename(script)}".strip()


def memory(pid: int) -> tuple[int, int, int, int] | None:
    """``(pss, anon, uss, rss)`` of ``pid`` in bytes (``/proc/PID/smaps_rollup``); gone: ``None``.

    ``anon`` is ``Pss_Anon + Pss_Shmem``.
    """
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return None
    if "Pss" not in values:  # a kernel thread or a process exiting
        return None
    uss = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
    anon = values.get("Pss_Anon", 0) + values.get("Pss_Shmem", 0)
    return values["Pss"], anon, uss, values.get("Rss", 0)


def sample(root: int, rnd: int, t0: float) -> Sample:
    """Memory of ``root`` and its descendants now, labelled with round ``rnd``."""
    s = Sample(rnd, time.monotonic() - t0, 0, 0, 0, 0)
    for pid in descendants(root):
        got = memory(pid)
        if got is None:
            continue
        s.pss, s.anon, s.uss, s.rss = (s.pss + got[0], s.anon + got[1], s.uss + got[2],
                                       s.rss + got[3])
        name = role(pid)
        s.processes[name] = s.processes.get(name, 0) + 1
    return s


def rounds_done(metrics: Path) -> int:
    """Complete lines of ``metrics.jsonl`` so far."""
    try:
        return metrics.read_bytes().count(b"\n")
    except OSError:
        return 0


def watch(proc: subprocess.Popen, metrics: Path, every_s: float = 0.2,
          poll_s: float = 0.01) -> tuple[dict[int, Sample], Sample | None]:
    """Sample ``proc``'s tree as each round ends and every ``every_s`` s until it exits.

    Returns
    -------
    tuple
        ``{round: sample taken as that round's line appeared}`` and the sample with the
        largest PSS (the peak), or ``None`` if no sample was taken.
    """
    t0 = time.monotonic()
    at_round: dict[int, Sample] = {}
    peak: Sample | None = None
    seen, last = 0, 0.0
    while proc.poll() is None:
        done = rounds_done(metrics)
        now = time.monotonic()
        if done > seen or now - last >= every_s:
            s = sample(proc.pid, done, t0)
            last = now
            if done > seen:
                at_round[done] = s
                seen = done
            if s.processes and (peak is None or s.pss > peak.pss):
                peak = s
        time.sleep(poll_s)
    return at_round, peak


def run(num_nodes: int, fraction: float, rounds: int, extra: list[str],
        keep: Path | None = None, timeout_s: float = 900.0, dataset: str = "digits") -> dict:
    """Run ``fedavg simulate`` on ``dataset`` and watch its memory; return the figures.

    The figures hold the run's ``metrics.jsonl`` rows (``metrics``) and ``summary.json``
    (``summary``), the memory sample taken
    as each round's line appeared (``at_round``, with ``t_s``: seconds since the command
    started), the peak sample and the command's wall time (``wall_s``).

    The command gets a temporary folder of its own (``TMPDIR``), which is checked to be
    empty of our folders afterwards and removed.

    Raises
    ------
    RuntimeError
        The run failed or ran past ``timeout_s``.
    """
    work = Path(tempfile.mkdtemp(prefix="bm", dir="/tmp"))  # short: Ray's socket paths
    out = (keep or work) / "run"
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    cmd = [sys.executable, "-m", "fedavg.cli", "simulate", "--dataset", dataset,
           "--num-nodes", str(num_nodes), "--fraction", str(fraction), "--rounds", str(rounds),
           "--output", str(out), "--overwrite", *extra]
    env = {**os.environ, "TMPDIR": str(tmpdir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    log = work / "simulate.log"
    try:
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            try:
                at_round, peak = watch(proc, out / "metrics.jsonl")
                proc.wait(timeout_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        text = log.read_text()
        if proc.returncode != 0:
            raise RuntimeError(f"fedavg simulate exited {proc.returncode}:\n{text[-3000:]}")
        metrics = out / "metrics.jsonl"
        return {"num_nodes": num_nodes, "fraction": fraction, "rounds": rounds,
                "dataset": dataset, "wall_s": round(time.monotonic() - t0, 1),
                "metrics": [json.loads(line) for line in metrics.read_text().splitlines()],
                "summary": json.loads((out / "summary.json").read_text()),
                "rounds_written": rounds_done(out / "metrics.jsonl"),
                "at_round": {r: asdict(s) for r, s in sorted(at_round.items())},
                "peak": asdict(peak) if peak else None,
                "tmp_left": sorted(os.listdir(tmpdir))}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict, compare: int) -> str:
    """Format the figures: one row per round, the peak and the ratio."""
    keys = ("pss", "anon", "uss", "rss")
    rows = ["round  t (s)  " + "  ".join(f"{k.upper() + ' MiB':>8}" for k in keys)
            + "  processes"]

    def row(label: str, s: dict, note: str) -> str:
        return (f"{label:>5}  {s['t_s']:>5.1f}  "
                + "  ".join(f"{s[k] / MIB:>8.0f}" for k in keys) + f"  {note}")

    for rnd, s in result["at_round"].items():
        rows.append(row(str(rnd), s, ", ".join(f"{n} x{c}"
                                               for n, c in sorted(s["processes"].items()))))
    peak = result["peak"]
    if peak:
        when = (f"during round {peak['round'] + 1}" if peak["round"] < result["rounds"]
                else f"after round {peak['round']}")
        rows.append(row("peak", peak, f"(of PSS; {when})"))
    ratios = [f"{k.upper()} {r:.3f}" for k in keys
              if (r := memory_ratio(result, compare, k)) is not None]
    if ratios:
        rows.append(f"after round {result['rounds'] - 1} / after round {compare}: "
                    + ", ".join(ratios))
    rows.append(f"wall {result['wall_s']:.1f} s; {result['rounds_written']} rounds written")
    return "\n".join(rows)


def memory_ratio(result: dict, compare: int, key: str = "pss") -> float | None:
    """Memory after the last round but one over that after round ``compare``.

    The last round but one: its sample is taken while the last round runs, so it sees the
    whole run (the last round's sample may race the shutdown). ``None``: no sample.
    """
    rounds = result["at_round"]
    last, first = rounds.get(result["rounds"] - 1), rounds.get(compare)
    if last is None or first is None or not first[key]:
        return None
    return last[key] / first[key]


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--compare", type=int, default=5,
                        help="the round whose memory the last round but one's is "
                             "compared with")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="keep the run folder in this folder")
    parser.add_argument("extra", nargs="*",
                        help="more `fedavg simulate` options (after --), e.g. -- --seed 1")
    args = parser.parse_args(argv)
    if not 1 <= args.compare < args.rounds - 1:
        parser.error("--compare must be in 1..--rounds - 2")
    result = run(args.num_nodes, args.fraction, args.rounds, args.extra, args.keep)
    for key in ("pss", "anon", "uss", "rss"):
        result[f"ratio_{key}"] = memory_ratio(result, args.compare, key)
    print(f"fedavg simulate: digits, {args.num_nodes} nodes, fraction {args.fraction:g}, "
          f"{args.rounds} rounds")
    print(table(result, args.compare))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
