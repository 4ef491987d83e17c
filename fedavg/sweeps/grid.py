"""Experiment sweeps: a TOML grid of run settings, expanded into named points.

A sweep config holds a ``[base]`` table of run settings, a ``[grid]`` table of lists whose
cartesian product makes the points, and optionally ``[[points]]``, hand-picked combinations
(each a table of settings on top of ``[base]``, added to the grid's points)::

    [base]
    dataset = "digits"
    num-nodes = 3
    rounds = 2

    [grid]
    strategy = ["fedavg", "fedprox"]
    seed = [0, 1]

    [[points]]
    strategy = "fedadam"
    server-lr = 0.1

Settings are the options of ``fedavg simulate``, spelled as on its command line without the
dashes (``local-epochs``, strategy options such as ``mu`` included), exactly as
:meth:`fedavg.config.settings.RunConfig.from_flat` reads them; every point is validated before
anything runs. Each point is named from the settings that vary across the points only
(``strategy=fedprox_seed=1``), resources such as ``cpus-per-node`` left out; the same config
always gives the same names.
:mod:`fedavg.sweeps.runner` runs the points, one ``fedavg simulate`` process each.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedavg.config.setting_use import setting_applies
from fedavg.config.settings import SECTIONS, RunConfig, cli_fields
from fedavg.config.values import MODEL_ARGS, format_value, read_toml
from fedavg.util.errors import UserError

#: Options of ``fedavg simulate`` that are not run settings, with their defaults.
SIMULATE_OPTIONS: dict[str, float | None] = {"cpus-per-node": 1.0, "gpus-per-node": None}

#: Options the sweep sets itself for every point.
SWEEP_OWNED = ("output", "overwrite", "resume", "verbose")

#: The longest point name; longer ones are cut and end in a hash of their settings.
MAX_NAME = 120

_TABLES = ("base", "grid", "points")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True)
class Point:
    """One run of a sweep.

    Attributes
    ----------
    name : str
        Folder name, from the settings that vary across the sweep (``strategy=fedprox``).
    settings : dict
        Kebab-case settings given for this point (``[base]`` plus its own), converted to
        their types; what its ``fedavg simulate`` command line is made of.
    config : RunConfig
        The run settings, validated (what the run's ``summary.json`` records).
    """

    name: str
    settings: dict[str, Any]
    config: RunConfig

    def simulate_args(self) -> list[str]:
        """Return the ``fedavg simulate`` options for this point (no ``--output``)."""
        args = []
        for key, value in self.settings.items():
            if key == MODEL_ARGS:  # a table: one --model-arg NAME=JSON each
                args += [f"--model-arg={k}={json.dumps(v)}" for k, v in value.items()]
            elif isinstance(value, bool):
                if value:  # flags: --save-node-models
                    args.append(f"--{key}")
            else:  # --key=value: a value starting with "-" stays a value
                args.append(f"--{key}={format_value(value)}")
        return args

    @property
    def cpus_per_node(self) -> float:
        """CPU cores each simulated node of this point reserves."""
        return float(self.settings.get("cpus-per-node", SIMULATE_OPTIONS["cpus-per-node"]))


@dataclass(frozen=True)
class Sweep:
    """A parsed, validated sweep config.

    Attributes
    ----------
    path : pathlib.Path
        The TOML file.
    points : tuple of Point
        Grid points (in the grid's order, the last key fastest), then ``[[points]]``.
    varying : tuple of str
        The settings whose values differ across the points (those naming them).
    """

    path: Path
    points: tuple[Point, ...]
    varying: tuple[str, ...]

    def shared(self) -> dict[str, Any]:
        """Return the given settings that every point shares."""
        first = self.points[0].settings
        return {k: v for k, v in first.items() if k not in self.varying
                and all(p.settings.get(k) == v for p in self.points)}


def load_sweep(path: str | Path) -> Sweep:
    """Read, expand and validate a sweep config.

    Parameters
    ----------
    path : path
        A TOML file with ``[base]``, ``[grid]`` and/or ``[[points]]`` (see the module).

    Returns
    -------
    Sweep

    Raises
    ------
    UserError
        One line naming the file and the key: not TOML, an unknown table or setting, a
        value of the wrong type, a grid value that is not a non-empty list, no points at
        all, a point whose settings are invalid (:meth:`RunConfig.validate`, the strategy's
        own checks) or that repeats another point.
    """
    path = Path(path)
    raw = _read(path)
    base = _settings(path, "[base]", _table(path, raw, "base"))
    grid = _grid(path, _table(path, raw, "grid"), base)
    extra = raw.get("points", [])
    if not isinstance(extra, list) or not all(isinstance(p, dict) for p in extra):
        raise UserError(f"{path}: points must be tables, written [[points]]")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if not grid:
        combos = []
    settings = [{**base, **combo} for combo in combos]
    settings += [{**base, **_settings(path, f"[[points]] {i}", p)}
                 for i, p in enumerate(extra, start=1)]
    if not settings:
        raise UserError(f"{path}: no points: add a [grid] table of lists or [[points]] tables")
    configs = [_run_config(s) for s in settings]
    effective = [effective_settings(s, c) for s, c in zip(settings, configs)]
    named = [effective_settings(s, c, strategy_defaults=False)
             for s, c in zip(settings, configs)]
    varying = _varying(settings, named)
    names = point_names(named, [k for k in varying if k not in SIMULATE_OPTIONS])
    _validate(path, names, configs)
    points = [Point(name, s, config) for name, s, config in zip(names, settings, configs)]
    origins = [f"grid point {p.name}" for p in points[:len(combos)]]
    origins += [f"[[points]] entry {i} ({p.name})"
                for i, p in enumerate(points[len(combos):], start=1)]
    _no_repeats(path, origins, effective)
    return Sweep(path, tuple(points), tuple(varying))


def _read(path: Path) -> dict[str, Any]:
    raw = read_toml(path, "sweep config")
    unknown = [k for k in raw if k not in _TABLES]
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]!r} at the top; a sweep config has "
                        "[base], [grid] and [[points]] tables")
    return raw


def _table(path: Path, raw: dict[str, Any], name: str) -> dict[str, Any]:
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise UserError(f"{path}: {name} must be a table, written [{name}]")
    return table


def _grid(path: Path, grid: dict[str, Any], base: dict[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    _one_spelling(path, "[grid]", grid)
    for raw_key, values in grid.items():
        key = raw_key.replace("_", "-")
        if not isinstance(values, list):
            raise UserError(f"{path}: [grid] {raw_key} must be a list of values (got "
                            f"{values!r}); put a single value in [base]")
        if not values:
            raise UserError(f"{path}: [grid] {raw_key} is an empty list; give it at least "
                            "one value")
        if key in base:
            raise UserError(f"{path}: [grid] {raw_key} is also set in [base]; keep it in one "
                            "of them")
        converted = [_value(path, "[grid]", key, v) for v in values]
        if len({json.dumps(v) for v in converted}) != len(converted):
            raise UserError(f"{path}: [grid] {raw_key} lists a value twice")
        out[key] = converted
    return out


def _settings(path: Path, where: str, table: dict[str, Any]) -> dict[str, Any]:
    """Return a table's settings, kebab-case and converted; each key checked on its own."""
    _one_spelling(path, where, table)
    return {raw_key.replace("_", "-"): _value(path, where, raw_key.replace("_", "-"), value)
            for raw_key, value in table.items()}


def _one_spelling(path: Path, where: str, table: dict[str, Any]) -> None:
    """Refuse a setting written twice in one table (``num-nodes`` and ``num_nodes``)."""
    seen: dict[str, str] = {}
    for raw_key in table:
        key = raw_key.replace("_", "-")
        if key in seen:
            raise UserError(f"{path}: {where} sets {key} twice ({seen[key]} and {raw_key}); "
                            "keep one")
        seen[key] = raw_key


def _value(path: Path, where: str, key: str, value: Any) -> Any:
    """Return ``value`` converted to the type of setting ``key``, or raise naming both."""
    if key == MODEL_ARGS:
        return _model_args(path, where, value)
    if isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "a table"
        if where == "[grid]":
            raise UserError(f"{path}: [grid] {key} holds {kind}; each value in a grid list is "
                            "a single value")
        hint = "; put lists of values in [grid]" if where == "[base]" else ""
        raise UserError(f"{path}: {where} {key} is {kind}, not a single value{hint}")
    if not isinstance(value, (str, int, float, bool)):
        raise UserError(f"{path}: {where} {key} must be a string, number or boolean "
                        f"(got {value!r})")
    if key in SWEEP_OWNED:
        raise UserError(f"{path}: {where} {key}: the sweep sets --{key} itself for every "
                        "point; leave it out")
    if key in SIMULATE_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value < 0:
            raise UserError(f"{path}: {where} {key} expects a number >= 0, got {value!r}")
        return float(value)
    fields = _cli_types()
    if key not in fields and key not in _option_names():
        if key in _config_only():
            raise UserError(f"{path}: {where} {key} is not an option of `fedavg simulate`")
        try:
            RunConfig.from_flat({key: value})  # the unknown-key message, with known keys
        except UserError as exc:
            raise UserError(f"{path}: {where}: {exc}") from None
    if fields.get(key) is str and not isinstance(value, str):
        raise UserError(f"{path}: {where} {key} expects a string, got {value!r}")
    try:
        flat = RunConfig.from_flat({key: value}).to_flat()
    except UserError as exc:
        raise UserError(f"{path}: {where}: {exc}") from None
    return flat[key]


def _model_args(path: Path, where: str, value: Any) -> dict[str, Any]:
    """Return a ``model-args`` table (the builder's arguments), checked."""
    if not isinstance(value, dict):
        raise UserError(f"{path}: {where} {MODEL_ARGS} is a table of the model builder's "
                        f"arguments, e.g. {MODEL_ARGS} = {{hidden = 64}} (got {value!r})")
    for name, arg in value.items():  # names are checked with the run's settings
        if not isinstance(arg, (str, int, float, bool)):
            raise UserError(f"{path}: {where} {MODEL_ARGS}: {name} = {arg!r}; each argument "
                            "is a string, number or boolean")
    return dict(value)


def _cli_types() -> dict[str, Any]:
    """Return ``{kebab-case name: type}`` of the run settings ``fedavg simulate`` takes."""
    import typing

    out = {}
    for f, hint in cli_fields():
        if f.name != "options":
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            out[f.name.replace("_", "-")] = args[0] if args else hint
    return out


def _config_only() -> set[str]:
    """Return the config's run settings that have no ``fedavg simulate`` option."""
    from dataclasses import fields

    names = {f.name.replace("_", "-") for klass in SECTIONS.values() for f in fields(klass)}
    return names - set(_cli_types()) - {"options"}


def _option_names() -> set[str]:
    import strategies  # lazy: loads torch, which only this path needs

    return {name.replace("_", "-") for name in strategies.all_options()}


def _run_config(settings: dict[str, Any]) -> RunConfig:
    return RunConfig.from_flat({k: v for k, v in settings.items() if k not in SIMULATE_OPTIONS})


def effective_settings(settings: dict[str, Any], config: RunConfig,
                       strategy_defaults: bool = True) -> dict[str, Any]:
    """Return every setting's value for a point: given, or its default (None: unset).

    With ``strategy_defaults``, the point's strategy's options count with their defaults:
    ``mu = 0.01`` written out for ``fedprox`` is the run that leaves it out. (Point names
    leave them out, as they did before these counted.)
    """
    import strategies  # lazy: loads torch, which only this path needs

    out = {k: v for k, v in config.to_flat().items()}
    defaults = strategies.option_defaults(config.merge.strategy) if strategy_defaults else {}
    for name, default in defaults.items():
        out.setdefault(name.replace("_", "-"), default)
    if out.get(MODEL_ARGS) is not None:  # JSON text in the flat config
        out[MODEL_ARGS] = dict(config.train.model_args)
    out.update({k: settings.get(k, default) for k, default in SIMULATE_OPTIONS.items()})
    return out


def _varying(settings: list[dict[str, Any]], effective: list[dict[str, Any]]) -> list[str]:
    """Return the given keys (in order of first mention) whose effective values differ."""
    keys = list(dict.fromkeys(k for s in settings for k in s))
    return [k for k in keys if len({json.dumps(e.get(k)) for e in effective}) > 1]


def point_names(effective: list[dict[str, Any]], varying: list[str]) -> list[str]:
    """Return a folder name per point, from its values of the ``varying`` settings.

    ``key=value`` parts are joined by ``_``; characters other than letters, digits and
    ``.+-`` become ``-``; a path keeps its last part. Names that would collide, or run over
    :data:`MAX_NAME` characters, end in a hash of the point's settings. A point with no
    varying value set is ``base``.
    """
    names = []
    for e in effective:
        parts = [f"{key}={name_part(e[key])}" for key in varying if e.get(key) is not None]
        names.append("_".join(parts) or "base")
    counts = {n: names.count(n) for n in names}
    for i, (name, e) in enumerate(zip(names, effective)):
        if counts[name] > 1 or len(name) > MAX_NAME:
            digest = hashlib.sha1(json.dumps(e, sort_keys=True).encode()).hexdigest()[:8]
            names[i] = f"{name[:MAX_NAME]}_{digest}"
    return names


def name_part(value: Any) -> str:
    """Write ``value`` as a point name writes it (a path: its last part)."""
    text = format_value(value)
    if isinstance(value, str) and ("/" in text or "\\" in text):
        text = re.split(r"[/\\]", text.rstrip("/\\"))[-1] or text
    return _UNSAFE.sub("-", text) or "-"


def _validate(path: Path, names: list[str], configs: list[RunConfig]) -> None:
    """Raise one line naming every invalid point, grouped by what is wrong with it.

    A point whose ``--dp-epsilon`` allows no round is invalid too (as the run refuses it).
    """
    from fedavg.run import privacy  # lazy: loads torch, which only this path needs

    problems: dict[str, list[str]] = {}
    for name, config in zip(names, configs):
        try:
            config.validate()
            config.build_strategy()
            privacy.within_budget(config)
        except UserError as exc:
            problems.setdefault(str(exc), []).append(name)
    if not problems:
        return
    if len(problems) == 1 and len(next(iter(problems.values()))) == 1:
        (problem, (name,)), = problems.items()
        raise UserError(f"{path}: point {name}: {problem}")
    bad = sum(len(v) for v in problems.values())
    parts = []
    for problem, which in problems.items():
        shown = ", ".join(which[:3]) + (f" and {len(which) - 3} more" if len(which) > 3 else "")
        parts.append(f"{problem} (point{'s' if len(which) > 1 else ''} {shown})")
    raise UserError(f"{path}: {bad} of {len(names)} points are invalid: " + "; ".join(parts))


def _no_repeats(path: Path, origins: list[str], effective: list[dict[str, Any]]) -> None:
    """Refuse two points with the same settings, naming where each comes from."""
    seen: dict[str, str] = {}
    for origin, e in zip(origins, effective):
        key = json.dumps(e, sort_keys=True)
        if key in seen:
            raise UserError(f"{path}: {origin} has the same settings as {seen[key]}; remove "
                            "one of them")
        seen[key] = origin


def repeated_runs(points) -> dict[str, str]:
    """Map each sweep point that trains exactly as an earlier one to that one's name.

    Such points differ only in partition settings their partitioner ignores: a grid of
    ``partitioner = ["iid", "dirichlet"]`` and ``alpha = [0.1, 1.0]`` trains the iid run
    twice, with the same seed, and gets the same result.

    Parameters
    ----------
    points : sequence of fedavg.sweeps.grid.Point
        The sweep's points, in their order.
    """
    first: dict[str, str] = {}
    repeats = {}
    for point in points:
        settings = effective_settings(point.settings, point.config)
        shaping = {k: v for k, v in settings.items()
                   if setting_applies(k.replace("-", "_"), settings.get("partitioner"))}
        key = json.dumps(shaping, sort_keys=True, default=str)
        if key in first:
            repeats[point.name] = first[key]
        else:
            first[key] = point.name
    return repeats
