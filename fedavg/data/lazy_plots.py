"""Import flwr-datasets' partitioners without its plotting subpackage.

``import flwr_datasets`` imports ``flwr_datasets.visualization``, which imports matplotlib,
seaborn and SciPy: about a second of every run's start, for plots fedavg never draws.
:func:`defer_flwr_datasets_plots` registers that subpackage as a module that runs its code
on first use, so ``flwr_datasets.visualization.plot_label_distributions`` still works.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

PLOTS = "flwr_datasets.visualization"


class _Deferred(types.ModuleType):
    """A package module whose code runs on the first look-up of a name it does not have."""

    def __getattr__(self, name: str):
        if name.startswith("__") or self.__dict__.get("_fedavg_loading"):
            raise AttributeError(name)
        self.__dict__["_fedavg_loading"] = True
        self.__spec__.loader.exec_module(self)
        return object.__getattribute__(self, name)


def defer_flwr_datasets_plots() -> None:
    """Before flwr_datasets is first imported, make its plotting subpackage load on use.

    Does nothing once flwr_datasets is imported, or where its files are not found.
    """
    if "flwr_datasets" in sys.modules or PLOTS in sys.modules:
        return
    spec = importlib.util.find_spec("flwr_datasets")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations))) / "visualization"
    plots = importlib.util.spec_from_file_location(PLOTS, folder / "__init__.py",
                                                   submodule_search_locations=[str(folder)])
    if plots is None or plots.loader is None or not folder.is_dir():
        return
    module = _Deferred(PLOTS)
    module.__spec__, module.__loader__, module.__file__ = plots, plots.loader, plots.origin
    module.__path__, module.__package__ = plots.submodule_search_locations, PLOTS
    sys.modules[PLOTS] = module
