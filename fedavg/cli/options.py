"""Command-line options generated from their one declaration.

Run settings are declared once, as fields of :mod:`fedavg.config.settings` (each with its help), and
strategy options once, on their strategy (``strategies.Option``). :func:`with_settings` adds
them as typer options to a command written as ``def cmd(own options..., **settings)``; the
command then builds its :class:`~fedavg.config.settings.RunConfig` with ``RunConfig().replace(
**settings)``. So ``--alpha`` is the field ``DataConfig.alpha``, which
:func:`fedavg.run.lifecycle.prepare` hands to the partitioner as ``alpha``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer


def _option(name: str, kind: Any, default: Any, help: str) -> inspect.Parameter:
    # a bool is a plain flag (--save-node-models), with a --no-... twin only when it is on by
    # default (--error-feedback / --no-error-feedback); a path refuses ""
    flag = name.replace("_", "-")
    names = ((f"--{flag}/--no-{flag}",) if default is True else (f"--{flag}",)) \
        if kind is bool else ()
    option = path_option(*names, help=help) if kind in (Path, Optional[Path]) else \
        typer.Option(*names, help=help)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, option])


def _plain(hint: Any) -> Any:
    """``str | None`` as ``Optional[str]`` (what typer reads), others unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return Optional[args[0]] if len(args) == 1 and type(None) in typing.get_args(hint) else hint


def config_parameters(skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """One typer option per command-line field of the run config (defaults included)."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.config.settings import cli_fields

    return [_option(f.name, _plain(hint), f.default, f.metadata["help"])
            for f, hint in cli_fields() if f.name not in skip]


def declared_parameters(options: type) -> list[inspect.Parameter]:
    """One typer option per field of a declared options dataclass (type, default, help).

    ``options`` is, say, :class:`~fedavg.engines.deployment.node_options.NodeOptions`: each
    field declared with :func:`fedavg.config.settings.setting`.
    """
    hints = typing.get_type_hints(options)
    return [_option(f.name, _plain(hints[f.name]), f.default, f.metadata["help"])
            for f in dataclasses.fields(options)]


def with_options(command: Callable[..., Any], options: type) -> Callable[..., Any]:
    """Return ``command`` with the fields of ``options`` as its command-line options.

    ``command`` takes its own options as keywords, ``options`` (an instance of the declared
    dataclass, built from the command line) and, when wrapped by :func:`with_settings` too,
    the generated run settings in ``**settings``.
    """
    declared = declared_parameters(options)
    names = {p.name for p in declared}
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.name != "options" and p.kind is not inspect.Parameter.VAR_KEYWORD]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        chosen = options(**{k: kwargs.pop(k) for k in names if k in kwargs})
        return command(options=chosen, **kwargs)

    params = declared + own
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def strategy_parameters(merge: bool = False) -> list[inspect.Parameter]:
    """One typer option per strategy option of any registered strategy.

    Its default is ``None`` ("the strategy's own default", listed in the help); giving it
    to a strategy that does not declare it is an error (:meth:`RunConfig.build_strategy`).
    With ``merge``, only the options of the strategies that merge saved models (not those
    that change how nodes train or step from a round's start model,
    ``Strategy.merges_saved_models``).
    """
    import strategies  # lazy: loads with its command: `fedavg --help` stays fast

    params = []
    for name, declared in strategies.all_options(merge=merge).items():
        first = declared[0][1]
        defaults = ", ".join(f"{s} {o.default}" for s, o in declared)
        choices = f" (one of: {', '.join(first.choices)})" if first.choices else ""
        params.append(_option(name, Optional[first.type], None,
                              f"{first.help}{choices} (default: {defaults})"))
    return params


def tracking_parameters() -> list[inspect.Parameter]:
    """``--tensorboard DIR``, ``--mlflow`` and ``--mlflow-uri URI`` (see :func:`pop_tracking`)."""
    return [
        _option("tensorboard", Optional[Path], None,
                "Also write per-round scalars as TensorBoard event files under DIR"),
        _option("mlflow", bool, False, "Also log the run to MLflow (a local store in ./mlruns)"),
        _option("mlflow_uri", Optional[str], None, "Log to this MLflow tracking URI (implies "
                "--mlflow)"),
    ]


def pop_tracking(settings: dict[str, Any]):
    """Take the tracking options out of a command's ``settings``: a ``TrackingOptions``."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.run.tracking import TrackingOptions, default_mlflow_uri

    tensorboard = settings.pop("tensorboard", None)
    mlflow, uri = settings.pop("mlflow", False), settings.pop("mlflow_uri", None)
    return TrackingOptions(tensorboard, uri or (default_mlflow_uri() if mlflow else None))


def with_settings(command: Callable[..., None], *, skip: tuple[str, ...] = (),
                  config: bool = True, tracking: bool = False,
                  merge: bool = False) -> Callable[..., None]:
    """Return ``command`` with the config and strategy options added to its own, for typer.

    The run config's options are added unless ``config=False``; every strategy option is;
    with ``tracking``, :func:`tracking_parameters` too; with ``merge``, only the options of
    strategies that merge saved models. ``command`` takes its own options
    as keywords and the generated ones in ``**settings``.
    """
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in own}
    settings = [p for p in config_parameters(skip) if p.name not in names] if config else []
    params = settings + own + (tracking_parameters() if tracking else []) + \
        [p for p in strategy_parameters(merge) if p.name not in names]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        return command(**kwargs)

    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


