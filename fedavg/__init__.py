"""fedavg: train many, then merge.

Independent nodes each train a full copy of one model on their own data; a coordinator merges
the copies (FedAvg and its family over rounds, or one-shot merging: soups, ensembles,
distillation) into one saved model for prediction. Runs on Flower's simulation engine
(``fedavg simulate``) and deployment engine (``fedavg coordinator`` / ``fedavg node``).

Python API (the CLI is a thin layer over it)::

    import fedavg
    result = fedavg.simulate(dataset="digits", num_nodes=5, rounds=10, output="runs/demo")
    model = fedavg.load_model(result.model_dir)          # torch.nn.Module
    fedavg.evaluate_model("runs/demo")                   # {"accuracy": ..., "loss": ...}
    fedavg.predict("runs/demo", ["digit.png"])           # [{"prediction": "7", ...}]
"""

import functools
import logging
import time
from importlib import import_module
from typing import Any

# A library's loggers stay quiet unless the program configures logging: without a handler,
# Python's last-resort one printed fedavg's warnings on stderr, past simulate(console=None).
logging.getLogger("fedavg").addHandler(logging.NullHandler())

__version__ = "0.1.0"
#: ``time.monotonic()`` when fedavg was first imported: where the ``imports`` phase of a
#: run's start-up begins (``startup_s`` in ``summary.json``, :mod:`fedavg.util.timeline`).
IMPORTED_AT = time.monotonic()

_EXPORTS = {
    "simulate": "fedavg.engines.simulation.simulate",
    "RunResult": "fedavg.run.lifecycle",
    "load_model": "fedavg.use.inference",
    "evaluate_model": "fedavg.use.inference",
    "predict": "fedavg.use.inference",
    "merge_models": "fedavg.use.merge",
    "RunConfig": "fedavg.config.settings",
    "DataConfig": "fedavg.config.settings",
    "TrainConfig": "fedavg.config.settings",
    "MergeConfig": "fedavg.config.settings",
    "UserError": "fedavg.util.errors",
    "RunError": "fedavg.util.errors",
}

__all__ = sorted(_EXPORTS)


#: The functions whose errors name Python arguments (``mu``) instead of CLI flags (``--mu``).
_FUNCTIONS = ("simulate", "load_model", "evaluate_model", "predict", "merge_models")


def __getattr__(name: str) -> Any:
    # Lazy: `import fedavg` stays cheap; torch and flwr load on first use.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedavg' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    if name in _FUNCTIONS:
        value = globals()[name] = _python_errors(value)
    return value


def _python_errors(function):
    """Wrap ``function``: its ``UserError`` messages name Python arguments, not CLI flags."""
    from fedavg.util.errors import UserError, python_names  # lazy: `import fedavg` stays cheap

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError as exc:
            exc.args = (python_names(str(exc)),)
            raise

    return call
