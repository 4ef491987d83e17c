"""``python -m fedavg.cli``: the ``fedavg`` command, as the console script runs it."""

from fedavg.cli.entry import main

main()
