"""Deterministic partitioning of a dataset across nodes: a registry of partitioners by name.

``partition(labels, num_partitions, scheme, ...)`` returns one sorted index array per node;
the same arguments always give the same partitions (on any machine), so a coordinator and a
node that partition independently agree.

Each scheme is a small function registered with :func:`register_partitioner` that wraps one
flwr-datasets partitioner (``natural`` groups its ids itself, :func:`group_values`). Its
keyword-only parameters carry the config names
(``DataConfig.alpha`` / ``--alpha`` is the ``alpha`` of :func:`dirichlet`), and
:func:`partition` passes each partitioner exactly the parameters it declares.

>>> from fedavg.data.partition import partitioner_names, get_partitioner
>>> partitioner_names()
('iid', 'dirichlet', 'pathological', 'natural')
>>> get_partitioner("dirichlet").params
('alpha', 'seed')
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fedavg.data.lazy_plots import defer_flwr_datasets_plots
from fedavg.util.errors import UserError

PARAMETERS = ("alpha", "classes_per_node", "groups", "seed")
"""Config names a partitioner may declare: the keyword arguments of :func:`partition`."""


@dataclass(frozen=True)
class PartitionerSpec:
    """A registered partitioner.

    Attributes
    ----------
    name : str
        Registered name (``DataConfig.partitioner``, ``--partitioner``).
    description : str
        One line for tables and ``--help``.
    paper : str
        Source of the method (authors, year, arXiv id), or ``""``.
    build : callable
        ``(labels, num_partitions, **params) -> partitioner``: a
        ``flwr_datasets.partitioner.Partitioner`` whose ``dataset`` (columns ``label``,
        ``index``, ...) is already set, or any object whose ``load_partition(i)["index"]``
        gives node ``i``'s sample indices.
    params : tuple of str
        The config names ``build`` takes, a subset of :data:`PARAMETERS`.
    remedy : str
        Extra advice when a node ends up empty (e.g. ``"a larger --alpha"``).
    """

    name: str
    description: str
    paper: str
    build: Callable[..., Any]
    params: tuple[str, ...]
    remedy: str = ""


_REGISTRY: dict[str, PartitionerSpec] = {}


def register_partitioner(name: str, description: str, *, paper: str = "", remedy: str = ""):
    """Register ``fn(labels, num_partitions, *, <params>)`` under ``name`` (a decorator).

    Parameters
    ----------
    name : str
        Name users pass as ``--partitioner``.
    description : str
        One-line description.
    paper : str
        Citation of the method, with its arXiv id.
    remedy : str
        Advice besides fewer ``--num-nodes`` when a node would be empty.

    Raises
    ------
    ValueError
        ``fn`` declares a keyword-only parameter that is not in :data:`PARAMETERS`.
    """

    def deco(fn):
        params = tuple(p.name for p in inspect.signature(fn).parameters.values()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY)
        unknown = [p for p in params if p not in PARAMETERS]
        if unknown:
            raise ValueError(f"partitioner {name!r} declares {unknown}; parameters must be "
                             f"among {', '.join(PARAMETERS)}")
        _REGISTRY[name] = PartitionerSpec(name, description, paper, fn, params, remedy)
        return fn

    return deco


def partitioner_names() -> tuple[str, ...]:
    """Return the registered partitioner names, in registration order (``iid`` first)."""
    return tuple(_REGISTRY)


def available_partitioners() -> dict[str, str]:
    """Return ``{name: one-line description}`` of the registered partitioners, in order."""
    return {name: spec.description for name, spec in _REGISTRY.items()}


def get_partitioner(name: str) -> PartitionerSpec:
    """Return the partitioner registered as ``name``.

    Raises
    ------
    UserError
        Unknown name, with the list of known names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        *rest, last = partitioner_names()
        raise UserError(
            f"unknown partitioner {name!r}; choose {', '.join(rest)} or {last}"
        ) from None


def _table(labels: np.ndarray, **extra: np.ndarray):
    """Build a ``datasets.Dataset`` of ``label`` (int64), ``index`` (0..N-1) and ``extra``."""
    import datasets

    columns = {"label": np.asarray(labels, dtype=np.int64), "index": np.arange(len(labels))}
    return datasets.Dataset.from_dict({**columns, **extra})


@register_partitioner("iid", "uniform random split into near-equal sizes")
def iid(labels: np.ndarray, num_partitions: int, *, seed: int):
    """Shuffle with ``seed``, then cut into ``num_partitions`` contiguous near-equal shards.

    Wraps :class:`flwr_datasets.partitioner.IidPartitioner`; sizes differ by at most one.
    """
    defer_flwr_datasets_plots()
    from flwr_datasets.partitioner import IidPartitioner

    p = IidPartitioner(num_partitions=num_partitions)
    p.dataset = _table(labels).shuffle(seed=seed).flatten_indices()
    return p


