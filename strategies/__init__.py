"""Merge strategies: pure tensor math over state dicts, registered by name, no Flower import.

>>> import strategies
>>> merge = strategies.get("fedavg")
>>> merged = merge.merge([sd_a, sd_b], weights=[100, 300])   # doctest: +SKIP
"""

from strategies.base import (
    MergeContext,
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
from strategies import ensemble as _ensemble  # noqa: E402,F401
from strategies import fedavg as _fedavg  # noqa: E402,F401
from strategies import fedopt as _fedopt  # noqa: E402,F401
from strategies import robust as _robust  # noqa: E402,F401
from strategies import soup as _soup  # noqa: E402,F401

__all__ = [
    "MergeContext",
    "MergeError",
    "Merged",
    "StateDict",
    "Strategy",
    "UnknownStrategyError",
    "available",
    "get",
    "register",
]
