"""The ``fedavg`` command line: typer commands, options generated from the settings."""