@register_partitioner("dirichlet", "label skew: each node's label shares drawn from Dir(alpha)",
                      paper="Hsu et al. 2019, arXiv:1909.06335", remedy="a larger --alpha")
def dirichlet(labels: np.ndarray, num_partitions: int, *, alpha: float, seed: int):
    """Split each label's samples across nodes in proportions drawn from ``Dir(alpha)``.

    Wraps :class:`flwr_datasets.partitioner.DirichletPartitioner` (no self-balancing, every
    node at least one sample). Smaller ``alpha`` gives more skewed nodes.

    Raises
    ------
    UserError
        ``alpha <= 0``.

    References
    ----------
    Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
    Federated Visual Classification", 2019, arXiv:1909.06335.
    """
    defer_flwr_datasets_plots()
    from flwr_datasets.partitioner import DirichletPartitioner

    if not alpha > 0:
        raise UserError(f"--alpha must be > 0 (got {alpha})")
    p = DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=alpha,
        min_partition_size=1,
        self_balancing=False,
        seed=seed,
    )
    p.dataset = _table(labels)
    return p


@register_partitioner("pathological", "each node holds classes_per_node labels only",
                      paper="McMahan et al. 2017, arXiv:1602.05629",
                      remedy="a smaller --classes-per-node")
def pathological(labels: np.ndarray, num_partitions: int, *, classes_per_node: int, seed: int):
    """Give each node ``classes_per_node`` labels and split each label among its nodes.

    Wraps :class:`flwr_datasets.partitioner.PathologicalPartitioner` in its
    ``first-deterministic`` mode: node ``i`` gets label ``i`` (mod the number of labels)
    first, the others at random with ``seed``. Samples of labels no node got are left out.

    Raises
    ------
    UserError
        ``classes_per_node`` below 1 or above the number of distinct labels.

    References
    ----------
    McMahan, Moore, Ramage, Hampson and Agüera y Arcas, "Communication-Efficient Learning of
    Deep Networks from Decentralized Data", AISTATS 2017, arXiv:1602.05629.
    """
    defer_flwr_datasets_plots()
    from flwr_datasets.partitioner import PathologicalPartitioner

    num_classes = len(np.unique(labels))
    if classes_per_node < 1:
        raise UserError(f"--classes-per-node must be >= 1 (got {classes_per_node})")
    if classes_per_node > num_classes:
        raise UserError(
            f"--classes-per-node {classes_per_node} exceeds the {num_classes} labels present"
        )
    p = PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_classes_per_partition=classes_per_node,
        class_assignment_mode="first-deterministic",
        seed=seed,
    )
    p.dataset = _table(labels)
    return p


@register_partitioner("natural", "each --partition-by value (writer, user, site) on one "
                      "node, grouped to fit --num-nodes")
def natural(labels: np.ndarray, num_partitions: int, *, groups: np.ndarray | None):
    """Keep each natural id (writer, user, site) on one node; group ids when they outnumber nodes.

    :func:`group_values` assigns the distinct values of ``groups`` to ``num_partitions``
    nodes (one value per node when their numbers match: node ``i`` the ``i``-th value in
    sorted order). The grouping is computed here rather than by flwr-datasets'
    ``NaturalIdPartitioner``, which gives one node per value only (and draws a progress bar).

    Raises
    ------
    UserError
        No ``groups``, empty values among them, or fewer distinct values than
        ``num_partitions``.
    """
    if groups is None:
        raise UserError("--partitioner natural needs --partition-by COLUMN")
    values = np.asarray(groups).astype(str)
    empty = int(np.isin(values, ["None", "nan", ""]).sum())
    if empty:
        raise UserError(f"the --partition-by column has {empty} empty value(s): fill or "
                        "drop those rows")
    distinct, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    if len(distinct) < num_partitions:
        raise UserError(
            f"the --partition-by column has {len(distinct)} distinct values, fewer than "
            f"--num-nodes {num_partitions}: use --num-nodes {len(distinct)} or fewer"
        )
    return _Assigned(group_values(counts, num_partitions)[inverse.reshape(-1)])


