"""The compose stack on a real Docker engine: train, evaluate on the host, lose a node, clean up.

One test, as CI runs it on a fresh machine (as root): Debian's docker.io and debootstrap are
installed if missing, a private dockerd runs in a temporary folder (``container_engine``), the
image is built from a Debian base made here and a wheelhouse made on the host, then:

1. a coordinator and 3 nodes train 2 rounds on digits; the merged model in the output folder
   loads with ``fedavg evaluate`` on the host, and the files are readable and removable by the
   (non-root) user the stack ran as;
2. again for 4 rounds, with one node killed (``docker kill``) after round 1: the run finishes
   and every round begun after the kill trained on the other two;
3. ``fedavg simulate`` (Ray) runs inside the image;

and afterwards no container, network, volume, image, dockerd, mount, network interface or
iptables rule is left. A second run on the same machine reuses the cached base tarball and
wheelhouse. ``FEDAVG_CI_TIMINGS=FILE`` writes the timings of each step there as JSON.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import container_engine as ce
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.container]

PROJECT = "fedavg-ci"
IMAGE = "fedavg-ci:test"
USER = (4321, 4321)  # the host user the stack runs as: not root, so ownership is tested
COMPOSE = ce.ROOT / "containers" / "compose.yml"


class Timer(dict):
    """Seconds per step, and whatever else the test reports."""

    def step(self, name, fn, *args):
        """Run ``fn(*args)``, record its wall time under ``name``, return its result."""
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self[name] = round(time.monotonic() - start, 1)


def build_image(engine, tarball, wheels_dir):
    """Import the base, stage the wheelhouse in the build context, build; return context MB."""
    with open(tarball, "rb") as fh:
        subprocess.run([engine.client, "import", "-", ce.BASE_IMAGE], stdin=fh, check=True,
                       env=engine.env, capture_output=True, timeout=600)
    record = engine.root / "staged-wheels.txt"
    ce.stage_wheels(wheels_dir, ce.ROOT / "containers" / "wheelhouse", record)
    try:
        res = engine.docker("build", "--progress=plain", "--network=none", "-f",
                            ce.ROOT / "containers" / "Dockerfile", "--build-arg",
                            f"BASE_IMAGE={ce.BASE_IMAGE}", "-t", IMAGE, ce.ROOT,
                            env={"DOCKER_BUILDKIT": "1"}, timeout=1800, log=True)
    finally:
        ce.unstage(record)
    assert res.returncode == 0
    sent = [line.split("transferring context:")[1].split()[0]
            for line in engine.log.read_text().splitlines()
            if "transferring context:" in line and line.rstrip().endswith("done")]
    wheels = sum(p.stat().st_size for p in wheels_dir.glob("*.whl"))
    context = max(ce.size_bytes(s) for s in sent)
    # .dockerignore keeps venvs (.ci-venv: GBs), runs and .git out: wheels + sources only
    assert context < wheels + 50e6, f"build context {context / 1e6:.0f} MB"
    return round(context / 1e6)


def stack_env(root, **settings):
    return {"FEDAVG_IMAGE": IMAGE, "FEDAVG_UID": str(USER[0]), "FEDAVG_GID": str(USER[1]),
            "OUTPUT": str(root / "home" / "runs" / "compose"), "DATASET": "digits",
            "NUM_NODES": "3", **settings}


def compose(engine, env, *args, timeout=600, check=True):
    return engine.docker("compose", "-p", PROJECT, "-f", COMPOSE, *args, env=env,
                         timeout=timeout, check=check)


def logs(engine, env):
    return compose(engine, env, "logs", "--no-color", check=False).stdout[-6000:]


def as_user(*cmd):
    """Run ``cmd`` as the stack's user, with no other group: what the host user can do."""
    return subprocess.run(["setpriv", f"--reuid={USER[0]}", f"--regid={USER[1]}",
                           "--clear-groups", *cmd], capture_output=True, text=True, timeout=120)


