"""Deterministic partitioning of a dataset across nodes, through flwr-datasets partitioners.

``partition(labels, num_partitions, scheme, ...)`` returns one sorted index array per node;
the same arguments always give the same partitions (on any machine), so a coordinator and a
node that partition independently agree.
"""

from __future__ import annotations

import warnings

import numpy as np

from fedavg.errors import UserError


def partition(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str = "iid",
    *,
    alpha: float = 0.5,
    classes_per_node: int = 2,
    groups: np.ndarray | None = None,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split sample indices ``0..N-1`` into ``num_partitions`` disjoint, covering parts.

    Parameters
    ----------
    labels : numpy.ndarray
        ``(N,)`` integer class labels.
    num_partitions : int
        Number of nodes.
    scheme : str
        ``iid`` (:class:`flwr_datasets.partitioner.IidPartitioner` on a seeded shuffle),
        ``dirichlet`` (label skew, Hsu et al. 2019, arXiv:1909.06335, via
        ``DirichletPartitioner``), ``pathological`` (``classes_per_node`` labels per node,
        McMahan et al. 2017, via ``PathologicalPartitioner``) or ``natural`` (one node per
        distinct value of ``groups``, via ``NaturalIdPartitioner``).
    alpha : float
        Dirichlet concentration, > 0.
    classes_per_node : int
        Labels per node for ``pathological``.
    groups : numpy.ndarray, optional
        ``(N,)`` natural node ids, required for ``natural``.
    seed : int
        Seed of every random choice.

    Returns
    -------
    list of numpy.ndarray
        ``num_partitions`` sorted ``int64`` index arrays. ``iid``, ``dirichlet`` and
        ``natural`` cover all samples; ``pathological`` may leave out samples of labels no
        node was given.

    Raises
    ------
    UserError
        More nodes than samples, ``alpha <= 0``, a partition that would be empty, a
        ``natural`` split whose number of ids differs from ``num_partitions``.
    """
    import datasets
    from flwr_datasets import partitioner as fp

    datasets.disable_progress_bars()
    n = len(labels)
    if num_partitions < 1:
        raise UserError(f"--num-nodes must be >= 1 (got {num_partitions})")
    if num_partitions > n:
        raise UserError(
            f"{num_partitions} nodes but only {n} training samples: use --num-nodes <= {n}"
        )
    columns = {"label": np.asarray(labels, dtype=np.int64), "index": np.arange(n)}
    if scheme == "iid":
        p = fp.IidPartitioner(num_partitions=num_partitions)
    elif scheme == "dirichlet":
        if not alpha > 0:
            raise UserError(f"--alpha must be > 0 (got {alpha})")
        p = fp.DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=1,
            self_balancing=False,
            seed=seed,
        )
    elif scheme == "pathological":
        num_classes = len(np.unique(labels))
        if classes_per_node > num_classes:
            raise UserError(
                f"--classes-per-node {classes_per_node} exceeds the {num_classes} labels present"
            )
        p = fp.PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=classes_per_node,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    elif scheme == "natural":
        if groups is None:
            raise UserError("--partitioner natural needs --partition-by COLUMN")
        empty = int(np.isin(np.asarray(groups).astype(str), ["None", "nan", ""]).sum())
        if empty:
            raise UserError(f"the --partition-by column has {empty} empty value(s): fill or "
                            "drop those rows")
        distinct = len(np.unique(groups))
        if distinct != num_partitions:
            raise UserError(
                f"the --partition-by column has {distinct} distinct values: "
                f"use --num-nodes {distinct} with --partitioner natural"
            )
        columns["group"] = np.asarray(groups).astype(str)
        p = fp.NaturalIdPartitioner(partition_by="group")
    else:
        raise UserError(
            f"unknown partitioner {scheme!r}; choose iid, dirichlet, pathological or natural"
        )
    ds = datasets.Dataset.from_dict(columns)
    if scheme == "iid":
        ds = ds.shuffle(seed=seed).flatten_indices()
    p.dataset = ds
    parts = []
    try:
        with warnings.catch_warnings():  # their retry warnings would bury our one-line error
            warnings.simplefilter("ignore")
            for i in range(num_partitions):
                idx = np.sort(np.asarray(p.load_partition(i)["index"], dtype=np.int64))
                parts.append(idx)
    except ValueError as exc:  # DirichletPartitioner gives up after 10 tries
        raise UserError(
            f"cannot split {n} samples into {num_partitions} non-empty {scheme} partitions "
            f"({str(exc).splitlines()[0][:160]}); use fewer nodes or a larger --alpha"
        ) from None
    empty = [i for i, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise UserError(
            f"{scheme} partitioning left node(s) {empty[:5]} with no samples; "
            "use fewer --num-nodes" + (" or a larger --alpha" if scheme == "dirichlet" else "")
        )
    return parts


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-node label histogram, ``(num_partitions, num_classes)`` sample counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])
