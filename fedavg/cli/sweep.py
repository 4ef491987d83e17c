"""The ``fedavg sweep`` and ``fedavg report`` commands (:mod:`fedavg.cli.app` adds them).

``sweep`` runs the points of a sweep config (:mod:`fedavg.sweeps.grid`), each as its own ``fedavg
simulate`` process (:mod:`fedavg.sweeps.runner`), under a progress display; ``report`` turns run
folders into tables and plots (:mod:`fedavg.sweeps.report`).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from fedavg.cli.options import path_argument, path_option
from fedavg.cli.support import console, err_console, guard
from fedavg.util.errors import UserError

_SAID = {"run": "run", "rerun": "run again from scratch (stopped half-way)",
         "resume": "go on after round {round} (stopped half-way)",
         "extend": "train on after round {round} (finished; rounds raised)",
         "skip": "skip (finished earlier)", "failed": "failed earlier (--retry-failed reruns)"}


def sweep(
    config: Annotated[Path, path_argument(help="Sweep config (TOML: [base], [grid], "
                                                "[[points]])")],
    output: Annotated[Optional[Path], path_option(
        help="Sweep folder, one run folder per point (default runs/<config name>)")] = None,
    parallel: Annotated[int, typer.Option(help="Points running at once")] = 1,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="List the points and what would happen, check each point's data "
                     "and model; run nothing")] = False,
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed", help="Run points that failed in an earlier sweep again")] = False,
    only: Annotated[Optional[list[str]], typer.Option(
        help="Only the points with this setting, KEY=VALUE (repeatable: all must match), "
             "e.g. --only strategy=fedprox")] = None,
) -> None:
    """Run every point of a sweep config as its own `fedavg simulate`; resumable."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.sweeps.grid import load_sweep
    from fedavg.sweeps.plan import STARTS, plan, select
    from fedavg.sweeps.runner import Runner, check_sweep_folder, cpu_note, locked

    out = output if output is not None else Path("runs") / config.stem
    with guard():
        if parallel < 1:
            raise UserError(f"--parallel must be >= 1 (got {parallel})")
        whole = load_sweep(config)
        spec = select(whole, only or [])
        check_sweep_folder(out)
        names = [p.name for p in whole.points]
        planned = plan(spec, out, retry_failed, names=names)
    if dry_run:
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.sweeps.plan import check_points

        try:
            with console.status("checking each point's data, partitions and model"):
                problems = check_points(planned)
        except KeyboardInterrupt:
            err_console.print("interrupted while checking the points; nothing was run")
            raise typer.Exit(130) from None
        _show_plan(spec, planned, out, problems)
        raise typer.Exit(1 if problems else 0)
    with guard():
        _check_points(planned)
    for note in (cpu_note([p.point for p in planned if p.action in STARTS], parallel),
                 _repeats_note(planned)):
        if note:
            err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    with guard(), locked(out):
        planned = plan(spec, out, retry_failed, move=True, names=names)  # again, now that no
        # other sweep can write; runs of renamed points move to their new folders
        for p in planned:
            if "renamed_from" in p.record:
                err_console.print(f"[yellow]note:[/] {escape(p.record['renamed_from'])} holds "
                                  f"the run of point {escape(p.point.name)}: renamed to it",
                                  highlight=False)
        chosen = {p.point.name for p in planned}
        left_out = [p for p in plan(whole, out, retry_failed) if p.point.name not in chosen]
        runner = Runner(spec, planned, out, parallel, left_out=left_out)
        code = _run_with_progress(runner, len(planned))
    _say_end(runner, out, code)
    raise typer.Exit(code)


def _check_points(planned) -> None:
    """Refuse a sweep one of whose points to run would fail at once, maybe hours into it.

    A bad model or model argument, more cores per node than there are (see
    :func:`fedavg.sweeps.plan.quick_problems`); the dry run checks each point's data and
    model in full.
    """
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.sweeps.plan import quick_problems

    problems = quick_problems(planned)
    if problems:
        name, why = next(iter(problems.items()))
        raise UserError(f"point {name}: {why}; fix the sweep config (--dry-run checks every "
                        "point's data and model)")


