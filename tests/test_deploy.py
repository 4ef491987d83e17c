"""End-to-end: `fedavg coordinator` and `fedavg node` as separate processes on localhost.

Each test starts real Flower SuperLink / SuperNode processes (through our commands) and
checks, at the end, that none of them is left alive.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import conftest
import numpy as np
import pytest

from fedavg.engines.deployment.processes import free_port

pytestmark = pytest.mark.e2e  # real SuperLink / SuperNode processes


def tagged_processes(tag: str) -> list[str]:
    """Live processes started under this test's tag (env FEDAVG_TEST_TAG), children too."""
    return conftest.tagged_processes("FEDAVG_TEST_TAG", tag)


class Cluster:
    """Start `fedavg` commands in the background; kill and check them at the end."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args) -> subprocess.Popen:
        """Start `fedavg ARGS` in the background, its output in NAME.log."""
        log = open(self.tmp / f"{name}.log", "w")
        env = {**os.environ, "COLUMNS": "200", "FEDAVG_TEST_TAG": self.tag,
               "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli.app", *map(str, args)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def coordinator(self, *args):
        """Start `fedavg coordinator` on this cluster's address."""
        return self.start("coordinator", "coordinator", "--address", self.address, *args)

    def node(self, name, *args):
        """Start `fedavg node` against this cluster's coordinator."""
        return self.start(name, "node", "--coordinator", self.address, *args)

    def log(self, name: str) -> str:
        """Everything the command NAME printed so far."""
        return (self.tmp / f"{name}.log").read_text()

    def wait(self, proc, timeout=240) -> int:
        """Exit code of ``proc``; fail with its log if it runs past ``timeout`` s."""
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{proc.name} still running after {timeout} s:\n"
                                 f"{self.log(proc.name)[-3000:]}") from None

    def wait_for(self, name: str, pattern: str, timeout=120) -> str:
        """Wait until the log of NAME matches ``pattern`` (a regex); return the log."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, text := self.log(name)):
            assert time.monotonic() < deadline, f"no {pattern!r} in {name}:\n{text[-3000:]}"
            time.sleep(0.2)
        return text

    def close(self):
        """Stop every command, then fail if any process of the cluster is left."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        deadline = time.monotonic() + 15
        while tagged_processes(self.tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = tagged_processes(self.tag)
        assert not left, f"processes left alive: {left}"


@pytest.fixture
def cluster(tmp_path):
    """Yield a Cluster; close it (and check for leaks) after the test."""
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Make a `fedavg certs` folder with two node keys, shared by the module."""
    folder = tmp_path_factory.mktemp("certs")
    subprocess.run([sys.executable, "-m", "fedavg.cli.app", "certs", str(folder), "--nodes", "2"],
                   check=True, capture_output=True)
    return folder


def rounds_of(out):
    """Read the rounds of ``metrics.jsonl`` in run folder ``out``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def misfit_data(folder):
    """Write a CSV that does not fit the digits model (10 features; it takes 8x8 images)."""
    bad = folder / "bad.csv"
    rng = np.random.default_rng(0)
    rows = [",".join([f"f{i}" for i in range(10)] + ["label"])]
    rows += [",".join(f"{v:.3f}" for v in rng.random(10)) + f",{i % 3}" for i in range(60)]
    bad.write_text("\n".join(rows) + "\n")
    return bad


def test_coordinator_and_three_nodes_over_tls(cluster, certs, tmp_path):
    """Three --once nodes over TLS: every round merges all three; the model is saved."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "3", "--min-nodes", "3", "--certs", certs,
                                "--output", out)
    nodes = [cluster.node(f"node{i}", "--certs", certs, "--partition-id", i,
                          "--num-partitions", 3, "--once", *(["--threads", 1] if i == 0 else []))
             for i in range(3)]
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    for n in nodes:
        assert cluster.wait(n, 60) == 0, cluster.log(n.name)
    text = cluster.log("coordinator")
    assert "(TLS)" in text and "3 node(s) connected" in text
    rounds = rounds_of(out)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["num_nodes"] == 3 for r in rounds)
    assert rounds[-1]["accuracy"] >= 0.85
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == rounds[-1]["accuracy"]
    meta = json.loads((out / "model.json").read_text())
    assert meta["rounds"] == 3 and meta["model"]["name"] == "mlp"
    # the saved model scores what the coordinator reported, on the same hold-out
    ev = subprocess.run([sys.executable, "-m", "fedavg.cli.app", "evaluate", str(out), "--json"],
                        capture_output=True, text=True, check=True)
    assert json.loads(ev.stdout)["accuracy"] == pytest.approx(rounds[-1]["accuracy"])
    # every node trained its own partition in every round and then left (--once)
    for n in nodes:
        assert "node done: 4 task(s) run (the run's end notice is one)" in cluster.log(n.name)
    # --threads: node0 trains on one thread, the others on torch's default (one per core)
    assert ", 1 CPU thread(s)" in cluster.log("node0")
    assert not any("Warning" in cluster.log(name) for name in ("coordinator", "node0", "node1"))
    assert re.search(r", \d+ CPU thread\(s\)", cluster.log("node1"))


def test_node_killed_in_round_two_run_still_finishes(cluster, tmp_path):
    """A node SIGKILLed mid-run: its round and the rest finish with the other two."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "4", "--min-nodes", "3", "--insecure",
                                "--local-epochs", "20", "--output", out)
    nodes = [cluster.node(f"node{i}", "--insecure", "--partition-id", i,
                          "--num-partitions", 3, "--once") for i in range(3)]
    deadline = time.monotonic() + 180
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline, cluster.log("coordinator")
        assert coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.1)
    nodes[1].kill()  # SIGKILL in round 2
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    rounds = rounds_of(out)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    # the kill lands in round 2, or (a stalled test process) just after node1 replied to it
    lost = next(r["round"] for r in rounds if r.get("num_failed", 0) >= 1)
    assert lost in (2, 3), rounds
    assert all(r["num_nodes"] == 3 for r in rounds[:lost - 1]), rounds
    assert all(r["num_nodes"] == 2 for r in rounds[lost - 1:]), rounds
    assert rounds[-1]["accuracy"] >= 0.85
    assert re.search(rf"round {lost}: node \d+ failed", cluster.log("coordinator"))
    for n in (nodes[0], nodes[2]):
        assert cluster.wait(n, 60) == 0, cluster.log(n.name)


