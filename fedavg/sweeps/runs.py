"""The finished runs under a folder, as ``fedavg report`` reads and groups them.

A folder holding ``summary.json``, ``model.json`` and ``metrics.jsonl`` (:data:`REQUIRED`) is
a run: its settings (flat, kebab-case, as the CLI names them), final and best accuracy, the
accuracy curve and the seconds of each round. Folders that cannot be read are left out with
a note (:func:`find_runs`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedavg.config.settings import RunConfig, node_settings_filled
from fedavg.config.values import finite_number
from fedavg.sweeps.grid import format_value
from fedavg.util.errors import UserError

REQUIRED = ("summary.json", "model.json", "metrics.jsonl")


@dataclass
class Run:
    """One finished run, as its folder records it.

    Attributes
    ----------
    path : pathlib.Path
        The run folder.
    settings : dict
        Flat kebab-case settings (``model`` as resolved, ``num-nodes`` as run).
    accuracy, best_accuracy : float
        Final and best test accuracy (fractions).
    rounds : int
        Rounds run.
    wall_s : float
        Seconds the whole command took.
    curve : list of (int, float)
        ``(round, test accuracy)`` per round, from ``metrics.jsonl``.
    round_walls : list of float
        Seconds per round of the rounds that did not wait for a start-up: not round 1,
        nor the first round of a resumed run.
    bytes_total : int or None
        Bytes of serialised arrays sent both ways over the whole run (``None``: a run
        recorded before fedavg counted them).
    bytes_curve : list of (int, float)
        ``(cumulative bytes both ways, test accuracy)`` after each round, from
        ``metrics.jsonl`` (empty without byte counts).
    uplink_curve : list of (int, float)
        ``(cumulative bytes the nodes sent, test accuracy)`` after each round: the uplink
        alone, what ``--compress`` shrinks (empty without byte counts).
    epsilon : float or None
        Node-level DP (``--dp-noise``): the run's epsilon at its delta (``None``: no DP).
    """

    path: Path
    settings: dict[str, Any]
    accuracy: float
    best_accuracy: float
    rounds: int
    wall_s: float
    curve: list[tuple[int, float]]
    round_walls: list[float]
    bytes_total: int | None = None
    bytes_curve: list[tuple[int, float]] = field(default_factory=list)
    uplink_curve: list[tuple[int, float]] = field(default_factory=list)
    epsilon: float | None = None

    def target_round(self, target: float) -> int | None:
        """Return the first round whose test accuracy is >= ``target``, or ``None``."""
        return target_round(self.curve, target)

    @property
    def round_s(self) -> float | None:
        """Lower median of :attr:`round_walls` (``None`` without any)."""
        return statistics.median_low(self.round_walls) if self.round_walls else None


def target_round(curve: list[tuple[int, float]], target: float) -> int | None:
    """Return the first ``round`` of ``curve`` (``(round, accuracy)`` pairs) reaching ``target``."""
    return next((r for r, acc in curve if acc >= target), None)


def find_runs(root: str | Path) -> tuple[list[Run], list[str]]:
    """Return the runs under ``root`` (sorted by folder) and notes on folders left out.

    A folder holding the three files of :data:`REQUIRED` is a run; one with rounds but no
    ``summary.json`` (a run stopped before its end) gets a note. Run folders are searched
    too (an ``--output`` chosen inside one).

    Raises
    ------
    UserError
        ``root`` is not a folder, or holds no readable run.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; give the folder holding the run folders")
    runs, notes, stack = [], [], [root]
    while stack:
        folder = stack.pop()
        has = {name for name in REQUIRED if (folder / name).is_file()}
        if "summary.json" not in has and (folder / "summary.json").exists():
            notes.append(f"{folder} left out: its summary.json is not a file")
        elif "metrics.jsonl" in has and "summary.json" not in has:  # rounds, but no end
            notes.append(f"{folder} left out: no summary.json (a run stopped before its end; "
                         f"--resume {folder} finishes it)")
        elif len(has) == len(REQUIRED):
            try:
                runs.append(read_run(folder, notes))
            except (OSError, ValueError, OverflowError) as exc:
                notes.append(f"{folder} left out: cannot read it ({exc})")
            except KeyError as exc:
                notes.append(f"{folder} left out: its summary.json lacks {exc}")
            except (TypeError, AttributeError):  # "config": "x"
                notes.append(f"{folder} left out: its summary.json holds a field of the "
                             "wrong type (not a fedavg run's summary)")
            else:
                if not runs[-1].curve:
                    notes.append(f"{folder}: its metrics.jsonl holds no rounds, so it has no "
                                 "curve, target round or round time")
        try:  # a run folder may hold runs too (an --output chosen inside it)
            stack += sorted((p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()),
                            reverse=True)
        except OSError as exc:
            notes.append(f"{folder} left out: {exc.strerror}")
    if not runs and notes:  # say why the run folders found were left out
        raise UserError(f"no readable run under {root}: {notes[0]}"
                        + (f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""))
    if not runs:
        raise UserError(f"no runs under {root} (folders holding summary.json, model.json and "
                        "metrics.jsonl); run `fedavg sweep` or `fedavg simulate` first")
    return sorted(runs, key=lambda r: str(r.path)), notes


