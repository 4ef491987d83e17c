"""Strict conversion of setting values (from the CLI, TOML or Flower's run config) to types.

Used by :meth:`fedavg.config.settings.RunConfig.from_flat`: no silent truncation (``1.5`` is not an
``int``), no empty names, booleans only from their usual spellings, and ``model-args`` as
a JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from typing import Any, Mapping

from fedavg.util.errors import UserError

#: The flat key of the model's builder arguments (one JSON object in Flower's run config).
MODEL_ARGS = "model-args"


def finite_number(value: Any) -> bool:
    """Whether ``value`` (read from JSON) is a finite number: ``true`` is none, nor NaN or inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def format_value(value: Any) -> str:
    """Return a setting's value as written on a command line (``0.5``, ``true``, ``mnist``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):  # model-args
        return ",".join(f"{k}={format_value(v)}" for k, v in value.items())
    return str(value)


def convert(key: str, value: Any, f: dataclasses.Field, hint: Any) -> Any:
    """Return ``value`` as the field's type: strict (no silent truncation, no empty names)."""
    kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    optional = type(None) in typing.get_args(hint)
    if value is None or (isinstance(value, str) and not value.strip()):
        if optional:
            return None
        raise UserError(f"setting {key!r} needs a value (default: {f.default!r})")
    if kind is str and not isinstance(value, (str, os.PathLike, int, float)):
        named = (" (your own builder goes by name, 'file.py:function' or 'module:function')"
                 if callable(value) else "")  # a function or nn.Module class itself
        raise UserError(f"setting {key!r} expects a str (a name or path), got "
                        f"{type(value).__name__}{named}")
    try:
        if kind is bool:
            return _to_bool(value)
        if kind is int:
            return _to_int(value)
        if kind is float and isinstance(value, bool):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        raise UserError(f"setting {key!r} expects {kind.__name__}, got {shown}") from None


def model_args_value(value: Any) -> dict[str, Any]:
    """Return ``model-args`` as a dict: from JSON text (Flower's run config) or a mapping."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"setting {MODEL_ARGS!r} must be a JSON object, got {value[:60]!r}") \
                from None
    if not isinstance(value, Mapping):
        raise UserError(f"setting {MODEL_ARGS!r} must be a JSON object of builder arguments, "
                        f"got {type(value).__name__}")
    try:
        json.dumps(dict(value))
    except (TypeError, ValueError):
        raise UserError(f"setting {MODEL_ARGS!r} must hold JSON values") from None
    return dict(value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(value)
        return value.lower() in ("true", "1", "yes")
    if value not in (True, False, 0, 1):
        raise ValueError(value)
    return bool(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(value)
    return int(value)


def convert_option(option, value: Any) -> Any:
    """Return ``value`` converted by a strategy ``option``; its ValueError as a UserError."""
    try:
        return option.convert(value)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def read_toml(path, what: str) -> dict[str, Any]:
    """Read a TOML file; a missing, unreadable or invalid one is a one-line error.

    Parameters
    ----------
    path : pathlib.Path
        The file.
    what : str
        What it is, for messages (``sweep config``, ``published figures``).

    Raises
    ------
    UserError
        The file is missing, unreadable, not UTF-8 or not TOML.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {what} {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path} is not valid TOML: {str(exc).splitlines()[0]}") from None


def unknown_setting(key: str, known: list[str]) -> str:
    """Say that setting ``key`` is unknown: the closest known one(s), then all of them."""
    import difflib

    close = difflib.get_close_matches(key.replace("_", "-"), known, n=2, cutoff=0.6)
    guess = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
    return f"unknown setting {key!r}{guess}; known: {', '.join(sorted(known))}"