def test_nodes_keep_their_own_method_state_between_rounds(cluster, tmp_path):
    """SCAFFOLD across machines: each node's variate stays on its side, round to round.

    The server variate goes out with the model; each node's own stays in its SuperNode's
    context, so its round 2 starts from its round-1 state.
    """
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--insecure",
                                "--strategy", "scaffold", "--save-node-models", "--output", out,
                                "--sam-rho", "0.05")  # FedSAM steps on the nodes, too
    nodes = [cluster.node(f"node{i}", "--insecure", "--partition-id", i,
                          "--num-partitions", 2, "--once") for i in range(2)]
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    assert [r["num_nodes"] for r in rounds_of(out)] == [2, 2]
    assert "2 rounds, SAM rho 0.05; waiting for 2 node(s)" in cluster.log("coordinator")
    infos = [json.loads((d / "model.json").read_text())["node"]
             for d in sorted((out / "nodes").iterdir())]
    assert [i["state_round"] for i in infos] == [1, 1], infos
    for n in nodes:
        assert cluster.wait(n, 60) == 0, cluster.log(n.name)


def test_node_training_error_reported_within_seconds(cluster, tmp_path):
    """A node's training error reaches the coordinator at once, with the node's message."""
    bad = misfit_data(tmp_path)
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--min-nodes-per-round",
                                "1", "--insecure", "--output", out)
    good = cluster.node("good", "--insecure", "--once")
    misfit = cluster.node("bad", "--insecure", "--dataset", bad, "--once")
    deadline = time.monotonic() + 120
    while "round   1/2" not in (text := cluster.log("coordinator")) \
            and "failed:" not in text:
        assert time.monotonic() < deadline, text
        assert coord.poll() is None, text
        time.sleep(0.1)
    started = time.monotonic()
    while not re.search(r"node \d+ failed:.*takes image inputs",
                        text := cluster.log("coordinator")):
        assert time.monotonic() - started < 30, text  # not the 600 s round timeout
        time.sleep(0.2)
    assert "this model takes image inputs, and node data" in text and "is tabular" in text
    assert cluster.wait(coord) == 0, text
    assert cluster.wait(good, 60) == 0
    assert "task failed, reported to the coordinator" in cluster.log("bad")
    assert cluster.wait(misfit, 60) == 1, cluster.log("bad")  # its work is missing: not 0
    assert re.search(r"run failed: run \d+ finished, but 2 of this node's \d+ task\(s\) "
                     r"failed \(the last: .*takes image inputs", cluster.log("bad")), \
        cluster.log("bad")


