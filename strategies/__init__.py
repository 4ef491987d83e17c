"""Merge strategies: pure tensor math over state dicts, registered by name, no Flower import.

>>> import strategies
>>> merge = strategies.get("fedavg")
>>> merged = merge.merge([sd_a, sd_b], weights=[100, 300])   # doctest: +SKIP
"""

from strategies.base import (
    MergeError,
    Merged,
    StateDict,
    Strategy,
    UnknownStrategyError,
    available,
    get,
    register,
)

# Importing a strategy module registers it.
from strategies import fedavg as _fedavg  # noqa: E402,F401

__all__ = [
    "MergeError",
    "Merged",
    "StateDict",
    "Strategy",
    "UnknownStrategyError",
    "available",
    "get",
    "register",
]
