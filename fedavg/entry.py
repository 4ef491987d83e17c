"""The ``fedavg`` console script.

Importing the CLI (torch, Flower) takes a second or two; a Ctrl-C or SIGTERM in that time is
one line and exit code 130, like one later, which the CLI's own handler turns into a clean stop.
"""

from __future__ import annotations

import signal
import sys


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    """Import the CLI, then run it (:func:`fedavg.cli.main`)."""
    previous = signal.signal(signal.SIGTERM, _terminated)  # until the CLI is imported
    try:
        from fedavg.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted before the command started", file=sys.stderr)
        raise SystemExit(130) from None
    signal.signal(signal.SIGTERM, previous)  # the commands that need one install their own
    cli_main()