#: A user builder that leaves a mark beside the file it was loaded from.
OWN_MODEL = """
from pathlib import Path
from torch import nn


def build(input_shape, num_classes, hidden=8):
    Path(__file__).with_name("built").touch()
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
"""


def test_nodes_run_user_code_only_when_started_with_the_same_model(cluster, tmp_path):
    """A user-code model: a node given --model trains its own copy; one without refuses it."""
    coordinator_copy, node_copy = tmp_path / "coordinator", tmp_path / "node"
    for folder in (coordinator_copy, node_copy):
        folder.mkdir()
        (folder / "my_models.py").write_text(OWN_MODEL)
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--min-nodes-per-round",
                                "1", "--insecure", "--model",
                                f"{coordinator_copy / 'my_models.py'}:build", "--model-arg",
                                "hidden=16", "--output", out)
    good = cluster.node("good", "--insecure", "--once", "--model",
                        f"{node_copy / 'my_models.py'}:build")
    bad = cluster.node("bad", "--insecure")
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    assert cluster.wait(good, 60) == 0, cluster.log("good")
    text = cluster.log("coordinator")
    assert re.search(r"node \d+ failed: UserError: the run's model \S+my_models.py:build is "
                     r"code this node was not told to run: start the node with --model "
                     r"my_models.py:build", text), text
    assert [r["num_nodes"] for r in rounds_of(out)] == [1, 1]
    assert "task failed, reported to the coordinator" in cluster.log("bad")
    assert (node_copy / "built").exists()  # the node ran its own copy of the code
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["args"] == {"hidden": 16}
    assert bad.poll() is None


