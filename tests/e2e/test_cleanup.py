"""End-to-end: every command leaves its temporary folder empty of ours, whichever way it ends.

Each test gives the real CLI a fresh ``TMPDIR`` and, at the end, checks that it holds none of
our folders (``fedavg-*``: a node's or coordinator's private folder with its SuperExec
secret, a simulation's data and Ray folder) and nothing of Ray's, and that no process the
commands started (tagged by an environment variable, which Flower's and Ray's processes
inherit) is alive.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from helpers.cluster import Cluster, cluster_processes
from helpers.patience import within

pytestmark = pytest.mark.e2e  # real SuperLink / SuperNode / Ray processes

#: What a command may leave in TMPDIR: torch's own per-user compile cache, shared by every
#: torch program of the user and reused (``torchinductor_<user>``), and pytest's folders.
NOT_OURS = ("torchinductor_", "pytest-of-")


def leftovers(tmpdir: Path) -> list[str]:
    """Entries of ``tmpdir`` that a command of ours left behind."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith(NOT_OURS))


def wait_gone(tag: str, timeout_s: float = 15.0) -> list[str]:
    """Wait up to ``timeout_s`` for the processes tagged ``tag`` to go; return those left."""
    deadline = time.monotonic() + within(timeout_s)
    while (left := cluster_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.3)
    return left


def wait_for_round(out: Path, proc, rounds: int = 1, timeout_s: float = 180.0) -> None:
    """Wait until run folder ``out`` holds ``rounds`` finished rounds."""
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + within(timeout_s)
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rounds):
        assert proc.poll() is None, f"exited {proc.returncode} before round {rounds}"
        assert time.monotonic() < deadline, f"no round {rounds} after {timeout_s} s"
        time.sleep(0.2)


@pytest.fixture
def tmpdir_env(monkeypatch):
    """Give the commands the test starts a fresh, short TMPDIR; remove it afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="tc", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path, tmpdir_env):
    """Yield a coordinator / node cluster (tests/helpers/cluster.py) using ``tmpdir_env``."""
    c = Cluster(tmp_path)
    yield c
    c.close()


def private_folders(tmpdir: Path, prefix: str) -> list[Path]:
    """List the ``prefix*`` folders in ``tmpdir`` now."""
    return sorted(tmpdir.glob(f"{prefix}*"))


def test_node_and_coordinator_leave_nothing_after_sigterm(cluster, tmpdir_env, tmp_path):
    """SIGTERM mid-run (exit 130): both private folders, secrets included, are gone."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    node = cluster.node("node", "--insecure")
    wait_for_round(out, coord)
    # while they run, each holds its folder, with its SuperExec secret
    for prefix in ("fedavg-coordinator-", "fedavg-node-"):
        [folder] = private_folders(tmpdir_env, prefix)
        assert (folder / "superexec.secret").is_file()
    coord.send_signal(signal.SIGTERM)
    assert cluster.wait(coord, 30) == 130, cluster.log("coordinator")
    assert node.poll() is None  # it waits for the next run
    node.send_signal(signal.SIGTERM)
    assert cluster.wait(node, 30) == 130, cluster.log("node")
    assert not wait_gone(cluster.tag)
    assert leftovers(tmpdir_env) == []


