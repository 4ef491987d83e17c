"""``fedavg.data.partition``: the partitioner registry, ``partition`` and ``label_counts``."""

import dataclasses
import inspect

import numpy as np
import pytest

from fedavg.config import settings as config
from fedavg.data.partition import (
    PARAMETERS,
    available_partitioners,
    get_partitioner,
    label_counts,
    partition,
    partitioner_names,
    register_partitioner,
)
from fedavg.util.errors import UserError

N = 503  # not a multiple of the node count on purpose


@pytest.fixture(scope="module")
def labels():
    """503 labels over 10 classes, shuffled."""
    rng = np.random.default_rng(123)
    return rng.permutation(np.arange(N) % 10).astype(np.int64)


def assert_disjoint(parts):
    """Check that no sample is in two partitions."""
    seen = np.concatenate(parts)
    assert len(np.unique(seen)) == len(seen), "a sample is in two partitions"


def assert_covering(parts, n):
    """Check that the partitions together hold every index ``0..n-1``."""
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def assert_well_formed(parts, num):
    """Check ``num`` non-empty, sorted, unique ``int64`` index arrays."""
    assert len(parts) == num
    for p in parts:
        assert p.dtype == np.int64 and len(p) > 0
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_disjoint_and_covering(labels, scheme):
    """Iid and Dirichlet give disjoint partitions covering every sample."""
    parts = partition(labels, 7, scheme, alpha=0.5, seed=0)
    assert_well_formed(parts, 7)
    assert_disjoint(parts)
    assert_covering(parts, N)


def test_natural_one_node_per_group():
    """Natural gives each node all samples of exactly one group."""
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
    """Natural refuses a node count other than the number of groups."""
    groups = np.array(["x", "y", "z", "x", "y", "z"])
    with pytest.raises(UserError, match="--num-nodes 3"):
        partition(np.zeros(6, np.int64), 4, "natural", groups=groups)


def test_natural_needs_groups():
    """Natural without groups names ``--partition-by``."""
    with pytest.raises(UserError, match="--partition-by"):
        partition(np.zeros(6, np.int64), 2, "natural")


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning")
@pytest.mark.parametrize("cpn", [1, 2, 3])
def test_pathological_classes_per_node(labels, cpn):
    """Pathological gives each node at most ``classes_per_node`` labels."""
    parts = partition(labels, 5, "pathological", classes_per_node=cpn, seed=0)
    assert len(parts) == 5
    assert_disjoint(parts)
    for p in parts:
        assert 1 <= len(np.unique(labels[p])) <= cpn


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_seeded(labels, scheme):
    """The same seed gives the same partitions, another seed other ones."""
    a = partition(labels, 6, scheme, alpha=0.5, seed=7)
    b = partition(labels, 6, scheme, alpha=0.5, seed=7)
    c = partition(labels, 6, scheme, alpha=0.5, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any(len(x) != len(z) or not np.array_equal(x, z) for x, z in zip(a, c))


def test_iid_sizes_balanced(labels):
    """Iid partition sizes differ by at most one."""
    sizes = [len(p) for p in partition(labels, 10, "iid", seed=0)]
    assert sum(sizes) == N
    assert max(sizes) - min(sizes) <= 1


def mean_top_share(labels, parts):
    """Mean over nodes of the share of a node's most common label."""
    counts = label_counts(labels, parts, 10)
    return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))


def test_dirichlet_alpha_controls_skew(labels):
    """A small ``alpha`` skews labels far more than a large one."""
    skewed = mean_top_share(labels, partition(labels, 5, "dirichlet", alpha=0.1, seed=0))
    even = mean_top_share(labels, partition(labels, 5, "dirichlet", alpha=100.0, seed=0))
    # with 10 balanced classes an unskewed node's top share is close to 0.1
    assert even < 0.25
    assert skewed > even + 0.2


def test_more_nodes_than_samples():
    """More nodes than samples is a user error naming the sample count."""
    with pytest.raises(UserError, match="--num-nodes") as info:
        partition(np.arange(5) % 2, 6, "iid")
    assert "5" in str(info.value)


@pytest.mark.parametrize("num", [0, -2])
def test_zero_nodes(num):
    """Fewer than one node is a user error."""
    with pytest.raises(UserError, match="--num-nodes"):
        partition(np.arange(5) % 2, num, "iid")


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_bad_alpha(labels, alpha):
    """A non-positive ``alpha`` is a user error."""
    with pytest.raises(UserError, match="--alpha"):
        partition(labels, 3, "dirichlet", alpha=alpha)


