"""MNIST FedAvg as a plain Flower app: the baseline of ``experiments/bench_overhead.py``."""
