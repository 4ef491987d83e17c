"""Plan a sweep: what to do with each point, given what an earlier sweep left in its folder.

A point whose folder holds a ``summary.json`` for the same settings is skipped; a run without
one (stopped half-way) goes on from its last round (``--resume``) when its checkpoint reads
and holds the same settings, else runs again from scratch (``--overwrite``) when nothing of
it can be used; one that failed in an earlier sweep stays failed unless ``retry_failed``. A
point's folder holding a run with other settings (finished or stopped) is refused, never
replaced. :func:`check_points` tells, before anything runs, which points would fail;
:func:`select` keeps the points that ``--only`` names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fedavg.config.settings import RunConfig, node_settings_filled
from fedavg.data.load import data_settings, load
from fedavg.models.pretrained import has_own_tokenizer
from fedavg.run.lifecycle import prepare
from fedavg.run.output import RUN_FILES
from fedavg.sweeps.grid import Point, Sweep, effective_settings, format_value, name_part
from fedavg.util.errors import UserError

RECORD = "sweep.json"

#: What :func:`plan` decides for a point.
RUN, RERUN, RESUME, SKIP, KEEP_FAILED = "run", "rerun", "resume", "skip", "failed"
#: The actions that start a ``fedavg simulate``.
STARTS = (RUN, RERUN, RESUME)


@dataclass
class Planned:
    """A point and what the sweep does with it.

    ``action`` is ``run``, ``rerun``, ``resume``, ``skip`` or ``failed``; ``record`` holds
    what is known of the point (``round``: the last finished round, to resume after).
    """

    point: Point
    action: str
    record: dict[str, Any] = field(default_factory=dict)


def check_points(planned: list[Planned]) -> dict[str, str]:
    """Prepare each point that would start as its run would; return why those would fail.

    Each point's data is loaded, its merge data held out and its partitions and model built
    (:func:`fedavg.run.lifecycle.prepare`); points with the same data settings share one load,
    and one dataset is held at a time. Returns ``{point name: error line}`` for the points whose
    ``fedavg simulate`` would stop with that error before its first round.
    """

    def key(p: Planned) -> str:
        d, model = p.point.config.data, p.point.config.train.model
        own = model if has_own_tokenizer(model) else None  # tokenizes with its own
        return json.dumps([d.dataset, data_settings(d), own], sort_keys=True, default=str)

    problems = quick_problems(planned)
    held: dict[str, Any] = {}  # the data settings loaded now: their data, or the load's error
    for p in sorted((p for p in planned if p.action in STARTS
                     and p.point.name not in problems), key=key):
        d = p.point.config.data
        if key(p) not in held:
            held.clear()
            try:
                held[key(p)] = load(d.dataset, **p.point.config.data_settings())
            except UserError as exc:
                held[key(p)] = exc
        try:
            if isinstance(held[key(p)], UserError):
                raise held[key(p)]
            prepare(p.point.config, data=held[key(p)])
        except UserError as exc:
            problems[p.point.name] = str(exc)
    return problems


def quick_problems(planned: list[Planned]) -> dict[str, str]:
    """Return ``{point name: error line}`` for the points to start that would fail at once.

    From their settings alone, no data loaded: an unknown model or model arguments it
    cannot take (:func:`fedavg.models.registry.check_model_args`), and a device, cores or GPUs per
    node this machine cannot give (:func:`fedavg.engines.simulation.simulate.check_resources`).
    """
    # lazy: loads torch, which only this path needs
    from fedavg.engines.simulation.simulate import check_resources
    from fedavg.models.registry import check_model_args

    problems: dict[str, str] = {}
    known: dict[str, str | None] = {}  # each check's result, by its settings
    for p in (p for p in planned if p.action in STARTS):
        train, given = p.point.config.train, p.point.settings
        for check, args in ((check_model_args, (train.model, dict(train.model_args))),
                            (check_resources, (train.device, p.point.cpus_per_node,
                                               given.get("gpus-per-node")))):
            key = json.dumps([check.__name__, args], sort_keys=True, default=str)
            if key not in known:
                try:
                    known[key] = check(*args)
                except UserError as exc:
                    known[key] = str(exc)
            if known[key] and p.point.name not in problems:
                problems[p.point.name] = known[key]
    return problems


def plan(sweep: Sweep, out: Path, retry_failed: bool = False, move: bool = False,
         names: Iterable[str] = ()) -> list[Planned]:
    """Decide per point: run it, resume it, run it again from scratch, skip or keep it failed.

    A point without a folder whose run is in the folder of a point of the earlier sweep
    (``sweep.json``) that no point is named by now (a config edit renamed the points: a new
    varying key) takes that run: its record's ``renamed_from`` names the folder, which
    ``move`` renames to the point's (else it is read where it is).

    Parameters
    ----------
    sweep : Sweep
        The points.
    out : pathlib.Path
        The sweep's folder (``DIR``); point ``p`` runs in ``out / p.name``.
    retry_failed : bool
        Run the points an earlier sweep recorded as failed again.
    move : bool
        Rename the folders of renamed points' runs (the sweep holds the folder's lock).
    names : iterable of str
        The names of every point of the config, ``sweep`` being some of them (``--only``):
        their folders are never taken by another point.

    Raises
    ------
    UserError
        A point's folder is a file or holds a finished run with other settings.
    """
    earlier = {r.get("name"): r for r in read_record(out).get("points", [])}
    planned: list[Planned] = []
    taken = {point.name for point in sweep.points} | set(names)
    for point in sweep.points:
        folder = out / point.name
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            what = "a link to nowhere" if not folder.exists() else "a file"
            raise UserError(f"{folder} is {what} where point {point.name}'s run folder goes: "
                            "move it away or sweep into another --output")
        found = None if folder.exists() else _renamed(out, point, set(earlier) - taken)
        if found is not None:
            taken.add(found.name)
            if move:
                try:
                    found.rename(folder)
                except OSError as exc:
                    raise UserError(f"cannot rename {found} to {folder} (it holds the run "
                                    f"of point {point.name}): {exc.strerror}") from None
            else:
                folder = found  # read where it is: a dry run moves nothing
        _plan_point(planned, point, folder, earlier, retry_failed)
        if found is not None:
            planned[-1].record["renamed_from"] = found.name
    return planned


def _plan_point(planned: list[Planned], point: Point, folder: Path,
                earlier: dict[str, Any], retry_failed: bool) -> None:
    """Append what :func:`plan` does with ``point``, whose run is in ``folder``."""
    summary = read_json(folder / "summary.json")
    before = earlier.get(point.name, {})
    same = _plain(before.get("settings")) == _plain(point.settings)
    if summary is not None:
        wanted = _within_budget(point.config, summary.get("config"))  # its rounds cut
        problem = _difference(summary.get("config"), wanted.as_dict())
        done, other = _resumable(folder, point) if problem else (None, None)
        if done is not None and done < wanted.merge.rounds:  # `rounds` raised:
            planned.append(Planned(point, RESUME, {"round": done, "finished": True}))
            return  # train on from the last round
        if problem and done is None:  # (done: the same run, a path written otherwise)
            raise UserError(f"{folder} holds a finished run with other settings "
                            f"({problem}); remove it or sweep into another --output")
        wall = before.get("wall_s") if same else None
        planned.append(Planned(point, SKIP, {"wall_s": wall if wall is not None
                                             else summary.get("wall_s")}))
    elif same and before.get("status") == "failed" and not retry_failed:
        planned.append(Planned(point, KEEP_FAILED, {
            k: before.get(k) for k in ("exit_code", "error", "wall_s")}))
    else:
        started = folder.is_dir() and any((folder / f).exists() for f in RUN_FILES)
        done, other = _resumable(folder, point) if started else (None, None)
        if other:  # its finished rounds are not this point's: never thrown away
            raise UserError(f"{folder} holds a run stopped half-way with other settings "
                            f"({other}); remove it or sweep into another --output")
        planned.append(Planned(point, RESUME, {"round": done}) if done is not None
                       else Planned(point, RERUN if started else RUN))


def _renamed(out: Path, point: Point, old: set[str]) -> Path | None:
    """Return the folder, of the earlier sweep's points ``old``, holding ``point``'s run.

    Its ``summary.json`` records the point's settings, or its checkpoint can go on to the
    point (:func:`_resumable`: a path written otherwise, rounds raised, stopped half-way);
    ``None`` when there is none. A folder the sweep never made is never taken.
    """
    for folder in (out / name for name in sorted(old)):
        if folder.parent != out or folder.name in (".", "..") or folder.is_symlink() \
                or not folder.is_dir():
            continue
        summary = read_json(folder / "summary.json")
        if isinstance(summary, dict) and _difference(
                summary.get("config"),
                _within_budget(point.config, summary.get("config")).as_dict()) is None:
            return folder
        if (folder / "checkpoint.safetensors").is_file() and \
                _resumable(folder, point)[0] is not None:
            return folder
    return None


def _within_budget(config, recorded: Any = None):
    """Return ``config`` as its run records it: ``--rounds`` cut to ``--dp-epsilon``'s budget.

    A DP-SGD budget depends on the partitions' sizes, which the run alone knows: the rounds
    its summary records (``recorded``: its config), when not more than the point's, stand.
    """
    from fedavg.run import privacy  # lazy: loads torch, which only this path needs

    if config.train.dp_sgd and config.merge.dp_epsilon is not None:
        done = (recorded.get("merge") or {}).get("rounds") if isinstance(recorded, dict) \
            else None
        if isinstance(done, int) and 0 < done <= config.merge.rounds:
            return config.replace(rounds=done)
        return config
    try:
        return privacy.within_budget(config)[0]
    except UserError:  # no round fits: the point is refused when it runs
        return config


def _resumable(folder: Path, point: Point) -> tuple[int | None, str | None]:
    """Return ``(round, None)`` if the run in ``folder`` can go on to this point, else why not.

    It can when its checkpoint reads and holds this point's settings, ``rounds`` aside, and
    no more rounds than the point's are done: ``round`` is its last finished one. A
    checkpoint of other settings (or more rounds) gives ``(None, "what differs")``; none, or
    one that does not read, ``(None, None)`` (nothing of it can be used).
    """
    from fedavg.run import resume  # lazy: loads torch, which only this path needs

    try:
        ckpt = resume.load(folder)
        given = point.config.from_flat(resume.absolute_paths(point.config.to_flat()))
        had = ckpt.run_config()
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return None, None
    problem = _difference(had.replace(rounds=given.merge.rounds).as_dict(), given.as_dict())
    if problem is None and ckpt.round > given.merge.rounds:
        problem = f"{ckpt.round} rounds done there, {given.merge.rounds} here"
    return (ckpt.round, None) if problem is None else (None, problem)


def read_record(out: Path) -> dict[str, Any]:
    """Return ``out/sweep.json`` of an earlier sweep (``{}`` if none or unreadable).

    Its ``points`` are those of its records that are objects with a name (a list).
    """
    data = read_json(out / RECORD)
    if not isinstance(data, dict):
        return {}
    points = data.get("points") if isinstance(data.get("points"), list) else []
    return {**data, "points": [p for p in points if isinstance(p, dict)
                               and isinstance(p.get("name"), str)]}


def read_json(path: Path) -> Any:
    """Return the JSON in ``path``; ``None`` if it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _option_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Return a nested run config with its strategy's options and node settings defaulted.

    Where unset, as the run had them (:func:`~fedavg.config.settings.node_settings_filled`).
    """
    import strategies  # lazy: loads torch, which only this path needs

    merge = config.get("merge") if isinstance(config.get("merge"), dict) else {}
    given = merge.get("options") if isinstance(merge.get("options"), dict) else {}
    options = strategies.option_defaults(merge.get("strategy"))
    options.update({k: v for k, v in given.items() if v is not None})
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    train = {**train, **node_settings_filled(train, merge.get("strategy"))}
    return {**config, "train": train, "merge": {**merge, "options": options}}


def _difference(recorded: Any, wanted: dict[str, Any]) -> str | None:
    """Name the first settings that differ between two nested run configs, or ``None``.

    A setting the recorded config lacks (a run made before it existed) is at its default,
    and so is a strategy option (``mu = 0.01`` for ``fedprox`` is the run that leaves it out).
    """
    if not isinstance(recorded, dict):
        return "no settings recorded"
    defaults = _plain(RunConfig().as_dict())
    had = {s: {**d, **(recorded[s] if isinstance(recorded.get(s), dict) else {})}
           for s, d in defaults.items()}
    had, wanted = _option_defaults(_plain(had)), _option_defaults(_plain(wanted))
    diffs = []
    for section, values in wanted.items():
        there = had.get(section, {})
        for key, value in values.items():
            if there.get(key) != value:
                diffs.append(f"{key.replace('_', '-')} {format_value(there.get(key))} there, "
                             f"{format_value(value)} here")
    return "; ".join(diffs[:3]) or None


def select(spec: Sweep, only: list[str]) -> Sweep:
    """Keep the points whose settings match every ``KEY=VALUE`` of ``only``.

    A point's value of ``KEY`` is the one it runs with, given or default; ``VALUE`` is
    compared as written on a command line (:func:`format_value`) or in point names (a path's
    last part: ``dataset=cifar10``). Point names stay those of
    the whole sweep, so a later run of all the points finds these finished.

    Parameters
    ----------
    spec : Sweep
        The loaded sweep.
    only : list of str
        ``KEY=VALUE`` filters, all of which must match (``partitioner=dirichlet``).

    Returns
    -------
    Sweep
        ``spec`` with the matching points (all of them when ``only`` is empty).

    Raises
    ------
    UserError
        A filter without ``=``, a key that no point has, or no point matching them all.
    """
    points = list(spec.points)
    for item in only:
        key, sep, value = item.partition("=")
        key = key.strip().replace("_", "-")
        if not sep or not key:
            raise UserError(f"--only {item!r}: write KEY=VALUE, e.g. --only strategy=fedprox")
        values = [_point_value(p, key) for p in spec.points]
        if all(v is None for v in values):
            raise UserError(f"--only {item!r}: no point of {spec.path} sets {key!r}")
        points = [p for p in points if _matches(_point_value(p, key), value.strip())]
    if not points:
        raise UserError(f"--only {' '.join(only)}: no point of {spec.path} matches; "
                        "see them with --dry-run")
    return Sweep(spec.path, tuple(points), spec.varying)


def _point_value(point: Point, key: str) -> Any:
    return effective_settings(point.settings, point.config).get(key)


def _matches(value: Any, wanted: str) -> bool:
    """Whether ``wanted`` (a command-line text) names ``value``: ``2`` matches ``2.0``."""
    if value is None:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(wanted) == float(value)
        except ValueError:
            return False
    return wanted in (format_value(value), name_part(value))
