"""The reference pages of the docs site, generated from the code so they cannot drift.

``docs/gen_pages.py`` calls these at every ``mkdocs build``: the CLI reference walks the typer
app itself (every command, argument and option with its type, default and help), the strategy
reference reads the strategy registry (name, method, paper, options, node defaults) and the
model reference the model registry. A strategy or option added in code appears in the next
build with no hand edit.
"""

from __future__ import annotations

from typing import Any

import click
import typer

from fedavg.config.values import format_value


def _cell(text: Any) -> str:
    """``text`` fit for one Markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    return f"`{text}`" if str(text) else ""


def _default(param: click.Parameter) -> str:
    if getattr(param, "is_flag", False) or param.default is None or param.required:
        return ""
    default = param.default
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) if default else ""
    return _code(format_value(default) if isinstance(default, float) else default)


def _kind(param: click.Parameter) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    if isinstance(param.type, click.Choice):
        return " \\| ".join(_code(c) for c in param.type.choices)
    name = param.type.name.upper()
    return "PATH" if "PATH" in name else "TEXT" if name == "STRING" else name


def _param_rows(command: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if isinstance(param, click.Argument):
            names = _code(param.human_readable_name + ("..." if param.nargs == -1 else ""))
        else:
            names = ", ".join(_code(o) for o in param.opts + param.secondary_opts)
        help_text = getattr(param, "help", None) or ""
        rows.append(f"| {names} | {_kind(param)} | {_default(param)} | {_cell(help_text)} |")
    return rows


def _command_section(name: str, command: click.Command, parent: click.Context) -> list[str]:
    ctx = click.Context(command, info_name=name, parent=parent)
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"## `fedavg {name}`", "", (command.help or "").strip(), "", "```text", usage,
             "```", ""]
    rows = _param_rows(command, ctx)
    if rows:
        lines += ["| argument or option | type | default | what it does |",
                  "|---|---|---|---|", *rows, ""]
    return lines


def cli_markdown(app: typer.Typer) -> str:
    """Return the CLI reference page: one section per command of ``app``.

    Parameters
    ----------
    app : typer.Typer
        The ``fedavg`` app (:data:`fedavg.cli.app.app`, or one built by
        :func:`fedavg.cli.app.build_app` after registering a strategy).

    Returns
    -------
    str
        Markdown: each command's help, usage line and a table of its arguments and options
        (type, default, help), in the order ``fedavg --help`` lists them.
    """
    group = typer.main.get_command(app)
    root = click.Context(group, info_name="fedavg")
    lines = ["# Command line", "",
             "Generated from the `fedavg` command itself at every docs build: what "
             "`fedavg COMMAND --help` prints, every command on one page.", "",
             "```text", "fedavg [--version] COMMAND [OPTIONS] ...", "```", ""]
    for name in group.list_commands(root):
        lines += _command_section(name, group.get_command(root, name), root)
    return "\n".join(lines)


def _strategy_section(name: str, cls: type) -> list[str]:
    kind = "one-shot" if cls.one_shot else "over rounds"
    private = ("Node-level DP (`--dp-noise`): yes, its merge is a mean of the node updates."
               if cls.dp_mean else "Node-level DP (`--dp-noise`): refused (its merge is not "
               "a mean of the node updates).") + (
        " Record-level DP (`--dp-sgd`): yes." if cls.takes_dp_sgd() else
        " Record-level DP (`--dp-sgd`): refused (it changes local training or sends more "
        "than the model).")
    lines = [f"### `{name}`", "", f"{cls.description} ({kind}).", "", private, "",
             f"**Paper:** {cls.paper}" if cls.paper else "", ""]
    if cls.options:
        lines += ["| option | type | default | what it does |", "|---|---|---|---|"]
        for option in cls.options:
            choices = f" ({', '.join(option.choices)})" if option.choices else ""
            default = "" if option.default is None else _code(format_value(option.default))
            lines.append(f"| `{option.flag}` | {option.type.__name__} | {default} | "
                         f"{_cell(option.help + choices)} |")
        lines.append("")
    if cls.node_defaults:
        defaults = ", ".join(f"`--{k.replace('_', '-')} {format_value(v)}`"
                             for k, v in cls.node_defaults.items())
        lines += [f"Node defaults (applied unless you give the setting): {defaults}.", ""]
    return lines


def strategies_markdown() -> str:
    """Return the strategy reference page, from the strategy registry.

    Returns
    -------
    str
        Markdown: a summary table of every registered strategy (name, over rounds or
        one-shot, options, paper), then one section each with its options' types, defaults
        and help and its node defaults.
    """
    import strategies  # lazy: the registry with its plug-ins

    registry = strategies.available()
    lines = ["# Strategies", "",
             "Generated from the strategy registry at every docs build (what `fedavg "
             "strategies` lists). Pick one with `--strategy NAME`; its options go on the same "
             "command line. Every strategy that is not one-shot also takes `--swa-start R` "
             "(server-side SWA from round R).", "",
             "| name | kind | options | node-level DP | record-level DP | paper |",
             "|---|---|---|---|---|---|"]
    for name, cls in registry.items():
        options = ", ".join(f"`{o.flag}`" for o in cls.options)
        kind = "one-shot" if cls.one_shot else "rounds"
        dp = "yes" if cls.dp_mean else ""
        dp_sgd = "yes" if cls.takes_dp_sgd() else ""
        lines.append(f"| [`{name}`](#{name}) | {kind} | {options} | {dp} | {dp_sgd} | "
                     f"{_cell(cls.paper)} |")
    lines.append("")
    for name, cls in registry.items():
        lines += _strategy_section(name, cls)
    return "\n".join(lines)


def models_markdown() -> str:
    """Return the model reference page, from the model registry and the model sources.

    Returns
    -------
    str
        Markdown: every registered model name with its description, then the forms that
        bring a model of your own (``torchvision:NAME``, ``hf:PATH``, your builder).
    """
    from fedavg.models.registry import AUTO_CHOICE, available_models
    from fedavg.models.sources import FORMS

    lines = ["# Models", "",
             "Generated from the model registry at every docs build (what `fedavg models` "
             "lists). Pick one with `--model NAME`; `--model-arg KEY=VALUE` passes arguments "
             "to its builder.", "", "| `--model` | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(desc)} |" for name, desc in available_models().items()]
    lines += [f"| `auto` (default) | {AUTO_CHOICE} |", "",
              "## Models of your own", "", "| form | what it is |", "|---|---|"]
    lines += [f"| `{form}` | {_cell(desc)} |" for form, desc in FORMS]
    return "\n".join(lines) + "\n"
