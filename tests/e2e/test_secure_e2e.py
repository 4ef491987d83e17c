"""End-to-end: secure aggregation (Flower's SecAgg+) across processes, with DP-SGD.

That SecAgg+ merges the sample-weighted mean and never an update in clear is shown with
Flower's workflow and mod in one process (tests/run/test_secure.py).
"""

import json
import signal
import time

import pytest
from helpers.cluster import Cluster, rounds_of

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    """Yield a Cluster; close it (and check for leaks) after the test."""
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_nodes_killed_mid_run_leave_a_secure_private_run_that_finishes(cluster, tmp_path):
    """A node killed in round 2 of a SecAgg+ run with DP-SGD across processes: it goes on.

    Coordinator and 3 nodes on localhost, all with ``--secure-aggregation``, each training
    by DP-SGD (record-level DP: private before it is masked); the killed node's round and
    the later ones merge the other two. The coordinator accounts each node's steps by its
    partition (digits, 479-480 samples a node: q = 1/15, 3 local epochs: 45 steps a round).
    """
    from fedavg.run.privacy import record_epsilon

    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", 4, "--min-nodes", 3, "--min-nodes-per-round", 2,
                                "--secure-aggregation", "--insecure", "--local-epochs", 3,
                                "--dp-sgd", "--dp-noise", "0.7", "--output", out)
    nodes = [cluster.node(f"node{i}", "--insecure", "--partition-id", i, "--num-partitions", 3,
                          "--secure-aggregation", "--once", "--threads", 1) for i in range(3)]
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and rounds_of(out)):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.1)
    nodes[2].send_signal(signal.SIGKILL)  # round 2 has begun: its protocol is under way
    assert cluster.wait(coord, 300) == 0, cluster.log("coordinator")
    rounds = rounds_of(out)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert rounds[0]["num_nodes"] == 3 and rounds[-1]["num_nodes"] == 2
    assert rounds[-1]["accuracy"] >= 0.6  # through the noise (0.1 is chance)
    assert rounds[0]["dp_steps"] == {str(k): [1 / 15, 45] for k in range(3)}
    assert rounds[-1]["dp_steps"] == {"0": [1 / 15, 45], "1": [1 / 15, 45]}  # in the sum
    assert rounds[-1]["epsilon"] == pytest.approx(  # nodes 0 and 1 trained in every round
        record_epsilon(0.7, [(1 / 15, 4 * 45)], 1e-5))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == rounds[-1]["accuracy"]
    for n in nodes[:2]:  # a task of a round that started again may have failed (its shares)
        code = cluster.wait(n, 60)
        assert code == 0 or "task(s) failed" in cluster.log(n.name), cluster.log(n.name)
