"""Tables and plots of finished runs: ``fedavg report RUNS_DIR``.

Every folder under ``RUNS_DIR`` holding ``summary.json``, ``model.json`` and
``metrics.jsonl`` is a run (made by ``fedavg sweep``, ``fedavg simulate`` or ``fedavg
coordinator``). Runs whose settings are the same but for ``seed`` form a group; each group
is one row of the table, with the mean and the sample standard deviation (``ddof=1``) over
its runs. Written: ``results.md`` and ``results.csv`` (the groups), ``runs.csv`` (one row per
run, numbers exactly as in the run folders) and the plots of :mod:`fedavg.sweeps.plots`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from fedavg.config.setting_use import setting_applies
from fedavg.data.sources import same_source
from fedavg.sweeps import plots as report_plots
from fedavg.sweeps.published import load_published, valid_name
from fedavg.sweeps.runs import (  # noqa: F401  (re-exported)
    REQUIRED,
    Group,
    Run,
    cell,
    find_runs,
    flat_settings,
    group_runs,
    mean_std,
    read_run,
    target_round,
)
from fedavg.util.errors import UserError

#: Settings shown first when they vary; the others follow in the config's order.
FIRST = ("strategy", "partitioner", "alpha", "num-nodes", "local-epochs", "lr", "model",
         "dataset")


def varying(runs: list[Run]) -> list[str]:
    """Return the settings whose values differ across ``runs`` (:data:`FIRST` first)."""
    keys = list(dict.fromkeys(k for r in runs for k in r.settings))
    out = [k for k in keys if len({json.dumps(r.settings.get(k)) for r in runs}) > 1]
    return sorted(out, key=lambda k: (FIRST.index(k) if k in FIRST else len(FIRST),
                                      keys.index(k)))


def _pm(mean: float | None, std: float | None, digits: int) -> str:
    if mean is None:
        return ""
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def markdown_table(groups: list[Group], keys: list[str], target: float,
                   published=None) -> str:
    """Return the groups as one Markdown table (mean ± std over seeds, ``n`` runs each).

    With ``published`` (:class:`fedavg.sweeps.published.Published`), a ``published`` column
    follows ``best accuracy``.
    """
    pub = [] if published is None else ["published"]
    count = [] if "rounds" in keys else ["rounds"]  # a setting that varies shows them already
    private = any(r.epsilon is not None for g in groups for r in g.runs)
    eps = ["epsilon"] if private else []  # node-level DP runs: their epsilon at their delta
    head = [*keys, "n", "seeds", "final accuracy", "best accuracy", *pub,
            f"round ≥ {target:g}", *count, "wall s", "round s", "MB sent + got", *eps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        s = g.stats(target)
        reached = ("" if s["target_round_mean"] is None else
                   f"{s['target_round_mean']:g} ({s['target_reached']}/{s['n']})")
        row = [*(cell(g.values.get(k)) for k in keys), str(s["n"]),
               " ".join(cell(x) for x in g.seeds), _pm(s["accuracy_mean"], s["accuracy_std"], 4),
               _pm(s["best_accuracy_mean"], s["best_accuracy_std"], 4),
               *([] if published is None else [_pm(_figure(published, g), None, 4)]), reached,
               *([str(s["rounds"])] if count else []), _pm(s["wall_s_mean"], s["wall_s_std"], 1),
               _pm(s["round_s_mean"], None, 2), _megabytes(s["bytes_mean"]),
               *([] if not private else [_pm(s["epsilon_mean"], None, 3)])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def _megabytes(num_bytes: float | None) -> str:
    """Bytes as megabytes (10**6) for the table; blank when not counted."""
    if num_bytes is None:
        return ""
    mb = num_bytes / 1e6
    return f"{mb:.3g}" if mb < 100 else f"{mb:,.0f}"


def _figure(published, group: Group) -> float | None:
    return None if published is None else published.figure_for(group.runs[0].settings)


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else value


def write_csvs(groups: list[Group], runs: list[Run], keys: list[str], target: float,
               out: Path, root: Path, published=None, name: str = "results") -> list[Path]:
    """Write ``results.csv`` (one row per group) and ``runs.csv`` (one row per run).

    With another ``name``: ``NAME.csv`` and ``NAME_runs.csv``. With ``published``, a
    ``published_best_accuracy`` column follows the stats.
    """
    count = [] if "rounds" in keys else ["rounds"]  # a setting that varies shows them already
    stats = ["n", "accuracy_mean", "accuracy_std", "best_accuracy_mean", "best_accuracy_std",
             "target_round_mean", "target_reached", *count, "wall_s_mean", "wall_s_std",
             "round_s_mean", "bytes_mean", "epsilon_mean"]
    pub = [] if published is None else ["published_best_accuracy"]
    results = out / f"{name}.csv"
    with open(results, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([*keys, "seeds", *stats, *pub, "target"])
        for g in groups:
            s = g.stats(target)
            figure = [] if published is None else [_csv_value(_figure(published, g))]
            writer.writerow([*(_csv_value(g.values.get(k)) for k in keys),
                             " ".join(cell(x) for x in g.seeds),
                             *(_csv_value(s[stat]) for stat in stats), *figure, target])
    per_run = out / ("runs.csv" if name == "results" else f"{name}_runs.csv")
    seed = [] if "seed" in keys else ["seed"]
    with open(per_run, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", *keys, *seed, "accuracy", "best_accuracy", "target_round",
                         *count, "wall_s", "round_s", "bytes", "epsilon", "target"])
        for r in runs:
            writer.writerow([_relative(r.path, root),
                             *(_csv_value(r.settings.get(k)) for k in [*keys, *seed]),
                             r.accuracy, r.best_accuracy, _csv_value(r.target_round(target)),
                             *([r.rounds] if count else []), r.wall_s, _csv_value(r.round_s),
                             _csv_value(r.bytes_total), _csv_value(r.epsilon), target])
    return [results, per_run]


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root)) or "."
    except ValueError:
        return str(path)


def write_report(runs_dir: str | Path, *, target: float = 0.9,
                 output: str | Path | None = None, published: str | Path | None = None,
                 name: str = "results") -> dict[str, Any]:
    """Write the tables and plots of the runs under ``runs_dir``.

    Parameters
    ----------
    runs_dir : path
        Folder searched (recursively) for run folders.
    target : float
        Test accuracy (a fraction in (0, 1]) whose first round the table shows.
    output : path, optional
        Folder for ``results.md``, ``results.csv``, ``runs.csv`` and ``plots/``
        (default ``runs_dir``).
    published : path, optional
        Published figures to show beside the runs' (:mod:`fedavg.sweeps.published`).
    name : str
        Stem of the files: ``NAME.md``, ``NAME.csv``, ``NAME_runs.csv`` and ``NAME_plots/``
        instead of the default names (for several reports in one folder).

    Returns
    -------
    dict
        ``table`` (the Markdown table), ``notes``, ``written`` (paths), ``num_runs``,
        ``num_groups``.

    Raises
    ------
    UserError
        A ``target`` outside (0, 1], ``runs_dir`` missing or without runs, an unwritable
        ``output``, a bad ``published`` file or ``name``.
    """
    if not valid_name(name):
        raise UserError(f"--name {name!r}: give a file stem such as niid (letters, digits, "
                        "._+-; no folders, spaces or leading dot)")
    if name == "runs":  # its runs.csv would replace the default report's table of runs
        raise UserError("--name runs: runs.csv is the default report's table of runs; give "
                        "another name")
    figures = load_published(published) if published is not None else None

    if not (isinstance(target, (int, float)) and 0 < target <= 1 and math.isfinite(target)):
        raise UserError(f"--target must be an accuracy in (0, 1] (got {target})")
    root = Path(runs_dir)
    runs, notes = find_runs(root)
    out = Path(output) if output is not None else root
    try:
        return _write(runs, notes, root, out, target, figures, name)
    except OSError as exc:  # a file where a folder goes, or the other way round
        where = f"{exc.filename}: " if exc.filename else ""
        raise UserError(f"cannot write the report into {out}: {where}{exc.strerror}") from None


def _write(runs: list[Run], notes: list[str], root: Path, out: Path, target: float,
           figures, name: str) -> dict[str, Any]:
    """Write :func:`write_report`'s files into ``out``; return its result."""
    plots_dir = out / ("plots" if name == "results" else f"{name}_plots")
    plots_dir.mkdir(parents=True, exist_ok=True)
    keys = varying(runs)
    shown = [k for k in keys if k != "seed"]
    groups = group_runs(runs, shown)
    table = markdown_table(groups, shown, target, figures)
    written = write_csvs(groups, runs, shown, target, out, root, figures, name)
    plots, plot_notes = report_plots.write_plots(runs, keys, plots_dir)
    notes += plot_notes + _sweep_notes(root) + _distill_notes(runs) + _same_seed_notes(
        groups, root)
    if figures is not None:
        notes += [f"no run has the settings of the published figure {f}"
                  for f in figures.unmatched([r.settings for r in runs])]
    md = _write_markdown(out / f"{name}.md", root, runs, groups, table, target, plots, notes,
                         figures)
    written.insert(0, md)
    return {"table": table, "notes": notes, "written": written + plots,
            "num_runs": len(runs), "num_groups": len(groups)}