def _repeats_note(planned) -> str | None:
    """Say which points that would start train exactly as another point of the sweep."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.sweeps.grid import repeated_runs
    from fedavg.sweeps.plan import STARTS

    same = repeated_runs([p.point for p in planned])
    starting = [name for p in planned if (name := p.point.name) in same and p.action in STARTS]
    if not starting:
        return None
    shown = "; ".join(f"{name} repeats {same[name]}" for name in starting[:3])
    more = f" and {len(starting) - 3} more" if len(starting) > 3 else ""
    return (f"{len(starting)} point(s) train exactly as another, differing only in partition "
            f"settings their partitioner ignores: {shown}{more}; list the points as [[points]] "
            "to train each once")


def _show_plan(spec, planned, out: Path, problems: dict[str, str]) -> None:
    from rich.table import Table

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.sweeps.grid import format_value
    from fedavg.sweeps.plan import STARTS

    shared = spec.shared()
    if shared:
        console.print("shared: " + escape(" ".join(f"{k}={format_value(v)}"
                                                   for k, v in shared.items())), highlight=False)
    table = Table(title=f"{len(planned)} point{'s' * (len(planned) != 1)} into "
                        f"{escape(str(out))}")
    table.add_column("point", overflow="fold")
    for key in spec.varying:
        table.add_column(key, overflow="fold")
    table.add_column("what the sweep does", overflow="fold")
    for p in planned:
        values = [format_value(p.point.settings[key] if key in p.point.settings
                               else p.point.config.to_flat().get(key, ""))
                  for key in spec.varying]
        said = escape(_SAID["extend" if p.record.get("finished") else p.action]
                      .format(**p.record))
        if "renamed_from" in p.record:
            said += escape(f"; its run is in {p.record['renamed_from']}, renamed to "
                           f"{p.point.name} when the sweep runs")
        if p.point.name in problems:
            said = f"[red]would fail: {escape(problems[p.point.name])}[/]"
        table.add_row(escape(p.point.name), *map(escape, values), said)
    console.print(table)
    todo = sum(p.action in STARTS for p in planned)
    failing = f", {len(problems)} of them would fail at the start" if problems else ""
    console.print(f"dry run: {todo} of {len(planned)} points would run{failing}; nothing was run")
    repeats = _repeats_note(planned)
    if repeats:
        console.print(f"note: {escape(repeats)}", highlight=False)


def _run_with_progress(runner, total: int) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(SpinnerColumn(), TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                        console=console, transient=True)
    task = progress.add_task("sweep", total=total, counts="")

    def event(record: dict[str, Any]) -> None:
        name, status = escape(record["name"]), record["status"]
        if status == "running":
            line = f"started {name}"
        elif status == "skipped":
            line = f"[dim]skipped {name} (finished earlier)[/]"
        elif status == "done":
            acc = record.get("accuracy")
            line = (f"[green]done[/] {name} in {record['wall_s']:.1f} s"
                    + (f": accuracy {acc:.4f}" if isinstance(acc, float) else ""))
        else:
            again = "" if record["ran"] else " in an earlier sweep (--retry-failed reruns it)"
            why = record.get("error")
            line = (f"[red]{status}[/] {name}{again} (exit {record['exit_code']})"
                    + (f": {escape(why)}" if why else ""))
        progress.console.print(line, highlight=False)
        counts = runner.counts()
        finished = sum(counts.get(s, 0) for s in ("done", "skipped", "failed", "interrupted"))
        progress.update(task, completed=finished, counts=", ".join(
            f"{counts.get(s, 0)} {s}" for s in ("done", "failed", "running")))

    runner.on_event = event
    with progress:
        return runner.run()


def _say_end(runner, out: Path, code: int) -> None:
    counts = runner.counts()
    took = time.time() - runner.started
    parts = [f"{counts.get('done', 0)} done", f"{counts.get('skipped', 0)} skipped",
             f"{counts.get('failed', 0)} failed"]
    for extra in ("interrupted", "pending"):
        if counts.get(extra):
            parts.append(f"{counts[extra]} {'not started' if extra == 'pending' else extra}")
    if runner.left_out:
        parts.append(f"{len(runner.left_out)} left out by --only")
    total = len(runner.records)
    line = (f"sweep of {total} point{'s' * (total != 1)}: {', '.join(parts)} in {took:.1f} s; "
            f"record in {escape(str(out / 'sweep.json'))}")
    if code == 130:
        err_console.print(f"interrupted: {line}; run the same command again to go on",
                          highlight=False)
        return
    console.print(line, highlight=False)
    if counts.get("failed"):
        console.print("logs of failed points: " + ", ".join(
            escape(str(out / r["name"] / "sweep.log")) for r in runner.records.values()
            if r["status"] == "failed"), highlight=False)
    console.print(f"tables and plots: fedavg report {escape(shlex.quote(str(out)))}",
                  highlight=False)


def report(
    runs_dir: Annotated[Path, path_argument(
        help="Folder holding run folders (searched recursively)")],
    target: Annotated[float, typer.Option(
        help="Accuracy whose first round the table shows")] = 0.9,
    output: Annotated[Optional[Path], path_option(
        help="Where results.md, results.csv, runs.csv and plots/ go (default RUNS_DIR)")] = None,
    published: Annotated[Optional[Path], path_option(
        help="Published figures (TOML) to show beside the runs' best accuracy")] = None,
    name: Annotated[str, typer.Option(
        help="File stem: NAME.md, NAME.csv, NAME_runs.csv, NAME_plots/")] = "results",
) -> None:
    """Tables (Markdown, CSV) and plots of the runs under a folder, grouped over seeds."""
    from rich.markdown import Markdown

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.sweeps.report import write_report

    with guard("interrupted: run `fedavg report` again for a whole report", failed="error"):
        res = write_report(runs_dir, target=target, output=output, published=published,
                           name=name)
    if console.is_terminal:
        console.print(Markdown(res["table"]))
    else:  # piped or in a file: the Markdown itself, its rows unbroken
        console.print(res["table"], markup=False, highlight=False)
    for note in res["notes"]:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    runs, groups = res["num_runs"], res["num_groups"]
    console.print(f"{runs} run{'' if runs == 1 else 's'} in {groups} "
                  f"group{'' if groups == 1 else 's'}; wrote "
                  + ", ".join(escape(str(p)) for p in res["written"]), highlight=False)
