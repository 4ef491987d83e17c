"""The values a setting accepts, declared beside it: a :class:`Rule` says what it needs.

A field of the settings declares its rule once (``setting(..., rule=at_least(1))``); the
run's checks (``--local-epochs must be >= 1 (got 0)``) and a node's checks of the round it
receives (``the round's 'local-epochs' must be >= 1 (got 0)``) both read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    """What a setting's value must be.

    Attributes
    ----------
    ok : callable
        ``ok(value) -> bool``; never raises for a value of the setting's type.
    need : str
        What it must be, completing "must be ...": ``>= 1``, ``in [0, 1)``.
    """

    ok: Callable[[Any], bool]
    need: str

    def problem(self, name: str, value: Any) -> str | None:
        """Return ``NAME must be NEED (got VALUE)`` for a value it refuses, else ``None``.

        ``None`` is a setting not given (its default applies), never refused.
        """
        if value is None or self.ok(value):
            return None
        shown = repr(value) if isinstance(value, str) else value
        return f"{name} must be {self.need} (got {shown})"


def at_least(low: int) -> Rule:
    """Accept an integer ``>= low``."""
    return Rule(lambda v: v >= low, f">= {low}")


def positive() -> Rule:
    """Accept a finite number ``> 0``."""
    return Rule(lambda v: 0 < v < math.inf, "> 0 and finite")


def non_negative() -> Rule:
    """Accept a finite number ``>= 0``."""
    return Rule(lambda v: 0 <= v < math.inf, ">= 0 and finite")


def fraction(*, closed_low: bool, closed_high: bool) -> Rule:
    """Accept a number from 0 to 1, each end in or out: ``in [0, 1)``, ``in (0, 1]``."""
    def ok(v: float) -> bool:
        return (0 <= v if closed_low else 0 < v) and (v <= 1 if closed_high else v < 1)

    return Rule(ok, f"in {'[' if closed_low else '('}0, 1{']' if closed_high else ')'}")


def one_of(choices: tuple[str, ...]) -> Rule:
    """Accept one of ``choices``."""
    return Rule(lambda v: v in choices, f"one of {', '.join(choices)}")


def first_problem(section: Any, name: Callable[[str], str] = lambda key: f"--{key}"
                  ) -> str | None:
    """Return the first value of a settings dataclass that its field's rule refuses.

    Said with ``name(kebab-key)``: ``--lr must be > 0 and finite (got 0)`` for the run,
    ``the round's 'lr' must be ...`` for a node. ``None`` when every value is accepted.
    """
    for f in fields(section):
        rule = f.metadata.get("rule")
        said = rule.problem(name(f.name.replace("_", "-")), getattr(section, f.name)) \
            if rule is not None else None
        if said:
            return said
    return None
