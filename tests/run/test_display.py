"""The partition table's rows: each node's top and smallest label."""

import numpy as np

from fedavg.run.display import _partition_row

CLASSES = ["cat", "dog", "fish"]


def test_two_labels_at_half_each_show_two_labels():
    # a pathological (2 classes per node) node at 50/50: the top and the smallest differ
    assert _partition_row(0, np.array([5, 5, 0]), CLASSES) == [
        "0", "10", "2/3", "cat (50%)", "dog (50%)"]


def test_the_smallest_label_is_the_rarest_present_one():
    assert _partition_row(3, np.array([1, 6, 3]), CLASSES)[3:] == ["dog (60%)", "cat (10%)"]


def test_a_node_of_one_label_has_no_smallest_other():
    assert _partition_row(1, np.array([0, 0, 4]), CLASSES)[2:] == ["1/3", "fish (100%)", "-"]
