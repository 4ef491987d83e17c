"""Builder arguments: ``--model-arg KEY=VALUE`` parsing and checks against a signature."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fedavg.util.errors import UserError
from fedavg.util.errors import first_line as message_line

#: Arguments that describe the data, not the model: given to builders that take them.
DATA_ARGS = ("vocab_size", "pad_id")


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc`` (at most 240 characters).

    The message's line is :func:`fedavg.util.errors.first_line`'s (with the line a first line
    ending in ``:`` announces).
    """
    text = message_line(exc, 240) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:240] if text else type(exc).__name__


# --------------------------------------------------------------------------- arguments


def parse_model_args(items: Sequence[str] | None) -> dict[str, Any]:
    """Parse ``--model-arg KEY=VALUE`` options into builder arguments.

    ``VALUE`` is read as a JSON scalar when it is one (``64``, ``0.5``, ``true``, ``null``,
    ``"64"``), else kept as text (``relu``, ``[1, 2]``).

    Raises
    ------
    UserError
        An item without ``=``, a key that is not a Python identifier, or a key given twice.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"--model-arg takes KEY=VALUE with KEY a Python name, e.g. "
                            f"--model-arg hidden=64 (got {item!r})")
        if key in out:
            raise UserError(f"--model-arg {key} is given twice")
        out[key] = _scalar(raw)
    return out


def _scalar(raw: str) -> Any:
    def no_constant(name: str):
        raise ValueError(name)  # NaN, Infinity: kept as text

    try:
        value = json.loads(raw, parse_constant=no_constant)
    except ValueError:
        return raw
    return value if value is None or isinstance(value, (bool, int, float, str)) else raw


@dataclass(frozen=True)
class Takes:
    """The keyword arguments a builder takes.

    Attributes
    ----------
    names : tuple of str
        Arguments it takes by name.
    any : bool
        It takes ``**kwargs`` too.
    required : tuple of str
        Named arguments without a default.
    numeric : tuple of (str, number)
        Named arguments whose default is a number, with that default: a value given for
        them must be a number too.
    """

    names: tuple[str, ...]
    any: bool = False
    required: tuple[str, ...] = ()
    numeric: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, fn: Callable, what: str, positional: int = 2) -> Takes:
        """Read ``fn``'s signature; its first ``positional`` parameters are filled by fedavg.

        Raises
        ------
        UserError
            ``fn`` cannot take ``positional`` positional arguments.
        """
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return cls((), any=True)
        kinds = inspect.Parameter
        slots = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY,
                                                 kinds.POSITIONAL_OR_KEYWORD)]
        star = any(p.kind is kinds.VAR_POSITIONAL for p in params)
        if len(slots) < positional and not star:
            raise UserError(f"{what} must take (input_shape, num_classes, **args); its "
                            f"signature is {inspect.signature(fn)}")
        named = [p for p in slots[positional:] if p.kind is kinds.POSITIONAL_OR_KEYWORD]
        named += [p for p in params if p.kind is kinds.KEYWORD_ONLY]
        return cls(tuple(p.name for p in named),
                   any=any(p.kind is kinds.VAR_KEYWORD for p in params),
                   required=tuple(p.name for p in named if p.default is kinds.empty),
                   numeric=tuple((p.name, p.default) for p in named if _is_number(p.default)))

    def kwargs(self, what: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Return the keyword arguments to call the builder with.

        ``args`` are the user's arguments plus any :data:`DATA_ARGS`; the data arguments
        are kept only when the builder takes them.

        Raises
        ------
        UserError
            An argument the builder does not take (naming those it takes), or a required one
            missing.
        """
        user = {k: v for k, v in args.items() if k not in DATA_ARGS}
        unknown = [] if self.any else [k for k in user if k not in self.names]
        if unknown:
            takes = ", ".join(self.names) or "no arguments"
            raise UserError(f"{what} does not take argument {unknown[0]!r} (--model-arg "
                            f"{unknown[0]}=...); it takes: {takes}")
        out = {**user, **{k: v for k, v in args.items()
                          if k in DATA_ARGS and (self.any or k in self.names)}}
        for name, default in self.numeric:
            if name in user and not _is_number(user[name]):
                whole = "whole " if isinstance(default, int) else ""
                raise UserError(f"--model-arg {name}={user[name]!r} must be a {whole}number "
                                f"({what}'s default is {default})")
        missing = [k for k in self.required if k not in out]
        if missing:
            raise UserError(f"{what} needs argument {missing[0]!r}: pass --model-arg "
                            f"{missing[0]}=VALUE")
        return out


def _is_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