def group_values(counts: np.ndarray, num_nodes: int) -> np.ndarray:
    """Assign natural ids to nodes: greedy balancing of sample counts, largest id first.

    Ids are taken by decreasing ``counts`` (ties: lower id first) and each goes to the node
    holding the fewest samples so far (ties: lower node). Nodes are then numbered by the
    lowest id they hold, so with as many ids as nodes node ``i`` holds id ``i``. No
    randomness: the same counts always give the same grouping.

    Parameters
    ----------
    counts : numpy.ndarray
        ``(V,)`` positive sample counts of ids ``0..V-1`` (the sorted distinct values).
    num_nodes : int
        Number of nodes, ``1 <= num_nodes <= V``.

    Returns
    -------
    numpy.ndarray
        ``(V,)`` ``int64`` node of each id; every node gets at least one id.

    Examples
    --------
    >>> group_values(np.array([1, 4, 2]), 2).tolist()  # id 1 alone; ids 0 and 2 together
    [0, 1, 0]
    """
    counts = np.asarray(counts, dtype=np.int64)
    load = np.zeros(num_nodes, dtype=np.int64)
    node = np.empty(len(counts), dtype=np.int64)
    for value in np.lexsort((np.arange(len(counts)), -counts)):
        node[value] = int(np.argmin(load))  # argmin: the lowest of equally loaded nodes
        load[node[value]] += counts[value]
    first_id = np.full(num_nodes, len(counts))
    np.minimum.at(first_id, node, np.arange(len(counts)))
    renumber = np.empty(num_nodes, dtype=np.int64)
    renumber[np.argsort(first_id, kind="stable")] = np.arange(num_nodes)
    return renumber[node]


class _Assigned:
    """Partitions given as one node per sample: ``load_partition(i)["index"]``, like flwr's."""

    def __init__(self, node_of_sample: np.ndarray) -> None:
        self.node_of_sample = node_of_sample

    def load_partition(self, partition_id: int) -> dict[str, np.ndarray]:
        return {"index": np.flatnonzero(self.node_of_sample == partition_id)}


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
    """Split sample indices ``0..N-1`` into ``num_partitions`` disjoint parts.

    Parameters
    ----------
    labels : numpy.ndarray
        ``(N,)`` integer class labels.
    num_partitions : int
        Number of nodes.
    scheme : str
        A registered partitioner (:func:`available_partitioners`): ``iid`` (seeded shuffle,
        near-equal sizes), ``dirichlet`` (label skew, Hsu et al. 2019, arXiv:1909.06335),
        ``pathological`` (``classes_per_node`` labels per node, McMahan et al. 2017,
        arXiv:1602.05629) or ``natural`` (each distinct value of ``groups`` on one node,
        values grouped by :func:`group_values` when they outnumber the nodes).
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
        Fewer than one node or more nodes than samples, an unknown scheme, a parameter the
        scheme refuses (``alpha <= 0``, ...), a partition that would be empty.
    """
    import datasets

    datasets.disable_progress_bars()
    n = len(labels)
    if num_partitions < 1:
        raise UserError(f"--num-nodes must be >= 1 (got {num_partitions})")
    if num_partitions > n:
        raise UserError(
            f"{num_partitions} nodes but only {n} training samples: use --num-nodes <= {n}"
        )
    spec = get_partitioner(scheme)
    given = {"alpha": alpha, "classes_per_node": classes_per_node, "groups": groups,
             "seed": seed}
    p = spec.build(labels, num_partitions, **{k: given[k] for k in spec.params})
    parts = _load_parts(p, n, num_partitions, spec)
    empty = [i for i, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise UserError(
            f"{scheme} partitioning left node(s) {empty[:5]} with no samples; "
            "use fewer --num-nodes" + (f" or {spec.remedy}" if spec.remedy else "")
        )
    return parts


def _load_parts(p, n: int, num_partitions: int, spec: PartitionerSpec) -> list[np.ndarray]:
    """Sorted ``int64`` sample indices of each of the ``num_partitions`` partitions of ``p``."""
    parts = []
    try:
        with warnings.catch_warnings():  # their retry warnings would bury our one-line error
            warnings.simplefilter("ignore")
            for i in range(num_partitions):
                idx = np.sort(np.asarray(p.load_partition(i)["index"], dtype=np.int64))
                parts.append(idx)
    except ValueError as exc:  # e.g. DirichletPartitioner gives up after 10 tries
        reason = str(exc).splitlines()[0].split(". ")[0].rstrip(".")  # its first sentence
        raise UserError(
            f"cannot split {n} samples into {num_partitions} non-empty {spec.name} partitions "
            f"({reason}); use fewer --num-nodes" + (f" or {spec.remedy}" if spec.remedy else "")
        ) from None
    return parts


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-node label histogram.

    Parameters
    ----------
    labels : numpy.ndarray
        ``(N,)`` integer class labels.
    parts : list of numpy.ndarray
        Index arrays, as :func:`partition` returns.
    num_classes : int
        Number of classes (columns).

    Returns
    -------
    numpy.ndarray
        ``(num_partitions, num_classes)`` sample counts.
    """
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def values_per_node(groups: np.ndarray, parts: list[np.ndarray]) -> list[int]:
    """Count the distinct natural ids (``groups`` values) each node holds.

    Parameters
    ----------
    groups : numpy.ndarray
        ``(N,)`` natural ids of the samples.
    parts : list of numpy.ndarray
        Index arrays, as :func:`partition` returns.

    Returns
    -------
    list of int
        One count per node.
    """
    values = np.asarray(groups).astype(str)
    return [len(np.unique(values[p])) for p in parts]