def _same_seed_notes(groups: list[Group], root: Path) -> list[str]:
    """Name runs of one group with one seed: copies of a run, counted twice in its ``n``."""
    notes = []
    for group in groups:
        first: dict[str, Run] = {}
        for run in group.runs:
            seed = json.dumps(run.settings.get("seed"))
            if seed in first:
                notes.append(f"{_relative(run.path, root)} has the settings and seed of "
                             f"{_relative(first[seed].path, root)} (a copy, or the same run "
                             f"again): both count in the n of {group.label}")
            else:
                first[seed] = run
    return notes


def _distill_notes(runs: list[Run]) -> list[str]:
    """Say which unlabeled data the distilled runs used (papers differ: some use none)."""
    used = set()
    for r in runs:
        s = r.settings
        if s.get("strategy") == "distill":
            given = s.get("distill-data")  # the run's own dataset: the slice kept, too
            data = given if given and not same_source(given, s.get("dataset")) else (
                f"{float(s.get('distill-fraction') or 0):.0%} of the train split, kept from "
                "the nodes")
            augmented = ", augmented" if s.get("distill-augment") == "default" else ""
            used.add(f"distillation data: {data} (unlabeled{augmented})")
    return sorted(used)


def _sweep_notes(root: Path) -> list[str]:
    """Name the points an earlier ``fedavg sweep`` into ``root`` did not finish."""
    try:
        record = json.loads((root / "sweep.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict) or not isinstance(record.get("points"), list):
        return [f"{root / 'sweep.json'} is not a sweep record; left out"]
    missing = [p.get("name") for p in record["points"] if isinstance(p, dict)
               and p.get("status") not in ("done", "skipped")]
    if not missing:
        return []
    return [f"{len(missing)} sweep point(s) have no results (see {root / 'sweep.json'}): "
            + ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")]


def applies(key: str, settings: dict[str, Any]) -> bool:
    """Whether setting ``key`` (kebab case) shaped a run with these flat ``settings``.

    ``alpha``, ``classes-per-node`` and ``partition-by`` apply only with a partitioner that
    takes them (:func:`fedavg.config.setting_use.setting_applies`); every other setting applies.
    """
    return setting_applies(key.replace("-", "_"), settings.get("partitioner"))


def _write_markdown(path: Path, root: Path, runs: list[Run], groups: list[Group], table: str,
                    target: float, plots: list[Path], notes: list[str], published=None
                    ) -> Path:
    shared = {k: v for k, v in runs[0].settings.items()
              if all(r.settings.get(k) == v for r in runs) and v is not None
              and all(applies(k, r.settings) for r in runs)}
    text = [f"# Results: {root}", "",
            f"{len(runs)} runs in {len(groups)} groups (runs identical but for `seed`); "
            f"mean ± sample std over a group's runs; round ≥ {target:g}: the first round "
            "reaching that test accuracy (mean over the runs that did, and how many did).", "",
            "Shared settings: " + ", ".join(f"`{k}={cell(v)}`" for k, v in shared.items()), "",
            table, ""]
    if published is not None:
        text += [f"published: {published.metric}, {published.source}.", ""]
        if published.differences:
            text += ["How these runs differ from the publication:", "",
                     *[f"- {d}" for d in published.differences], ""]
    text += [f"![{p.stem.replace('_', ' ')}]({_relative(p, path.parent)})" for p in plots]
    if notes:
        text += ["", *[f"- {n}" for n in notes]]
    path.write_text("\n".join(text) + "\n")
    return path