def metrics(output):
    path = output / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_and_evaluate(engine, root):
    """Stage 1: 3 nodes x 2 rounds, the published port, evaluation and clean-up as the user."""
    env = stack_env(root, ROUNDS="2")
    output = Path(env["OUTPUT"])
    compose(engine, env, "up", "-d")
    published = compose(engine, env, "port", "coordinator", "9092").stdout.strip()
    host, _, port = published.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10):
        pass  # the coordinator's port, published on the host's loopback only
    code = compose(engine, env, "wait", "coordinator", check=False, timeout=900)
    text = logs(engine, env)
    assert code.returncode == 0 and "exited with status code 0" in code.stdout, text
    rounds = metrics(output)
    assert [r["round"] for r in rounds] == [1, 2] and all(r["num_nodes"] == 3 for r in rounds)
    for i in range(3):  # each replica found its own index, partition and key
        assert f"replica {PROJECT}-node-{i + 1}.{PROJECT}_default: index {i}" in text, text
        assert f"partition {i}/3" in text, text
    assert "3 node key(s) registered" in text and "(TLS, node authentication)" in text
    res = subprocess.run([sys.executable, "-m", "fedavg.cli.app", "evaluate", output, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["accuracy"] > 0.5
    files = sorted(p.name for p in output.iterdir())
    assert {"model.safetensors", "model.json", "summary.json", "metrics.jsonl"} <= set(files)
    assert all(p.stat().st_uid == USER[0] for p in [output, *output.iterdir()])
    read = as_user("sh", "-c", f"cat {output}/* > /dev/null && rm -r {output}")
    assert read.returncode == 0 and not output.exists(), read.stderr
    compose(engine, env, "down")  # keeps the certs volume: the next stack reuses it


def lose_a_node(engine, root):
    """Stage 2: kill node 3 once round 1 is done; the run finishes with the other two.

    The kill lands while round 2 trains or, when rounds are quick, just after it: every round
    that began after ``docker kill`` returned (from two rounds after the last one recorded by
    then) must have trained on 2 nodes.
    """
    env = stack_env(root, ROUNDS="4", LOCAL_EPOCHS="5")  # a round of seconds
    output = Path(env["OUTPUT"])
    compose(engine, env, "up", "-d")
    deadline = time.monotonic() + 600
    while not metrics(output) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(output), logs(engine, env)
    engine.docker("kill", f"{PROJECT}-node-3")
    done_at_kill = len(metrics(output))
    code = compose(engine, env, "wait", "coordinator", check=False, timeout=900)
    text = logs(engine, env)
    assert code.returncode == 0 and "exited with status code 0" in code.stdout, text
    rounds = metrics(output)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4], text
    after = rounds[done_at_kill + 1:]  # rounds that started after the kill
    assert rounds[0]["num_nodes"] == 3 and after, (done_at_kill, rounds)
    assert all(r["num_nodes"] == 2 for r in after), (done_at_kill, rounds)
    assert json.loads((output / "summary.json").read_text())["rounds"] == 4
    assert "certificates in /certs kept" in text
    compose(engine, env, "down", "-v")
    assert as_user("rm", "-r", str(output)).returncode == 0


def simulate_inside(engine, root):
    """Stage 3: ``fedavg simulate`` with Ray inside the image (shm_size from the file)."""
    env = stack_env(root, ROUNDS="1", NUM_NODES="2", OUTPUT=str(root / "home" / "runs" / "sim"))
    res = compose(engine, env, "run", "--rm", "simulate", check=False, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [r["round"] for r in metrics(Path(env["OUTPUT"]))] == [1]
    compose(engine, env, "down", "-v", "--rmi", "all")


def scenario(engine, root, timer):
    # the base (debootstrap) and the wheelhouse (pip download) are made while dockerd starts
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(timer.step, "base_tarball", ce.base_tarball,
                           root / "debootstrap.log", root)
        wheels = pool.submit(timer.step, "wheelhouse", ce.wheelhouse, root / "pip.log")
        timer.step("engine_start", engine.start)
        tarball, timer["base_cached"] = base.result()
        wheels_dir, timer["wheels_cached"] = wheels.result()
    timer["context_mb"] = timer.step("build", build_image, engine, tarball, wheels_dir)
    timer["image_mb"] = round(int(engine.docker("image", "inspect", "-f", "{{.Size}}", IMAGE)
                                  .stdout) / 2**20)
    home = root / "home" / "runs"
    home.mkdir(parents=True)
    for path in (home.parent, home):  # the host user's own folders, as in a clone
        os.chown(path, *USER)
    timer.step("train_and_evaluate", train_and_evaluate, engine, root)
    timer.step("lose_a_node", lose_a_node, engine, root)
    timer.step("simulate_inside", simulate_inside, engine, root)


@pytest.mark.timeout(3600)
@pytest.mark.long
def test_compose_stack_on_a_real_engine_trains_survives_a_lost_node_and_leaves_nothing():
    started = time.monotonic()
    timer = Timer()
    timer["swept"] = ce.sweep_stale()  # engines of runs killed before their clean-up
    root = ce.new_root()
    engine = None
    with ce.interrupts_raise():
        try:
            # before the snapshot: iptables comes with docker.io
            timer["installed"] = timer.step("packages", ce.ensure_packages, root / "apt.log")
            before = ce.host_state()
            engine = ce.Engine(root)
            scenario(engine, root, timer)
        finally:
            report = engine.teardown() if engine is not None else {}
            shutil.rmtree(root, ignore_errors=True)
            timer["teardown_report"] = report
            timer["total_s"] = round(time.monotonic() - started, 1)
            print(f"container e2e: {json.dumps(timer)}", file=sys.stderr)
            if os.environ.get("FEDAVG_CI_TIMINGS"):
                Path(os.environ["FEDAVG_CI_TIMINGS"]).write_text(json.dumps(timer, indent=1))
    assert report["leftovers"] == {"containers": [], "networks": [], "volumes": [],
                                   "images": []}, report
    assert report["alive"] == [] and not ce._alive(engine.pid), report  # dockerd by its PID
    assert report["mounts"] == [] and not report["root_exists"] and not root.exists(), report
    assert ce.host_state() == before  # iptables rules, network interfaces