#: ``--model-arg KEY=VALUE`` (repeatable), an own option of ``simulate`` and ``coordinator``.
ModelArgOption = Annotated[Optional[list[str]], typer.Option(
    "--model-arg", help="Argument of the model's builder, KEY=VALUE (VALUE read as JSON when "
    "it is a number, true, false or null); repeatable")]


def model_args(items: list[str] | None) -> dict[str, Any]:
    """Return the ``--model-arg`` items as the ``model_args`` setting (empty when none given).

    Raises
    ------
    fedavg.util.errors.UserError
        An item that is not ``KEY=VALUE`` (see :func:`fedavg.models.sources.parse_model_args`).
    """
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.models.sources import parse_model_args

    return {"model_args": parse_model_args(items)} if items else {}


def given(settings: dict[str, Any]) -> dict[str, Any]:
    """Return the ``settings`` the user gave on the command line (not left at their default).

    A resumed run (``--resume``) takes its settings from the checkpoint; only those given
    explicitly are compared with it.
    """
    import click
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return dict(settings)
    return {k: v for k, v in settings.items()
            if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}


def path(value: str) -> Path:
    """Return a path option's or argument's value as a path (help shows its type as PATH).

    An empty string (``--output ""``, an unset shell variable) is refused rather than read
    as the current folder.
    """
    if not str(value).strip():
        raise typer.BadParameter("needs a path, not an empty string")
    return Path(value)


def non_empty(value: str) -> str:
    """Return an input argument's value; an empty string (an unset shell variable) is refused.

    Read as a path, ``""`` would be the current folder.
    """
    if not str(value).strip():
        raise typer.BadParameter("needs a file, folder, dataset or text, not an empty string")
    return value


def path_option(*args: Any, **kwargs: Any) -> Any:
    """``typer.Option`` for a path: an empty value is a usage error (see :func:`path`)."""
    return typer.Option(*args, parser=path, **kwargs)


def path_argument(*args: Any, **kwargs: Any) -> Any:
    """``typer.Argument`` for a path: an empty value is a usage error."""
    return typer.Argument(*args, parser=path, **kwargs)


#: ``--model SPEC`` of the commands that load saved models (``evaluate``, ``predict``,
#: ``merge``): the user's consent to import a code model's code.
SavedModelCodeOption = Annotated[Optional[str], typer.Option(
    "--model", help="For a model built by your code: that code (FILE.py:FUNCTION, where the "
    "file is now, or MODULE:FUNCTION); fedavg imports no code a saved model names by itself")]
#: ``evaluate``'s input columns: default, as in training (or detected for another dataset).
ImageColumnOption = Annotated[Optional[str], typer.Option(help="Image (or feature) column")]
TextColumnOption = Annotated[Optional[str], typer.Option(help="Text column (a text model's)")]