def read_run(folder: Path, notes: list[str] | None = None) -> Run:
    """Read one run folder (``summary.json`` and ``metrics.jsonl``; ``model.json`` is checked).

    A ``metrics.jsonl`` line that is not a round's record (cut short, edited) is left out,
    and ``notes`` gets a line naming it; of a round recorded twice, the last record counts.
    A ``model.json`` that is not a JSON object gets a line in ``notes`` too (the run's
    figures stand; its model cannot be loaded).

    Raises
    ------
    ValueError, KeyError, TypeError, OSError
        An unreadable ``summary.json`` or one without finite figures.
    """
    summary = json.loads((folder / "summary.json").read_text())
    if not isinstance(summary, dict):
        raise ValueError(f"its summary.json holds a {type(summary).__name__}, not a run's "
                         "summary (an object)")
    by_round, bad = {}, []
    for number, line in enumerate((folder / "metrics.jsonl").read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not (finite_number(row["accuracy"]) and 0 <= row["accuracy"] <= 1
                    and finite_number(row["round"]) and row["round"] == int(row["round"]) >= 1):
                raise ValueError(line)
            by_round[int(row["round"])] = row
        except (ValueError, KeyError, TypeError, AttributeError):
            bad.append(number)
    if bad and notes is not None:
        notes.append(f"{folder}: line(s) {', '.join(map(str, bad[:5]))} of its metrics.jsonl "
                     "are not round records; they are left out of its curve")
    for name, damage in (("model.json", _model_meta_damage(folder)),
                         ("model.safetensors", _model_file_damage(folder))):
        if damage and notes is not None:
            notes.append(f"{folder}: its {name} {damage}: its figures are reported, but its "
                         "model cannot be loaded (fedavg evaluate / predict)")
    rows = [by_round[r] for r in sorted(by_round)]
    accuracies = [summary["accuracy"], summary["best_accuracy"]]
    counts = [summary["rounds"], summary.get("num_nodes", 1)]
    if not (all(finite_number(v) and 0 <= v <= 1 for v in accuracies)
            and finite_number(summary["wall_s"])
            and all(finite_number(v) and v == int(v) >= 1 for v in counts)):
        raise ValueError("its summary.json holds an accuracy outside [0, 1], a time that is "
                         "not a finite number, or rounds or nodes that are not counts")
    settings = flat_settings(summary)
    if not all(v is None or finite_number(v)
               for v in (settings.get("alpha"), settings["num-nodes"])):
        raise ValueError("its summary.json's alpha or num-nodes is not a number")
    return Run(path=folder, settings=settings,
               accuracy=float(summary["accuracy"]),
               best_accuracy=float(summary["best_accuracy"]), rounds=int(summary["rounds"]),
               wall_s=float(summary["wall_s"]),
               curve=[(int(r["round"]), float(r["accuracy"])) for r in rows],
               round_walls=[float(r["wall_s"]) for r in rows[1:]  # not a start-up's round
                            if finite_number(r.get("wall_s")) and not r.get("resumed")],
               bytes_total=_bytes_total(summary), bytes_curve=_bytes_curve(rows),
               uplink_curve=_bytes_curve(rows, ("bytes_from_nodes",)),
               epsilon=_epsilon(summary))


def _epsilon(summary: dict[str, Any]) -> float | None:
    """Return the run's node-level DP epsilon from ``summary.json`` (``None``: no DP)."""
    privacy = summary.get("privacy")
    value = privacy.get("epsilon") if isinstance(privacy, dict) else None
    return float(value) if finite_number(value) else None


def _bytes_total(summary: dict[str, Any]) -> int | None:
    """Bytes sent both ways in the run, from ``summary.json`` (``None``: not counted)."""
    both = [summary.get("bytes_to_nodes"), summary.get("bytes_from_nodes")]
    return int(sum(both)) if all(finite_number(v) and v >= 0 for v in both) else None


def _bytes_curve(rows: list[dict[str, Any]],
                 ways: tuple[str, ...] = ("bytes_to_nodes", "bytes_from_nodes"),
                 ) -> list[tuple[int, float]]:
    """``(cumulative bytes of ways, accuracy)`` per round; empty if a round lacks a count."""
    curve, total = [], 0
    for row in rows:
        counts = [row.get(way) for way in ways]
        if not all(finite_number(v) and v >= 0 for v in counts):
            return []
        total += int(sum(counts))
        curve.append((total, float(row["accuracy"])))
    return curve


def _model_file_damage(folder: Path) -> str | None:
    """Say what is wrong with a run's ``model.safetensors``; ``None``: its header is whole.

    Reads the header alone (8 bytes of length, then JSON): the file must hold every byte
    its tensors' offsets name. Nothing is loaded.
    """
    path = folder / "model.safetensors"
    try:
        with open(path, "rb") as fh:
            size = path.stat().st_size
            length = int.from_bytes(fh.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError
            header = json.loads(fh.read(length))
        ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    except FileNotFoundError:
        return "is missing"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "is not a safetensors file (cut short or edited)"
    return "is cut short" if 8 + length + max(ends, default=0) > size else None


def _model_meta_damage(folder: Path) -> str | None:
    """Say what is wrong with a run's ``model.json`` (cut short, edited); ``None``: readable."""
    try:
        meta = json.loads((folder / "model.json").read_text())
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError
        return "is not JSON (cut short or edited)"
    return None if isinstance(meta, dict) else f"holds a {type(meta).__name__}, not an object"


def flat_settings(summary: dict[str, Any]) -> dict[str, Any]:
    """Flatten a ``summary.json``'s config to kebab-case settings, as the CLI names them.

    A setting the config lacks (a run made before it existed) is at its default.
    """
    flat: dict[str, Any] = dict(RunConfig().to_flat())
    config = summary.get("config") or {}
    for section in ("data", "train", "merge"):
        for key, value in (config.get(section) or {}).items():
            if key == "options":
                flat.update({k.replace("_", "-"): v for k, v in (value or {}).items()})
            elif key == "model_args":  # hidden=64,act=gelu, as sweep points name them
                flat["model-args"] = format_value(dict(value)) if value else None
            else:
                flat[key.replace("_", "-")] = value
    flat["model"] = summary.get("model", flat.get("model"))  # "auto" resolved
    flat["dataset"] = summary.get("dataset") or flat.get("dataset")  # a path made absolute
    flat["num-nodes"] = summary.get("num_nodes", flat.get("num-nodes"))
    flat.setdefault("strategy", summary.get("strategy"))
    node = node_settings_filled({k.replace("-", "_"): v for k, v in flat.items()},
                                flat["strategy"])  # what its nodes trained with
    flat.update({k.replace("_", "-"): v for k, v in node.items()})
    return flat


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Return the mean and the sample standard deviation (``None`` for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


@dataclass
class Group:
    """Runs identical but for ``seed``: one row of the table.

    Attributes
    ----------
    values : dict
        The group's value of each varying setting (``seed`` left out).
    runs : list of Run
    """

    values: dict[str, Any]
    runs: list[Run]

    @property
    def label(self) -> str:
        """``strategy=fedprox, alpha=0.1``, or ``all runs`` without varying settings.

        Unset values are left out; a path shows its last part (``dataset=cifar10``).
        """
        return ", ".join(f"{k}={_short(v)}" for k, v in self.values.items()
                         if v is not None) or "all runs"

    @property
    def seeds(self) -> list[Any]:
        """The seeds of the group's runs."""
        return [r.settings.get("seed") for r in self.runs]

    def stats(self, target: float) -> dict[str, Any]:
        """Mean and std of final / best accuracy and wall time; the target round's mean."""
        out: dict[str, Any] = {"n": len(self.runs)}
        for name in ("accuracy", "best_accuracy", "wall_s"):
            out[f"{name}_mean"], out[f"{name}_std"] = mean_std(
                [getattr(r, name) for r in self.runs])
        counted = [r.bytes_total for r in self.runs if r.bytes_total is not None]
        out["bytes_mean"] = statistics.fmean(counted) if counted else None
        reached = [r.target_round(target) for r in self.runs]
        reached = [r for r in reached if r is not None]
        out["target_round_mean"] = statistics.fmean(reached) if reached else None
        out["target_reached"] = len(reached)
        out["rounds"] = max(r.rounds for r in self.runs)
        round_s = [r.round_s for r in self.runs if r.round_s is not None]
        out["round_s_mean"] = statistics.fmean(round_s) if round_s else None
        epsilons = [r.epsilon for r in self.runs if r.epsilon is not None]
        out["epsilon_mean"] = statistics.fmean(epsilons) if epsilons else None
        return out


def group_runs(runs: list[Run], keys: list[str], over: tuple[str, ...] = ("seed",)
               ) -> list[Group]:
    """Group ``runs`` by every setting but ``over``; each group's values of ``keys``.

    Groups keep the order of their first run.
    """
    groups: dict[str, Group] = {}
    for run in runs:
        key = json.dumps({k: v for k, v in run.settings.items() if k not in over},
                         sort_keys=True)
        if key not in groups:
            groups[key] = Group({k: run.settings.get(k) for k in keys if k not in over}, [])
        groups[key].runs.append(run)
    return list(groups.values())


def _short(value: Any) -> str:
    text = cell(value)
    return Path(text).name if isinstance(value, str) and "/" in text else text


def cell(value: Any) -> str:
    """Return a setting's value as a table cell: ``true``, ``0.1``, empty for ``None``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "" if value is None else str(value)
