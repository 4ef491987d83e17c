"""The ``fedavg`` console script.

Importing the CLI (torch, Flower) takes a second or two. A Ctrl-C or SIGTERM in that time
is held until the imports end (an interrupt raised inside torch's C++ import code can abort
the process), then it is one line and exit code 130, like one later, which the CLI's own
handler turns into a clean stop.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    """Import the CLI, then run it (:func:`fedavg.cli.main`)."""
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    from fedavg.cli import main as cli_main

    for sig, handler in previous.items():  # the commands that need one install their own
        signal.signal(sig, handler)
    if held:
        print("interrupted before the command started", file=sys.stderr)
        raise SystemExit(130)
    cli_main()
