"""A strategy's declared settings (:class:`Option`): one declaration, every interface."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One setting a strategy takes, declared once next to the code that uses it.

    The run config, the ``fedavg simulate`` / ``coordinator`` / ``merge`` options and the
    ``fedavg strategies`` table are all generated from these declarations.

    Attributes
    ----------
    name : str
        Python name (``server_lr``); on the command line ``--server-lr``.
    type : type
        ``float``, ``int`` or ``str``.
    default : object
        Value when the option is not given.
    help : str
        One line for ``--help``.
    choices : tuple of str
        Allowed values of a ``str`` option (empty: any).
    node_side : bool
        Used by the nodes while they train (Fisher's ``fisher_samples``): no option of a
        merge of saved models (``fedavg merge``).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    node_side: bool = False

    @property
    def flag(self) -> str:
        """The command-line spelling, ``--server-lr``."""
        return "--" + self.name.replace("_", "-")

    def convert(self, value: Any) -> Any:
        """Return ``value`` as this option's type.

        Raises
        ------
        ValueError
            Not convertible (``1.5`` for an int, a bool for a number), not finite, or not
            one of ``choices``.
        """
        wrong = ValueError(f"{self.flag} expects {self.type.__name__}, got {value!r}")
        if isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
            raise wrong
        try:
            out = self.type(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise wrong from None
        if self.type is int and isinstance(value, float) and value != out:
            raise wrong
        if self.type is float and not math.isfinite(out):
            raise ValueError(f"{self.flag} must be a finite number (got {value!r})")
        if self.choices and out not in self.choices:
            raise ValueError(f"{self.flag} must be one of {', '.join(self.choices)} "
                             f"(got {value!r})")
        return out


class UnknownOptionError(ValueError):
    """An option given to a strategy that does not declare it."""
