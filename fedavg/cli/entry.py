"""The ``fedavg`` console script.

Importing the CLI (torch, Flower) takes a second or two. A Ctrl-C or SIGTERM in that time
is held until the imports end (an interrupt raised inside torch's C++ import code can abort
the process), then it is one line and exit code 130, like one later, which the CLI's own
handler turns into a clean stop.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Import the CLI, then run it (:func:`fedavg.cli.app.main`)."""
    # lazy: the console script imports nothing before Ctrl-C is held
    from fedavg.util.interrupts import held_interrupts

    with held_interrupts(raise_after=False) as held:  # the commands install their own
        # lazy: imported while Ctrl-C is held (an import cut short leaves it broken)
        from fedavg.cli.app import main as cli_main

    if held:
        print("interrupted before the command started", file=sys.stderr)
        raise SystemExit(130)
    cli_main()