def test_a_failed_run_is_told_to_its_nodes(cluster, tmp_path):
    """A run that fails: its --once nodes exit 1 at once, saying why."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--min-nodes-per-round",
                                "2", "--insecure", "--output", out)
    good = cluster.node("good", "--insecure", "--once")
    bad = cluster.node("bad", "--insecure", "--dataset", misfit_data(tmp_path), "--once")
    reason = "round 1: only 1 usable model(s), fewer than --min-nodes-per-round 2"
    assert cluster.wait(coord) == 1, cluster.log("coordinator")
    assert reason in cluster.log("coordinator")
    ended = time.monotonic()
    for node in (good, bad):
        assert cluster.wait(node, 60) == 1, cluster.log(node.name)
        text = cluster.log(node.name)
        assert f"run failed: {reason}" in text and "lost the coordinator" not in text, text
    # told, not left to find the coordinator gone (30 s unreachable, then a SuperNode stop)
    assert time.monotonic() - ended < 25


def test_two_nodes_with_one_key(cluster, certs, tmp_path):
    """A second node with a key already connected: exit 2 with one line; the run goes on."""
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "2", "--certs", certs,
                                "--auth-keys", certs / "authorized-nodes.pub",
                                "--output", tmp_path / "run", "--wait-timeout", "300")
    first = cluster.node("first", "--certs", certs, "--auth-key", certs / "node-0.key", "--once")
    cluster.wait_for("first", r"(?m)^connected to \S+ as node \d+")
    again = cluster.node("again", "--certs", certs, "--auth-key", certs / "node-0.key")
    assert cluster.wait(again, 180) == 2, cluster.log("again")  # it waits 30 s for the key
    text = cluster.log("again")
    assert f"error: a node with this key is already connected to {cluster.address}: give each " \
        "node its own key (node-<i>.key from `fedavg certs --nodes N`)" in text, text
    assert "PUBLIC KEY" not in text and "retrying" not in text and "Traceback" not in text
    assert "Warning" not in text  # the key check's TLS client is httpx's current API
    second = cluster.node("second", "--certs", certs, "--auth-key", certs / "node-1.key",
                          "--once")
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    for node in (first, second):
        assert cluster.wait(node, 60) == 0, cluster.log(node.name)
    text = cluster.log("coordinator")
    assert re.search(r"refused a node whose key is already in use by connected node \d+: give "
                     r"each node its own key", text) and "PUBLIC KEY" not in text, text


def test_a_node_replacing_a_crashed_one_gets_its_key_back(cluster, certs, tmp_path):
    """A node SIGKILLed while its replacement, with the same key, is already starting.

    The coordinator still holds the key for the dead node a while; the replacement waits,
    then joins. The replacement starts first so that it surely meets the held key: started
    after the kill, a slow start may miss the whole hold.
    """
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "2", "--certs", certs,
                                "--auth-keys", certs / "authorized-nodes.pub",
                                "--output", tmp_path / "run", "--wait-timeout", "120")
    key = ("--certs", certs, "--auth-key", certs / "node-0.key")
    crashed = cluster.node("crashed", *key)
    cluster.wait_for("crashed", r"(?m)^connected to \S+ as node \d+")
    back = cluster.node("back", *key, "--once")
    cluster.wait_for("back", "still holds this node's key as connected", timeout=60)
    crashed.kill()
    crashed.wait(10)
    cluster.wait_for("back", r"(?m)^connected to \S+ as node \d+", timeout=60)
    other = cluster.node("other", "--certs", certs, "--auth-key", certs / "node-1.key", "--once")
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    for node in (back, other):
        assert cluster.wait(node, 60) == 0, cluster.log(node.name)


def test_wrong_certificate_and_unknown_key_are_refused(cluster, certs, tmp_path):
    """Wrong CA, unknown key, no key, no TLS: exit 2 with the reason; a known key runs."""
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "fedavg.cli.app", "certs", str(other), "--nodes", "1"],
                   check=True, capture_output=True)
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "1", "--certs", certs,
                                "--auth-keys", certs / "authorized-nodes.pub",
                                "--output", out, "--wait-timeout", "300")
    deadline = time.monotonic() + 180  # limits for a loaded machine: four nodes start at once
    while "listening" not in cluster.log("coordinator"):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    wrong_ca = cluster.node("wrong_ca", "--certs", other, "--auth-key", certs / "node-0.key")
    unknown = cluster.node("unknown", "--certs", certs, "--auth-key", other / "node-0.key")
    no_key = cluster.node("no_key", "--certs", certs)
    plain = cluster.node("plain", "--insecure")
    for proc, words in ((wrong_ca, "TLS certificate is not signed by"),
                        (unknown, "refused this node's key"),
                        (no_key, "only accepts known nodes"),
                        (plain, "uses TLS: pass --certs DIR")):
        assert cluster.wait(proc) == 2, cluster.log(proc.name)
        text = cluster.log(proc.name)
        assert words in text and "Traceback" not in text, text
    # a registered key gets in and the run completes
    ok = cluster.node("ok", "--certs", certs, "--auth-key", certs / "node-1.key", "--once")
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    assert cluster.wait(ok, 60) == 0
    text = cluster.log("coordinator")
    assert "node authentication" in text and "PUBLIC KEY" not in text, text
    assert "refused a node whose key is not in --auth-keys" in text
    assert "refused a node without a key" in text
    assert len(rounds_of(out)) == 1


def test_too_few_nodes_fails_after_wait_timeout(cluster, tmp_path):
    """Too few nodes: exit 1 after --wait-timeout with one clear line."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "2", "--insecure",
                                "--wait-timeout", "3", "--output", out)
    assert cluster.wait(coord, 120) == 1
    text = cluster.log("coordinator")
    assert "0 of 2 nodes connected before round 1 after 3 s" in text
    assert "Traceback" not in text


