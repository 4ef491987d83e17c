"""What several test modules share: the CLI runner, a localhost cluster, a Docker engine."""