def test_node_and_coordinator_leave_nothing_after_a_normal_end(cluster, tmpdir_env, tmp_path):
    """A finished run and a ``--once`` node: exit 0, nothing left."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "1", "--insecure",
                                "--output", out)
    node = cluster.node("node", "--insecure", "--once")
    assert cluster.wait(coord, 300) == 0, cluster.log("coordinator") + cluster.log("node")
    assert cluster.wait(node, 60) == 0, cluster.log("node")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert not wait_gone(cluster.tag)
    assert leftovers(tmpdir_env) == []


def test_failed_coordinator_and_node_leave_nothing(cluster, tmpdir_env, tmp_path):
    """Failure paths: too few nodes in time, no coordinator within --max-wait-time (exit 1)."""
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "2", "--insecure",
                                "--wait-timeout", "3", "--output", tmp_path / "run")
    lonely = cluster.start("lonely", "node", "--coordinator", f"127.0.0.1:{cluster.port + 1}",
                           "--insecure", "--max-wait-time", "3")
    assert cluster.wait(coord, 120) == 1, cluster.log("coordinator")
    assert cluster.wait(lonely, 60) == 1, cluster.log("lonely")
    assert "0 of 2 nodes connected" in cluster.log("coordinator")
    assert "could not reach the coordinator" in cluster.log("lonely")
    assert not wait_gone(cluster.tag)
    assert leftovers(tmpdir_env) == []


GPU_PARENT = """
import sys
import fedavg.engines.deployment.gpus as gpus
# this machine may have no GPU: two CPU nodes stand in for GPUs 0 and 1
gpus.plan_gpu_nodes = lambda *args: [("cpu", None), ("cpu", None)]
from fedavg.cli.app import main
sys.argv = ["fedavg", "node", "--gpus", "0,1", "--coordinator", sys.argv[1], "--insecure"]
main()
"""


def test_gpu_node_parent_stops_its_nodes_and_their_folders(tmpdir_env, tmp_path):
    """``fedavg node --gpus``: SIGTERM to the parent stops every node it started, folders too."""
    from fedavg.engines.deployment.processes import free_port

    tag = uuid.uuid4().hex
    log = tmp_path / "parent.log"
    env = {**os.environ, "FEDAVG_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as fh:  # nobody listens there: the nodes keep retrying
        parent = subprocess.Popen([sys.executable, "-c", GPU_PARENT, f"127.0.0.1:{free_port()}"],
                                  stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + within(120)
        while len(private_folders(tmpdir_env, "fedavg-node-")) < 2 \
                or "cannot reach the coordinator" not in log.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert len(cluster_processes(tag)) >= 5  # parent, 2 nodes, 2 SuperNodes
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 130, log.read_text()
        assert not cluster_processes(tag)  # the parent waited for its nodes
        assert leftovers(tmpdir_env) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert not wait_gone(tag)


def simulate(tmpdir: Path, tag: str, out: Path, *args) -> subprocess.Popen:
    """Start ``fedavg simulate`` on digits (4 nodes) in the background."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "FEDAVG_TEST_TAG": tag, "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedavg.cli", "simulate", "--dataset", "digits",
         "--num-nodes", "4", "--output", str(out), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def listeners(tag: str) -> list[tuple[str, str]]:
    """``(process, address)`` of every listening TCP socket of the processes tagged ``tag``."""
    import psutil

    found = []
    for entry in cluster_processes(tag):
        try:
            proc = psutil.Process(int(entry.split(":", 1)[0]))
            found += [(proc.name(), c.laddr.ip) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def ray_fallbacks(pid: int) -> list[Path]:
    """List the short Ray folders a simulation with pid ``pid`` made in /tmp (deep TMPDIR)."""
    return sorted(Path("/tmp").glob(f"fedavg-ray-{pid}-*"))


# SIGINT takes the same handler as SIGTERM (tests/cli/test_cli.py); test_e2e.py sends it
@pytest.mark.parametrize("how", ["normal", "sigterm", "sigterm-early", "failed"])
def test_simulate_leaves_nothing(tmpdir_env, tmp_path, how):
    """``fedavg simulate``: its data and Ray's session folder go, and every Ray process.

    ``failed``: every node's reply comes too late (--round-timeout 0.01), so round 1 fails.
    ``sigterm-early``: stopped once its run folder exists, before round 1 ends; the run
    folder, still empty, goes too.
    """
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    args = {"normal": ["--rounds", "2"], "sigterm": ["--rounds", "50"],
            "sigint": ["--rounds", "50"], "failed": ["--rounds", "2", "--round-timeout", "0.01"],
            "sigterm-early": ["--rounds", "50"]}
    proc = simulate(tmpdir_env, tag, out, *args[how])
    try:
        if how == "sigterm-early":
            while not out.is_dir():
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.05)
            assert not any(out.iterdir())
            proc.send_signal(signal.SIGTERM)
        if how in ("sigterm", "sigint"):
            wait_for_round(out, proc)
            [data] = private_folders(tmpdir_env, "fedavg-")
            assert (data / "ray").is_dir()  # Ray's session folder is ours, in our folder
            assert any("raylet" in p for p in cluster_processes(tag))
            # the run's own Ray (GCS, raylet, node actors) and the driver: loopback only
            listening = listeners(tag)
            assert any("gcs_server" in who for who, _ in listening), listening
            assert all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
                       for _, ip in listening), listening
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    expected = {"normal": 0, "sigterm": 130, "sigint": 130, "failed": 1,
                "sigterm-early": 130}[how]
    assert proc.returncode == expected, text
    assert "Traceback" not in text
    if how == "sigterm-early":
        assert "interrupted before the first round finished" in text
        assert not out.exists()
    assert not wait_gone(tag)
    assert leftovers(tmpdir_env) == []


API_CTRL_C = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell gives it (not xdist)
import fedavg
out = sys.argv[1]
def interrupt():
    while not os.path.exists(os.path.join(out, "metrics.jsonl")):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    fedavg.simulate(num_nodes=3, rounds=100, local_epochs=10, output=out)
except KeyboardInterrupt as exc:
    print("caught:", exc, flush=True)
