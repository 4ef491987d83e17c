"""``fedavg.partition.partition`` and ``label_counts``."""

import numpy as np
import pytest

from fedavg.errors import UserError
from fedavg.partition import label_counts, partition

N = 503  # not a multiple of the node count on purpose


@pytest.fixture(scope="module")
def labels():
    """503 labels over 10 classes, shuffled."""
    rng = np.random.default_rng(123)
    return rng.permutation(np.arange(N) % 10).astype(np.int64)


def assert_disjoint(parts):
    seen = np.concatenate(parts)
    assert len(np.unique(seen)) == len(seen), "a sample is in two partitions"


def assert_covering(parts, n):
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def assert_well_formed(parts, num):
    assert len(parts) == num
    for p in parts:
        assert p.dtype == np.int64 and len(p) > 0
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_disjoint_and_covering(labels, scheme):
    parts = partition(labels, 7, scheme, alpha=0.5, seed=0)
    assert_well_formed(parts, 7)
    assert_disjoint(parts)
    assert_covering(parts, N)


def test_natural_one_node_per_group():
    rng = np.random.default_rng(0)
    groups = rng.choice(np.array(["writer-a", "writer-b", "writer-c", "writer-d"]), size=60)
    labels = rng.integers(0, 3, size=60)
    parts = partition(labels, 4, "natural", groups=groups)
    assert_well_formed(parts, 4)
    assert_disjoint(parts)
    assert_covering(parts, 60)
    owners = []
    for p in parts:
        values = set(groups[p])
        assert len(values) == 1, "a node got samples of several groups"
        owners.append(values.pop())
    assert sorted(owners) == ["writer-a", "writer-b", "writer-c", "writer-d"]
    for p, owner in zip(parts, owners):  # each node has all of its group
        assert len(p) == int(np.sum(groups == owner))


def test_natural_wrong_node_count():
    groups = np.array(["x", "y", "z", "x", "y", "z"])
    with pytest.raises(UserError, match="--num-nodes 3"):
        partition(np.zeros(6, np.int64), 4, "natural", groups=groups)


def test_natural_needs_groups():
    with pytest.raises(UserError, match="--partition-by"):
        partition(np.zeros(6, np.int64), 2, "natural")


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning")
@pytest.mark.parametrize("cpn", [1, 2, 3])
def test_pathological_classes_per_node(labels, cpn):
    parts = partition(labels, 5, "pathological", classes_per_node=cpn, seed=0)
    assert len(parts) == 5
    assert_disjoint(parts)
    for p in parts:
        assert 1 <= len(np.unique(labels[p])) <= cpn


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_seeded(labels, scheme):
    a = partition(labels, 6, scheme, alpha=0.5, seed=7)
    b = partition(labels, 6, scheme, alpha=0.5, seed=7)
    c = partition(labels, 6, scheme, alpha=0.5, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any(len(x) != len(z) or not np.array_equal(x, z) for x, z in zip(a, c))


def test_iid_sizes_balanced(labels):
    sizes = [len(p) for p in partition(labels, 10, "iid", seed=0)]
    assert sum(sizes) == N
    assert max(sizes) - min(sizes) <= 1


def mean_top_share(labels, parts):
    counts = label_counts(labels, parts, 10)
    return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))


def test_dirichlet_alpha_controls_skew(labels):
    skewed = mean_top_share(labels, partition(labels, 5, "dirichlet", alpha=0.1, seed=0))
    even = mean_top_share(labels, partition(labels, 5, "dirichlet", alpha=100.0, seed=0))
    # with 10 balanced classes an unskewed node's top share is close to 0.1
    assert even < 0.25
    assert skewed > even + 0.2


def test_more_nodes_than_samples():
    with pytest.raises(UserError, match="--num-nodes") as info:
        partition(np.arange(5) % 2, 6, "iid")
    assert "5" in str(info.value)


@pytest.mark.parametrize("num", [0, -2])
def test_zero_nodes(num):
    with pytest.raises(UserError, match="--num-nodes"):
        partition(np.arange(5) % 2, num, "iid")


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_bad_alpha(labels, alpha):
    with pytest.raises(UserError, match="--alpha"):
        partition(labels, 3, "dirichlet", alpha=alpha)


def test_unknown_scheme(labels):
    with pytest.raises(UserError, match="unknown partitioner 'shards'"):
        partition(labels, 3, "shards")


def test_pathological_too_many_classes_per_node():
    with pytest.raises(UserError, match="--classes-per-node 4"):
        partition(np.arange(30) % 3, 2, "pathological", classes_per_node=4)


def test_label_counts_by_hand():
    labels = np.array([0, 1, 1, 2, 0, 2, 2])
    parts = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6])]
    expected = np.array([[1, 2, 0, 0],
                         [1, 0, 1, 0],
                         [0, 0, 2, 0]])
    got = label_counts(labels, parts, 4)
    assert got.shape == (3, 4)
    np.testing.assert_array_equal(got, expected)


def test_pathological_covers_all_when_every_label_has_a_node():
    # "first-deterministic": node i gets label i first, so 10 nodes use all 10 labels
    labels = np.arange(500) % 10
    parts = partition(labels, 10, "pathological", classes_per_node=2, seed=0)
    assert_disjoint(parts)
    assert_covering(parts, 500)
    assert [len(np.unique(labels[p])) for p in parts] == [2] * 10
