"""Experiment sweeps: TOML grids of runs, planned and run, and reports of finished runs."""
