"""The ``fedavg strategies`` and ``fedavg models`` commands: what a run can merge with and train.

(:mod:`fedavg.cli.app` adds them.)
"""

from __future__ import annotations

from rich.markup import escape

from fedavg.cli.support import console
from fedavg.config.values import format_value


def list_strategies() -> None:
    """List the merge strategies with their papers and options."""
    from rich.table import Table

    import strategies  # lazy: loads with its command: `fedavg --help` stays fast

    table = Table(show_lines=True)
    table.add_column("name", no_wrap=True)
    table.add_column("method, options (default) and paper", overflow="fold")
    for name, cls in strategies.available().items():
        options = "".join(f"\n  {o.flag} {o.default}: {o.help}"
                          + (f" ({' | '.join(o.choices)})" if o.choices else "")
                          for o in cls.options)
        nodes = "".join(f"\n  node default --{k.replace('_', '-')} {format_value(v)}"
                        for k, v in cls.node_defaults.items())
        table.add_row(name, f"{cls.description}{options}{nodes}\n[dim]{cls.paper}[/]")
    console.print(table)
    console.print("A strategy's node defaults apply unless you give the setting yourself.")
    console.print("Every strategy that is not one-shot also takes --swa-start R: from round R the "
                  "run saves the mean of the rounds' merged models (server-side SWA, Izmailov "
                  "et al. 2018, arXiv:1803.05407).")


def list_models() -> None:
    """List the built-in models and the forms that bring your own (--model, --model-arg)."""
    from rich.table import Table

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.models.registry import AUTO_CHOICE, available_models
    from fedavg.models.sources import FORMS

    table = Table()
    for column in ("name", "description"):
        table.add_column(column, overflow="fold")
    for name, desc in available_models().items():
        table.add_row(name, desc)
    table.add_row("auto", AUTO_CHOICE)
    console.print(table)
    console.print("Or bring your own with --model (and --model-arg KEY=VALUE, repeatable, for "
                  "any model's builder, e.g. --model mlp --model-arg hidden=64; kept in "
                  "model.json):", highlight=False)
    for form, desc in FORMS:
        console.print(f"  [bold]{form}[/]: {escape(desc)}", highlight=False)
