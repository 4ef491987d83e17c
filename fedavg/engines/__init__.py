"""The engines a run executes on: Flower's simulation (Ray) and deployment engines."""
