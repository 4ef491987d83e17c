"""flwr-datasets' partitioners load without its plots, which still work when asked for."""

import subprocess
import sys


def test_a_partition_imports_no_plotting_library_and_the_plots_still_load():
    code = """
import sys
import numpy as np
from fedavg.data.partition import partition
parts = partition(np.arange(100) % 10, 4, "dirichlet", alpha=0.5, seed=0)
assert sum(len(p) for p in parts) == 100
print(sorted(m for m in ("matplotlib", "seaborn", "scipy.stats") if m in sys.modules))
import flwr_datasets
plot = flwr_datasets.visualization.plot_label_distributions
print(callable(plot), "matplotlib" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True", "True"], out.stdout
