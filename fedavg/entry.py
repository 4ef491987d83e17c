"""The ``fedavg`` console script.

Importing the CLI (torch, Flower) takes a second or two; a Ctrl-C in that time is one line
and exit code 130, like a Ctrl-C later, which the CLI's own handler turns into a clean stop.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Import the CLI, then run it (:func:`fedavg.cli.main`)."""
    try:
        from fedavg.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted before the command started", file=sys.stderr)
        raise SystemExit(130) from None
    cli_main()
