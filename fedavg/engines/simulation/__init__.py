"""``fedavg simulate``: every node on one machine, on Flower's simulation engine (Ray backend)."""
