"""End-to-end: secure aggregation (Flower's SecAgg+) in simulation and across processes."""

import json
import signal
import time

import pytest
from helpers.cli import run_cli
from helpers.cluster import Cluster, rounds_of

pytestmark = pytest.mark.e2e


def test_simulate_with_secure_aggregation_scores_as_a_plain_run(tmp_path, no_leaks):
    """3 nodes x 2 rounds on digits: SecAgg+'s quantisation leaves the scores as they were."""
    runs = {}
    for name, extra in (("plain", ()), ("secure", ("--secure-aggregation",))):
        run_cli("simulate", "--num-nodes", 3, "--rounds", 2, *extra,
                "--output", tmp_path / name)
        runs[name] = rounds_of(tmp_path / name)
    plain, secure = runs["plain"], runs["secure"]
    assert [r["num_nodes"] for r in secure] == [3, 3]
    assert secure[-1]["accuracy"] >= 0.85
    for p, s in zip(plain, secure):
        assert abs(p["accuracy"] - s["accuracy"]) <= 0.01 and abs(p["loss"] - s["loss"]) < 0.01
    # the protocol's keys, shares and masked vectors come back instead of the models
    assert secure[0]["bytes_from_nodes"] > plain[0]["bytes_from_nodes"]


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