def test_unknown_scheme(labels):
    """An unknown scheme is a user error naming it."""
    with pytest.raises(UserError, match="unknown partitioner 'shards'"):
        partition(labels, 3, "shards")


def test_pathological_too_many_classes_per_node():
    """More labels per node than labels present is a user error."""
    with pytest.raises(UserError, match="--classes-per-node 4"):
        partition(np.arange(30) % 3, 2, "pathological", classes_per_node=4)


def test_label_counts_by_hand():
    """Label histograms match a hand count."""
    labels = np.array([0, 1, 1, 2, 0, 2, 2])
    parts = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6])]
    expected = np.array([[1, 2, 0, 0],
                         [1, 0, 1, 0],
                         [0, 0, 2, 0]])
    got = label_counts(labels, parts, 4)
    assert got.shape == (3, 4)
    np.testing.assert_array_equal(got, expected)


def test_pathological_covers_all_when_every_label_has_a_node():
    """Pathological covers all samples when every label has a node."""
    # "first-deterministic": node i gets label i first, so 10 nodes use all 10 labels
    labels = np.arange(500) % 10
    parts = partition(labels, 10, "pathological", classes_per_node=2, seed=0)
    assert_disjoint(parts)
    assert_covering(parts, 500)
    assert [len(np.unique(labels[p])) for p in parts] == [2] * 10


# --- the registry -------------------------------------------------------------------------------


def test_registry_names_in_order():
    """The four built-in partitioners are registered, in order, each with one line."""
    names = ("iid", "dirichlet", "pathological", "natural")
    assert partitioner_names() == names
    from fedavg.config.settings import RunConfig

    assert all(RunConfig().replace(partitioner=n, partition_by="g").validate() for n in names)
    assert tuple(available_partitioners()) == names
    for name, description in available_partitioners().items():
        assert description and "\n" not in description, name
        assert get_partitioner(name).name == name


def test_get_unknown_lists_known_names():
    """An unknown name is a user error listing every registered name."""
    with pytest.raises(UserError) as info:
        get_partitioner("shards")
    msg = str(info.value)
    assert "unknown partitioner 'shards'" in msg
    for name in partitioner_names():
        assert name in msg.split(";", 1)[1]
    assert msg.endswith("choose iid, dirichlet, pathological or natural")


