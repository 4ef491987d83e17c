"""The plots of ``fedavg report`` (matplotlib, Agg backend: no display needed).

- ``accuracy_per_round.png``: test accuracy per round, one line per group of runs identical
  but for ``seed`` (the mean), with a band of +- one sample std over the group's seeds;
- ``accuracy_vs_alpha.png``: final accuracy against the Dirichlet ``alpha`` (when it varies
  among the runs of a partitioner taking ``alpha``), one line per group of the other
  varying settings, error bars over seeds;
- ``wall_time_vs_nodes.png``: a run's wall time against ``num-nodes`` (when it varies);
- ``accuracy_vs_bytes.png``: test accuracy after each round against the bytes sent both ways
  so far (cumulative, log scale), one line per group (means over seeds), when the runs
  counted them;
- ``accuracy_vs_uplink.png``: the same against the bytes the nodes sent alone (the uplink,
  what ``--compress`` shrinks), when the runs counted them.

A plot whose setting does not vary is not written (and an older one is removed), with a note.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from fedavg.data.partition import get_partitioner
from fedavg.sweeps.runs import group_runs
from fedavg.util.errors import UserError

PLOTS = ("accuracy_per_round.png", "accuracy_vs_alpha.png", "wall_time_vs_nodes.png",
         "accuracy_vs_bytes.png", "accuracy_vs_uplink.png")


def write_plots(runs: list, keys: list[str], folder: Path) -> tuple[list[Path], list[str]]:
    """Write the plots of ``runs`` (:class:`fedavg.sweeps.report.Run`) into ``folder``.

    Parameters
    ----------
    runs : list of fedavg.sweeps.report.Run
        The runs.
    keys : list of str
        The settings that vary across them (``seed`` included if it does).
    folder : pathlib.Path
        Where the PNG files go (it exists).

    Returns
    -------
    (list of pathlib.Path, list of str)
        The files written, and a note per plot left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    written, notes = [folder / PLOTS[0]], []
    _per_round(runs, keys, written[0])
    alpha_runs = [r for r in runs if _takes_alpha(r.settings.get("partitioner"))]
    for name, key, chosen, draw in ((PLOTS[1], "alpha", alpha_runs, _vs_alpha),
                                    (PLOTS[2], "num-nodes", runs, _vs_nodes)):
        path = folder / name
        if len({r.settings.get(key) for r in chosen}) > 1:
            draw(chosen, keys, path)
            written.append(path)
        else:
            path.unlink(missing_ok=True)
            if key == "alpha" and not chosen:
                notes.append(f"no run's partitioner takes alpha: no {folder.name}/{name}")
                continue
            where = " among the runs whose partitioner takes it" if key == "alpha" else ""
            notes.append(f"{key} does not vary{where}: no {folder.name}/{name}")
    counted = [r for r in runs if r.bytes_curve]
    for name, curve, title in ((PLOTS[3], "bytes_curve", "bytes sent + received"),
                               (PLOTS[4], "uplink_curve", "bytes the nodes sent")):
        path = folder / name
        if counted:
            _vs_bytes(counted, keys, path, curve, title)
            written.append(path)
        else:
            path.unlink(missing_ok=True)
            notes.append(f"no run counted its bytes (runs of an older fedavg): no "
                         f"{folder.name}/{name}")
    return written, notes


def _takes_alpha(partitioner: Any) -> bool:
    try:
        return "alpha" in get_partitioner(str(partitioner)).params
    except UserError:  # a partitioner of a package not installed here
        return True


def _lines(runs: list, keys: list[str], leave_out: tuple[str, ...]):
    """Group runs by the varying settings but ``leave_out``: ``[(label, runs)]``."""
    shown = [k for k in keys if k not in leave_out]
    return [(g.label, g.runs) for g in group_runs(runs, shown, over=leave_out)]


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, count: int) -> None:
    import matplotlib.pyplot as plt

    if count > 8:  # many lines: the legend goes beside the axes, over no curve nor label
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    elif count > 1:
        ax.legend(fontsize="small", loc="best")
    import warnings

    with warnings.catch_warnings():  # a legend too tall to lay out: the tight box still fits
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _per_round(runs: list, keys: list[str], path: Path) -> None:
    lines = _lines(runs, keys, ("seed",))
    fig, ax = _figure("Test accuracy per round (mean, band: ± std over seeds)", "round",
                      "test accuracy")
    for label, group in lines:
        rounds = sorted(set.intersection(*({r for r, _ in run.curve} for run in group)))
        values = [[dict(run.curve)[r] for run in group] for r in rounds]
        mean = [statistics.fmean(v) for v in values]
        line, = ax.plot(rounds, mean, marker="o" if len(rounds) < 30 else None,
                        markersize=3, label=label)
        if len(group) > 1:
            std = [statistics.stdev(v) for v in values]
            ax.fill_between(rounds, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], color=line.get_color(),
                            alpha=0.2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _save(fig, ax, path, len(lines))


def _vs_bytes(runs: list, keys: list[str], path: Path, curve: str, title: str) -> None:
    """Accuracy against a run's cumulative bytes (``curve``: a :class:`Run` field)."""
    lines = _lines(runs, keys, ("seed",))
    fig, ax = _figure(f"Test accuracy against the {title} (mean over seeds)",
                      f"{title}, cumulative", "test accuracy")
    for label, group in lines:
        points = [getattr(run, curve) for run in group]
        rounds = min(len(p) for p in points)
        xs = [statistics.fmean(p[i][0] for p in points) for i in range(rounds)]
        ys = [statistics.fmean(p[i][1] for p in points) for i in range(rounds)]
        ax.plot(xs, ys, marker="o" if rounds < 30 else None, markersize=3, label=label)
    ax.set_xscale("log")
    _save(fig, ax, path, len(lines))


def _xy(group: list, key: str, value: str):
    """Per distinct ``key`` value: mean and std of ``value`` over the group's runs."""
    xs = sorted({r.settings[key] for r in group})
    ys = [[getattr(r, value) for r in group if r.settings[key] == x] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [
        statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]


def _vs_alpha(runs: list, keys: list[str], path: Path) -> None:
    lines = _lines(runs, keys, ("seed", "alpha"))
    fig, ax = _figure("Final test accuracy against Dirichlet alpha (± std over seeds)",
                      "alpha (smaller: more label skew)", "final test accuracy")
    alphas = [r.settings["alpha"] for r in runs]
    if max(alphas) / min(alphas) >= 10:
        ax.set_xscale("log")
    for label, group in lines:
        xs, mean, std = _xy(group, "alpha", "accuracy")
        ax.errorbar(xs, mean, yerr=std, marker="o", capsize=3, label=label)
    _save(fig, ax, path, len(lines))


def _vs_nodes(runs: list, keys: list[str], path: Path) -> None:
    lines = _lines(runs, keys, ("seed", "num-nodes"))
    fig, ax = _figure("Wall time of a run against the number of nodes (± std over seeds)",
                      "nodes", "wall time (s)")
    for label, group in lines:
        xs, mean, std = _xy(group, "num-nodes", "wall_s")
        ax.errorbar(xs, mean, yerr=std, marker="o", capsize=3, label=label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _save(fig, ax, path, len(lines))