def test_a_coordinator_whose_superlink_dies_fails_at_once(cluster, tmp_path):
    """It waited for ever (Flower's retries), mid-run and while waiting for nodes."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    cluster.node("node", "--insecure")
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    link = next(int(p.split(":")[0]) for p in tagged_processes(cluster.tag)
                if "_launch superlink" in p)
    os.kill(link, signal.SIGKILL)
    assert cluster.wait(coord, 60) == 1, cluster.log("coordinator")
    text = cluster.log("coordinator")
    assert "run failed: the SuperLink process was killed (SIGKILL) during the run; finished " \
           f"rounds are kept in {out}; resume with: fedavg coordinator" in text, text
    assert "Traceback" not in text and (out / "model.safetensors").exists()


# SIGINT takes the same handler (tests/test_cli.py); test_e2e.py sends it to a simulation
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signals_stop_every_flower_process(cluster, tmp_path, sig):
    """Ctrl-C / SIGTERM stop coordinator and node with exit 130 and no process left."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    node = cluster.node("node", "--insecure")
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    assert any("fedavg.engines.deployment.launch" in p for p in tagged_processes(cluster.tag))
    coord.send_signal(sig)
    assert cluster.wait(coord, 30) == 130, cluster.log("coordinator")
    assert "interrupted: finished rounds are kept" in cluster.log("coordinator")
    assert node.poll() is None  # a node outlives a run and serves the next one
    node.send_signal(sig)
    assert cluster.wait(node, 30) == 130, cluster.log("node")
    assert (out / "model.safetensors").exists()
    deadline = time.monotonic() + 15
    while tagged_processes(cluster.tag) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not tagged_processes(cluster.tag)


def test_a_serving_node_joins_the_next_coordinator_run(cluster, tmp_path):
    """A node without --once serves a second coordinator started on the same port."""
    first = cluster.coordinator("--rounds", "1", "--min-nodes", "1", "--insecure",
                                "--output", tmp_path / "run1")
    node = cluster.node("node", "--insecure")
    assert cluster.wait(first, 120) == 0, cluster.log("coordinator")
    time.sleep(6)  # the node retries the gone coordinator meanwhile (0.1, 1.5, 2.6 s ...)
    # a new coordinator (a new SuperLink, which does not know the node) on the same port
    second = cluster.start("coordinator2", "coordinator", "--address", cluster.address,
                           "--rounds", "2", "--min-nodes", "1", "--insecure",
                           "--output", tmp_path / "run2", "--wait-timeout", "120")
    assert cluster.wait(second, 180) == 0, cluster.log("coordinator2") + cluster.log("node")
    assert len(rounds_of(tmp_path / "run2")) == 2
    text = cluster.wait_for("node", r"(?s)(waiting for the next run.*){2}", 30)
    assert text.count("joined run") == 2
    # the end of the first run is said once; then nothing until the node is back
    waiting = re.search(r"run \d+ finished; waiting for the next run\n", text)
    assert waiting, text
    between = text[waiting.end():text.index("joined run", waiting.end())]
    assert re.fullmatch(r"connected to \S+ as node \d+\n", between), text
    assert node.poll() is None
    node.send_signal(signal.SIGTERM)
    assert cluster.wait(node, 30) == 130