def test_parameters_follow_config_names():
    """Each partitioner declares its parameters by their config names."""
    # --alpha -> DataConfig.alpha -> partition(alpha=) -> dirichlet's ``alpha``, by name alone
    assert get_partitioner("iid").params == ("seed",)
    assert get_partitioner("dirichlet").params == ("alpha", "seed")
    assert get_partitioner("pathological").params == ("classes_per_node", "seed")
    assert get_partitioner("natural").params == ("groups",)
    fields = {f.name for f in dataclasses.fields(config.DataConfig)}
    keywords = {name for name, p in inspect.signature(partition).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(PARAMETERS) == keywords
    assert set(PARAMETERS) - {"groups"} <= fields  # groups come from DataConfig.partition_by
    assert get_partitioner("dirichlet").paper.endswith("arXiv:1909.06335")
    assert get_partitioner("pathological").paper.endswith("arXiv:1602.05629")


def test_register_refuses_undeclared_parameter():
    """A parameter ``partition`` cannot pass is refused at registration."""
    with pytest.raises(ValueError, match="shards_per_node"):
        @register_partitioner("bad", "declares a parameter partition() cannot give")
        def bad(labels, num_partitions, *, shards_per_node):
            raise AssertionError("never called")
    assert "bad" not in partitioner_names()


# hand-made labels: 12 samples, 4 labels, label l at indices l, l + 4, l + 8
SMALL = np.array([0, 1, 2, 3] * 3, dtype=np.int64)
SMALL_GROUPS = np.array(["u2", "u0", "u3", "u1"] * 3)  # u2 at 0 4 8, u0 at 1 5 9, ...


def small_expected(name):
    """``(kwargs, expected partitions or None)`` of each registered partitioner on SMALL."""
    if name == "iid":
        # datasets' shuffle(seed) is numpy's seeded permutation; IidPartitioner cuts it into
        # contiguous near-equal shards
        order = np.random.default_rng(3).permutation(12)
        return {"seed": 3}, [np.sort(c) for c in np.array_split(order, 4)]
    if name == "pathological":
        # first-deterministic with one label per node: node i holds all of label i
        return {"classes_per_node": 1, "seed": 0}, [np.array([i, i + 4, i + 8]) for i in range(4)]
    if name == "natural":
        # node i is the i-th id in sorted order: u0, u1, u2, u3
        return {"groups": SMALL_GROUPS}, [np.array([1, 5, 9]), np.array([3, 7, 11]),
                                          np.array([0, 4, 8]), np.array([2, 6, 10])]
    if name == "dirichlet":  # random shares: only the structure can be checked
        return {"alpha": 1.0, "seed": 0}, None
    raise AssertionError(f"add a hand-made case for the new partitioner {name!r}")


@pytest.mark.parametrize("name", partitioner_names())
def test_each_partitioner_disjoint_covering_by_hand(name):
    """Every partitioner splits SMALL disjointly and fully, as computed by hand."""
    kwargs, expected = small_expected(name)
    spec = get_partitioner(name)
    assert set(kwargs) == set(spec.params)
    parts = partition(SMALL, 4, name, **kwargs)
    assert_well_formed(parts, 4)
    assert_disjoint(parts)
    assert_covering(parts, 12)
    if expected is not None:
        assert len(parts) == len(expected)
        for got, want in zip(parts, expected):
            np.testing.assert_array_equal(got, want)
    again = partition(SMALL, 4, name, **kwargs)
    for a, b in zip(parts, again):
        np.testing.assert_array_equal(a, b)


def test_an_impossible_pathological_split_names_its_own_remedy_in_whole_words():
    from fedavg.data.partition import partition

    labels = np.arange(1438) % 10  # 143-144 samples a label; 1000 x 2 / 10 = 200 nodes each
    with pytest.raises(UserError) as info:
        partition(labels, 1000, "pathological", classes_per_node=2, seed=0)
    message = str(info.value)
    assert message.endswith("use fewer --num-nodes or a smaller --classes-per-node"), message
    assert "--alpha" not in message and "`num_p" not in message


def test_partition_settings_a_partitioner_does_not_take_are_noted():
    from fedavg.config.setting_use import setting_applies, unused_setting_notes
    from fedavg.config.settings import DataConfig

    assert setting_applies("alpha", "dirichlet") and not setting_applies("alpha", "iid")
    assert setting_applies("partition_by", "natural") and setting_applies("lr", "iid")
    notes = unused_setting_notes(DataConfig(alpha=0.3, classes_per_node=3))
    assert notes == ["--alpha 0.3 does nothing with --partitioner iid (it is for --partitioner "
                     "dirichlet)", "--classes-per-node 3 does nothing with --partitioner iid "
                     "(it is for --partitioner pathological)"]
    assert unused_setting_notes(DataConfig(partitioner="dirichlet", alpha=0.3)) == []
    assert unused_setting_notes(DataConfig()) == []  # defaults were not given


def test_samples_and_classes_no_node_trains_on_are_noted(tmp_path):
    """The pathological partition leaves classes out; a class may have no train sample."""
    import datasets
    import numpy as np

    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import prepare

    p = prepare(RunConfig().replace(partitioner="pathological", classes_per_node=2,
                                    num_nodes=2), model=False)
    used = sum(len(part) for part in p.parts)
    kept = sorted({p.data.classes[c] for c in np.unique(p.data.train.y[np.concatenate(p.parts)])})
    left = [c for c in p.data.classes if c not in kept]
    assert len(left) == 6 and used < len(p.data.train)
    assert (f"the pathological partition gives the nodes {used} of {len(p.data.train)} train "
            f"samples; 6 class(es) in no node's partition: {', '.join(left[:5])}, ...") \
        in p.data.notes
    assert not any("partition gives" in n for n in prepare(
        RunConfig().replace(num_nodes=2), model=False).data.notes)
    label = datasets.ClassLabel(names=["cat", "dog", "fox"])
    rows = {"f1": [float(i) for i in range(12)], "label": [i % 2 for i in range(12)]}
    test = {"f1": [1.0, 2.0, 3.0], "label": [0, 1, 2]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows).cast_column("label", label),
                          "test": datasets.Dataset.from_dict(test).cast_column("label", label)}
                         ).save_to_disk(str(tmp_path / "dd"))
    notes = prepare(RunConfig().replace(dataset=str(tmp_path / "dd"), num_nodes=2),
                    model=False).data.notes
    assert "1 class(es) without train samples, never learnt: fox" in notes
