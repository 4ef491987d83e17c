"""A run's lifecycle on either engine: prepare, the ServerApp, resume, artifacts, output."""
