"""Merge strategies: pure tensor math over state dicts, registered by name, no Flower import.

>>> import strategies
>>> merge = strategies.get("fedavg")
>>> merged = merge.merge([sd_a, sd_b], weights=[100, 300])   # doctest: +SKIP
"""

# Importing a strategy module registers it.
from strategies import ensemble as _ensemble  # noqa: E402,F401
from strategies import fedavg as _fedavg  # noqa: E402,F401
from strategies import fedopt as _fedopt  # noqa: E402,F401
from strategies import robust as _robust  # noqa: E402,F401
from strategies import soup as _soup  # noqa: E402,F401
from strategies.base import (
    MergeContext,
    Merged,
    MergeError,
    Option,
    StateDict,
    Strategy,
    UnknownOptionError,
    UnknownStrategyError,
    all_options,
    available,
    get,
    register,
    strategy_class,
)

__all__ = [
    "MergeContext",
    "MergeError",
    "Merged",
    "Option",
    "StateDict",
    "Strategy",
    "UnknownOptionError",
    "UnknownStrategyError",
    "all_options",
    "available",
    "get",
    "register",
    "strategy_class",
]
