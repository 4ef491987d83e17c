"""Published figures beside a report's own: ``fedavg report RUNS --published FILE``.

A published-figures file is TOML::

    source = "NIID-Bench (Li et al. 2022, arXiv:2102.02079) via Flower Baselines"
    metric = "best test accuracy"
    differences = ["our CIFAR-10 copy is JPEG-compressed", ...]

    [[figures]]
    dataset = "mnist"
    partitioner = "iid"
    strategy = "fedavg"
    num-nodes = 10
    best-accuracy = 0.9909

A figure belongs to every group of runs whose settings equal all of its settings (a path
matches by its last part, so ``dataset = "mnist"`` matches ``../shared/data/mnist``); its
``best-accuracy`` (a fraction) is shown beside the group's best test accuracy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedavg.config.settings import RunConfig
from fedavg.config.values import read_toml
from fedavg.util.errors import UserError


@dataclass
class Published:
    """Published figures, read by :func:`load_published`.

    Attributes
    ----------
    source : str
        Where the figures come from.
    metric : str
        What the figures are (``best test accuracy``).
    differences : list of str
        Settings in which the runs differ from the publication.
    figures : list of (dict, float)
        ``(settings, best accuracy as a fraction)`` pairs.
    """

    source: str
    metric: str = "best test accuracy"
    differences: list[str] = field(default_factory=list)
    figures: list[tuple[dict[str, Any], float]] = field(default_factory=list)

    def figure_for(self, settings: dict[str, Any]) -> float | None:
        """Return the figure whose settings all match ``settings`` (a run's), or ``None``."""
        for wanted, value in self.figures:
            if all(_same(settings.get(k), v) for k, v in wanted.items()):
                return value
        return None

    def unmatched(self, runs_settings: list[dict[str, Any]]) -> list[str]:
        """Describe the figures that no run matches."""
        return [", ".join(f"{k}={v}" for k, v in wanted.items())
                for wanted, _ in self.figures
                if not any(all(_same(s.get(k), v) for k, v in wanted.items())
                           for s in runs_settings)]


def _same(value: Any, wanted: Any) -> bool:
    if value == wanted:
        return True
    if isinstance(value, str) and isinstance(wanted, str):
        return Path(value.rstrip("/\\")).name == wanted
    return False


def known_settings() -> set[str]:
    """Return the kebab-case names of every run setting and strategy option."""
    import strategies  # lazy: loads torch, which only this path needs

    return set(RunConfig().to_flat()) | {k.replace("_", "-") for k in strategies.all_options()}


def valid_name(name: str) -> bool:
    """Whether ``name`` is a plain file stem: letters, digits and ``._+-``, no dot first."""
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", name) is not None


def load_published(path: str | Path) -> Published:
    """Read a published-figures file (see the module).

    Raises
    ------
    UserError
        One line: a missing or unreadable file, invalid TOML, no ``source``, a figure without
        settings or whose ``best-accuracy`` is not a fraction in (0, 1].
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--published {path} is a folder; give the TOML file of figures")
    raw = read_toml(path, "published figures")
    if not isinstance(raw.get("source"), str) or not raw["source"].strip():
        raise UserError(f"{path}: give source = \"...\" (where the figures come from)")
    differences = raw.get("differences", [])
    if not isinstance(differences, list) or not all(isinstance(d, str) for d in differences):
        raise UserError(f"{path}: differences must be a list of strings")
    out = Published(raw["source"], str(raw.get("metric", "best test accuracy")), differences)
    figures = raw.get("figures", [])
    if not isinstance(figures, list):
        raise UserError(f"{path}: figures must be tables, written [[figures]]")
    for i, table in enumerate(figures, start=1):
        if not isinstance(table, dict):
            raise UserError(f"{path}: figures must be tables, written [[figures]]")
        if "best-accuracy" not in table:
            raise UserError(f"{path}: [[figures]] {i} has no best-accuracy (a fraction)")
        value = table.get("best-accuracy")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or not 0 < value <= 1:
            raise UserError(f"{path}: [[figures]] {i}: best-accuracy must be a fraction in "
                            f"(0, 1], got {value!r}")
        wanted = {k.replace("_", "-"): v for k, v in table.items() if k != "best-accuracy"}
        if not wanted:
            raise UserError(f"{path}: [[figures]] {i} names no setting to match runs by")
        unknown = sorted(set(wanted) - known_settings())
        if unknown:
            raise UserError(f"{path}: [[figures]] {i}: {unknown[0]!r} is not a run setting "
                            "(use the names of `fedavg simulate` options, e.g. num-nodes)")
        out.figures.append((wanted, float(value)))
    if not out.figures:
        raise UserError(f"{path}: no [[figures]] tables")
    return out