def test_node_gives_up_clearly_when_the_coordinator_is_gone(cluster, tmp_path):
    """No coordinator, or one killed mid-run: the node exits 1 saying so."""
    # nobody listens: --max-wait-time ends the retries with one clear line
    lonely = cluster.node("lonely", "--insecure", "--max-wait-time", "4")
    assert cluster.wait(lonely, 60) == 1
    text = cluster.log("lonely")
    assert "cannot reach the coordinator" in text and "retrying" in text
    assert f"error: could not reach the coordinator at {cluster.address} within " \
        "--max-wait-time 4 s" in text  # it joined no run: no "run failed:"
    assert "Giving up" not in text and "could not establish" not in text  # Flower's own words
    # the coordinator dies (SIGKILL) mid-run: its SuperLink goes too, a --once node gives up
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    # with --max-wait-time its SuperNode gives up too: that must not interrupt the node (130)
    node = cluster.node("node", "--insecure", "--once", "--max-wait-time", "5")
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    coord.kill()
    assert cluster.wait(node, 90) == 1, cluster.log("node")
    assert "lost the coordinator" in cluster.log("node")
    assert "Traceback" not in cluster.log("node")
    assert (out / "model.safetensors").exists()  # finished rounds are kept
    # as the next coordinator would: remove the killed one's private folder
    from fedavg.engines.deployment.processes import PrivateDir

    PrivateDir("fedavg-coordinator-").cleanup()


def test_once_node_gives_up_when_the_coordinator_stops_before_its_run(cluster, tmp_path):
    """A ``--once`` node whose coordinator stops before round 1 exits 1 after 30 s.

    It connected while the coordinator waited for more nodes. It retried for ever, and a
    compose stack of such nodes never ended.
    """
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--insecure",
                                "--output", tmp_path / "run")
    node = cluster.node("node", "--insecure", "--once")
    cluster.wait_for("node", "connected to")
    coord.send_signal(signal.SIGTERM)
    assert cluster.wait(coord, 60) == 130, cluster.log("coordinator")
    assert cluster.wait(node, 90) == 1, cluster.log("node")
    text = cluster.log("node")
    assert f"lost the coordinator at {cluster.address} before its run started " \
        "(unreachable for 30 s)" in text, text
    assert "Traceback" not in text


def test_text_across_machines_and_a_node_with_images(cluster, tmp_path):
    """AG News over the deployment engine; a node holding images says so in one line."""
    from conftest import SHARED_DATA

    ag_news = SHARED_DATA / "ag_news"
    out = tmp_path / "run"
    coord = cluster.coordinator("--dataset", ag_news, "--rounds", "2", "--min-nodes", "3",
                                "--min-nodes-per-round", "2", "--lr", "0.02",
                                "--local-epochs", "2", "--insecure", "--output", out,
                                "--tensorboard", tmp_path / "tb")
    nodes = [cluster.node(f"node{i}", "--insecure", "--dataset", ag_news, "--partition-id", i,
                          "--num-partitions", 2, "--once") for i in range(2)]
    cluster.node("images", "--insecure", "--dataset", "digits")
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    text = cluster.log("coordinator")
    assert re.search(r"node \d+ failed:.*takes text inputs, and node data digits is image",
                     text), text
    rounds = rounds_of(out)
    assert [r["num_nodes"] for r in rounds] == [2, 2] and rounds[-1]["accuracy"] > 0.6
    meta = json.loads((out / "model.json").read_text())
    assert meta["input"]["kind"] == "text" and meta["model"]["name"] == "fasttext"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()  # the coordinator tracked its rounds too
    assert [(e.step, e.value) for e in events.Scalars("fedavg/num_nodes")] == [(1, 2), (2, 2)]
    for n in nodes:
        assert cluster.wait(n, 60) == 0, cluster.log(n.name)
