"""Merge strategies: pure tensor math over state dicts, registered by name, no Flower import.

>>> import strategies
>>> merge = strategies.get("fedavg")
>>> merged = merge.merge([sd_a, sd_b], weights=[100, 300])   # doctest: +SKIP

Other installed packages add strategies through the ``fedavg.strategies`` entry-point group
(see :func:`strategies.base.load_plugins`).
"""

from strategies import dare as _dare  # noqa: F401  (importing a module registers it)
from strategies import diloco as _diloco  # noqa: F401
from strategies import ensemble as _ensemble  # noqa: F401
from strategies import fedavg as _fedavg  # noqa: F401
from strategies import feddyn as _feddyn  # noqa: F401
from strategies import fednova as _fednova  # noqa: F401
from strategies import fedopt as _fedopt  # noqa: F401
from strategies import fisher as _fisher  # noqa: F401
from strategies import moon as _moon  # noqa: F401
from strategies import robust as _robust  # noqa: F401
from strategies import scaffold as _scaffold  # noqa: F401
from strategies import soup as _soup  # noqa: F401
from strategies import task_arithmetic as _task_arithmetic  # noqa: F401
from strategies import ties as _ties  # noqa: F401
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
    check_compatible,
    first_non_finite,
    get,
    load_plugins,
    option_defaults,
    register,
    strategy_class,
    update_norm,
)
from strategies.local import NodeRule, NodeUpdate, node_rule
from strategies.tensors import clip_update

#: Entry-point group through which other installed packages add strategies.
ENTRY_POINT_GROUP = "fedavg.strategies"
load_plugins(ENTRY_POINT_GROUP)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MergeContext",
    "MergeError",
    "Merged",
    "NodeRule",
    "NodeUpdate",
    "Option",
    "StateDict",
    "Strategy",
    "UnknownOptionError",
    "UnknownStrategyError",
    "all_options",
    "available",
    "check_compatible",
    "clip_update",
    "first_non_finite",
    "get",
    "load_plugins",
    "node_rule",
    "option_defaults",
    "register",
    "strategy_class",
    "update_norm",
]
