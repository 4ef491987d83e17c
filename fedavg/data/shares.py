"""A run's data as its nodes share it out: the merge data held out, then one partition a node.

The same on every machine: ``fedavg simulate``, the coordinator and a deployed node that
finds its own partition (``fedavg node --partition-id``) all split a dataset with this.
"""

from __future__ import annotations

import numpy as np

from fedavg.data.held_out import run_merge_data
from fedavg.data.load import LoadedData, Split
from fedavg.data.partition import partition


def share_out(config, strategy, data: LoadedData
              ) -> tuple[list[np.ndarray], Split | None, np.ndarray | None]:
    """Hold out the merge data the strategy needs, then partition the rest across the nodes.

    Parameters
    ----------
    config : fedavg.config.settings.RunConfig
        The run's settings: its partitioner, alpha, classes per node, seed, node count.
    strategy : strategies.Strategy
        The run's strategy (whether it needs validation data or unlabeled inputs).
    data : fedavg.data.load.LoadedData
        The run's data; its train split loses the slices held out.

    Returns
    -------
    tuple
        ``(parts, validation, distill_x)``: one index array into ``data.train`` per node,
        the validation ``Split`` or ``None``, ``(M, ...)`` unlabeled inputs or ``None``.

    Raises
    ------
    UserError
        Merge data that cannot be loaded, or a partitioning the data cannot take.
    """
    d = config.data
    validation, distill_x = run_merge_data(config, strategy, data)
    parts = partition(data.train.y, config.merge.num_nodes, d.partitioner, alpha=d.alpha,
                      classes_per_node=d.classes_per_node, groups=data.train.groups,
                      seed=d.seed)
    return parts, validation, distill_x