print("threads:", sorted(t.name for t in threading.enumerate() if not t.daemon), flush=True)
"""


def test_ctrl_c_in_the_python_api_leaves_no_thread_and_the_process_exits(tmpdir_env,
                                                                          tmp_path):
    """A notebook's or script's Ctrl-C: the engine's threads end with the run.

    A ServerApp thread polling for replies and an engine thread waiting on Ray kept the
    process from exiting. The message says how to go on.
    """
    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", API_CTRL_C, str(out)], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "FEDAVG_TEST_TAG": tag,
                                                       "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"which is kept in {out}: fedavg.simulate(resume={str(out)!r}) goes on" in \
        proc.stdout, proc.stdout
    assert "threads: ['MainThread']" in proc.stdout, proc.stdout
    assert not wait_gone(tag)
    assert leftovers(tmpdir_env) == []


def test_simulate_with_a_deep_tmpdir_runs_and_leaves_nothing(tmp_path):
    """A TMPDIR too deep for Ray's Unix sockets: Ray gets a short folder of ours, removed."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    tag = uuid.uuid4().hex
    proc = simulate(deep, tag, tmp_path / "run", "--rounds", "1")
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, text
    assert not wait_gone(tag)
    assert leftovers(deep) == []
    assert ray_fallbacks(proc.pid) == []


def test_a_killed_simulation_is_cleaned_up_by_the_next_one(tmp_path):
    """SIGKILL leaves the folders; the next ``fedavg simulate`` removes them (free lock)."""
    deep = tmp_path / ("d" * 60)  # also puts Ray's folder in /tmp (see above)
    deep.mkdir()
    tag = uuid.uuid4().hex
    killed = simulate(deep, tag, tmp_path / "run", "--rounds", "50")
    try:
        wait_for_round(tmp_path / "run", killed)
        abandoned = private_folders(deep, "fedavg-sim-") + ray_fallbacks(killed.pid)
        assert len(abandoned) == 2, abandoned
    finally:
        killed.kill()
        killed.communicate()
    # Ray's processes go with their driver; kill any straggler, by pid
    for entry in wait_gone(tag, 30.0):
        with contextlib.suppress(OSError):
            os.kill(int(entry.split(":")[0]), signal.SIGKILL)
    # The run's own folder is in its private TMPDIR; Ray's is in /tmp, where a simulation of
    # another test may already have removed it, as the next run here would.
    assert abandoned[0].exists() and abandoned[0].name.startswith("fedavg-sim-"), abandoned
    proc = simulate(deep, tag, tmp_path / "next", "--rounds", "1")
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, text
    assert not any(folder.exists() for folder in abandoned)
    assert leftovers(deep) == [] and ray_fallbacks(proc.pid) == []
    assert not wait_gone(tag)


@pytest.mark.parametrize("how", ["ctrl-c", "hangup"])
def test_simulate_leading_its_terminal_leaves_nothing(tmpdir_env, tmp_path, how):
    """``ssh -t host fedavg simulate ...`` or a tmux pane: the command leads its terminal.

    Ctrl-C typed at that terminal (SIGINT to the whole foreground group, Ray's processes
    too), or the terminal hanging up (SIGHUP): every process goes, none is left stopped.
    """
    import pty
    import threading

    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    env = {**os.environ, "TMPDIR": str(tmpdir_env), "FEDAVG_TEST_TAG": tag}
    pid, terminal = pty.fork()  # the child leads a new session on a new terminal
    if pid == 0:
        # as sshd or tmux starts it: pytest itself may run under nohup (SIGHUP ignored, which
        # the command keeps, as nohup asks) or as a background job (SIGINT ignored)
        for sig in (signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(sys.executable, [sys.executable, "-m", "fedavg.cli", "simulate",
                                   "--num-nodes", "4", "--rounds", "50", "--output", str(out)],
                  env)
    shown = []

    def drain():  # keep reading, as a terminal does, until it closes
        with contextlib.suppress(OSError):
            while chunk := os.read(terminal, 4096):
                shown.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + within(240)
        while not (metrics.exists() and metrics.read_text().strip()):
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), b"".join(shown)
            assert time.monotonic() < deadline, b"".join(shown)
            time.sleep(0.2)
        if how == "ctrl-c":
            os.write(terminal, b"\x03")  # the terminal's interrupt character
        else:
            os.close(terminal)  # the terminal hangs up
        deadline = time.monotonic() + within(120)
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            assert time.monotonic() < deadline, "the command did not stop"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(terminal)
    assert os.waitstatus_to_exitcode(done[1]) == 130, b"".join(shown)
    if how == "ctrl-c":
        text = b"".join(shown).decode(errors="replace")
        assert re.search(r"(^|\n)interrupted", text.replace("\r\x1b[2K", "\n")), text
    assert not wait_gone(tag), "processes left behind"
    assert leftovers(tmpdir_env) == []
