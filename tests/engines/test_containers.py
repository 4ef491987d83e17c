"""The container files and the compose stack.

Lint (hadolint, compose config) and the helpers the image runs first; then (markers e2e and
container) the compose stack on a real Docker engine: train, evaluate on the host, lose a
node, clean up.
"""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import container_engine as ce
from helpers.patience import within

from fedavg.engines.deployment import containers
from fedavg.util.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "containers" / "Dockerfile"
COMPOSE = ROOT / "containers" / "compose.yml"
COMPOSE_GPU = ROOT / "containers" / "compose.gpu.yml"


def tool(name: str) -> str:
    """Return the path of a binary from the test extra (hadolint, docker-compose)."""
    if name == "docker-compose":  # the Go binary itself: its Python wrapper exits 0 on errors
        import compose

        path = Path(compose.__file__).parent / "docker-compose"
    else:
        path = Path(sys.executable).parent / name
    assert path.is_file(), f"{name} not found at {path}: pip install -e '.[test]'"
    return str(path)


# ---- lint ---------------------------------------------------------------------------------

def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "info",
                           str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint_with_nothing_above_info():
    res = hadolint(DOCKERFILE)
    assert res.returncode == 0 and res.stdout.strip() == "", res.stdout + res.stderr


def test_hadolint_fails_a_dockerfile_with_findings(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install -y curl\n")
    res = hadolint(bad)
    assert res.returncode == 1 and "DL3003" in res.stdout, res.stdout + res.stderr


def test_dockerfile_has_one_image_for_every_role():
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert not any(line.lower().startswith("# syntax") for line in lines)  # nothing pulled
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines
    assert sum(line.startswith("FROM ") for line in lines) >= 2  # multi-stage
    assert 'ENTRYPOINT ["fedavg"]' in lines
    users = [line for line in lines if line.startswith("USER ")]
    assert users == ["USER ${FEDAVG_UID}:${FEDAVG_GID}"]
    assert any(line.startswith("HEALTHCHECK") for line in lines)


def test_dockerignore_keeps_runs_venvs_data_and_keys_out():
    from fnmatch import fnmatch

    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p and not p.startswith("#")]

    def ignored(path: str) -> bool:  # Docker's rule: the last matching pattern wins
        verdict = False
        for pat in patterns:
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            parts = path.split("/")
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            if any(fnmatch(p, pat) or fnmatch(p, pat.replace("**/", "")) for p in prefixes):
                verdict = not neg
        return verdict

    for path in ("runs/x/model.safetensors", ".venv/bin/python", ".ci-venv/lib/x.py",
                 "certs/ca.key", ".git/HEAD", "data/train.parquet", ".pytest_cache/v",
                 "fedavg/cli/__pycache__/app.cpython-311.pyc", "tests/cli/test_cli.py"):
        assert ignored(path), path
    for path in ("pyproject.toml", "README.md", "fedavg/cli/app.py",
                 "fedavg/engines/deployment/node.py", "strategies/fedavg.py",
                 "containers/wheelhouse/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"):
        assert not ignored(path), path


def compose_config(*files: Path, env: dict | None = None, quiet: bool = True):
    args = [tool("docker-compose")]
    for f in files:
        args += ["-f", str(f)]
    args += ["config", "--quiet"] if quiet else ["config", "--format", "json"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NUM_", "COMPOSE_"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


@pytest.mark.parametrize("files,nodes", [((COMPOSE,), None), ((COMPOSE, COMPOSE_GPU), None),
                                         ((COMPOSE,), "1"), ((COMPOSE,), "8"),
                                         ((COMPOSE, COMPOSE_GPU), "8")])
def test_compose_files_are_valid(files, nodes):
    env = {"NUM_NODES": nodes} if nodes else {}
    res = compose_config(*files, env=env)
    assert res.returncode == 0 and res.stdout == "", res.stderr
    cfg = json.loads(compose_config(*files, env=env, quiet=False).stdout)
    node = cfg["services"]["node"]
    assert node["deploy"]["replicas"] == int(nodes or 4)
    assert f"--num-partitions={nodes or 4}" in node["command"]
    assert f"--min-nodes={nodes or 4}" in cfg["services"]["coordinator"]["command"]
    devices = node["deploy"].get("resources", {}).get("reservations", {}).get("devices")
    assert bool(devices) == (COMPOSE_GPU in files)


def test_compose_config_fails_an_invalid_file(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text(COMPOSE.read_text().replace("replicas: ${NUM_NODES:-4}", "replicas: many"))
    res = compose_config(bad)
    assert res.returncode != 0 and "replicas" in res.stderr, res.stderr
    assert compose_config(COMPOSE, env={"NUM_NODES": "four"}).returncode != 0


def test_compose_stack_runs_as_the_host_user_with_tls_and_node_keys():
    cfg = json.loads(compose_config(COMPOSE, env={"FEDAVG_UID": "1234", "FEDAVG_GID": "99"},
                                    quiet=False).stdout)
    svc = cfg["services"]
    assert svc["certs"]["user"] == "0:0" and "--owner=1234:99" in svc["certs"]["command"]
    assert svc["coordinator"]["user"] == svc["node"]["user"] == "1234:99"
    assert "--auth-keys=/certs/authorized-nodes.pub" in svc["coordinator"]["command"]
    assert "--auth-key=/certs/node-{index}.key" in svc["node"]["command"]
    assert not any("--insecure" in " ".join(s["command"]) for s in svc.values())
    assert svc["node"]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    mounts = {m["target"]: m for m in svc["node"]["volumes"]}
    assert mounts["/certs"]["read_only"] and mounts["/data"]["read_only"]
    assert "shm_size" in svc.get("simulate", {}) or "simulate" not in svc  # profile


# ---- health check -------------------------------------------------------------------------

@pytest.mark.parametrize("argv,address", [
    (["/opt/venv/bin/python", "/opt/venv/bin/fedavg", "coordinator", "--address",
      "0.0.0.0:9092", "--rounds", "2"], "0.0.0.0:9092"),
    (["fedavg", "coordinator", "--address=[::]:7000"], "[::]:7000"),
    (["python", "-m", "fedavg.cli", "coordinator"], "127.0.0.1:9092"),
    (["fedavg", "node", "--coordinator", "coordinator:9092"], None),
    (["python", "-m", "fedavg.engines.deployment.containers", "health"], None),
])
def test_coordinator_address_from_a_command_line(argv, address):
    assert containers.coordinator_address(argv) == address


def fake_proc(root: Path, commands: dict[int, list[str]]) -> Path:
    for pid, argv in commands.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()
    return root


def test_health_of_a_coordinator_follows_its_port(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        proc = fake_proc(tmp_path, {1: ["/sbin/docker-init", "--", "python"],
                                    7: ["python", "/opt/venv/bin/fedavg", "coordinator",
                                        f"--address=0.0.0.0:{port}"]})
        assert containers.health(proc) == 1  # bound, not listening yet
        listener.listen()
        assert containers.health(proc) == 0


def test_a_node_is_healthy_while_it_runs(tmp_path, capsys):
    proc = fake_proc(tmp_path, {1: ["fedavg", "node", "--coordinator", "127.0.0.1:1"]})
    assert containers.health(proc) == 0
    assert "no coordinator" in capsys.readouterr().out


# ---- replica index ------------------------------------------------------------------------

def dns_reply(query: bytes, names: list[str], rcode: int = 0) -> bytes:
    """Build a reply as Docker's DNS does: the question, then PTR answers pointing at it."""
    qid = struct.unpack_from("!H", query)[0]
    question = query[12:]
    answers = b""
    for name in names:
        rdata = containers._encode_name(name)
        answers += b"\xc0\x0c" + struct.pack("!HHIH", 12, 1, 600, len(rdata)) + rdata
    header = struct.pack("!6H", qid, 0x8180 | rcode, 1, len(names), 0, 0)
    return header + question + answers


def test_ptr_query_and_reply_by_hand():
    query = containers.ptr_query("10.213.1.4", 0xBEEF)
    assert query[:12] == struct.pack("!6H", 0xBEEF, 0x0100, 1, 0, 0, 0)
    assert query[12:] == (b"\x014\x011\x03213\x0210\x07in-addr\x04arpa\x00" + b"\x00\x0c\x00\x01")
    reply = dns_reply(query, ["fedavg-node-3.fedavg_default"])
    assert containers.parse_ptr_reply(reply, 0xBEEF) == ["fedavg-node-3.fedavg_default"]
    assert containers.parse_ptr_reply(reply, 0xBEEE) == []  # another query's reply
    assert containers.parse_ptr_reply(dns_reply(query, [], rcode=3), 0xBEEF) == []  # NXDOMAIN
    with pytest.raises(ValueError, match="malformed"):
        containers.parse_ptr_reply(reply[:-5], 0xBEEF)


def test_reverse_lookup_asks_the_dns_server_not_etc_hosts():
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    seen = []

    def answer():
        query, peer = server.recvfrom(512)
        seen.append(query)
        server.sendto(dns_reply(query, ["proj-node-12.proj_default"]), peer)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        names = containers.reverse_lookup("10.0.0.7", server.getsockname(), timeout_s=5)
    finally:
        thread.join(5)
        server.close()
    assert names == ["proj-node-12.proj_default"]
    assert b"\x017\x010\x010\x0210\x07in-addr" in seen[0]


@pytest.mark.parametrize("name,index", [("fedavg-node-1.fedavg_default", 0),
                                        ("fedavg-ci-node-3", 2), ("proj_node_10.net", 9)])
def test_index_from_a_replica_name(name, index):
    assert containers.index_from_name(name) == index


@pytest.mark.parametrize("name", ["my-coordinator", "node-0"])
def test_a_name_without_replica_number_is_a_user_error(name):
    with pytest.raises(UserError, match="NODE_INDEX"):
        containers.index_from_name(name)


def test_command_line_fills_the_index_and_appends_extra_args(capsys):
    argv = ["fedavg", "node", "--partition-id={index}", "--auth-key=/certs/node-{index}.key"]
    cmd, env = containers.command_line(argv, {"NODE_INDEX": "2", "EXTRA_ARGS": "--lr '0.1'"})
    assert cmd == ["fedavg", "node", "--partition-id=2", "--auth-key=/certs/node-2.key",
                   "--lr", "0.1"]
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert "index 2" in capsys.readouterr().out
    cmd, _ = containers.command_line(["fedavg", "coordinator"], {})  # no lookup needed
    assert cmd == ["fedavg", "coordinator"]
    with pytest.raises(UserError, match="NODE_INDEX must be"):
        containers.command_line(argv, {"NODE_INDEX": "-1"})
    with pytest.raises(UserError, match="EXTRA_ARGS"):
        containers.command_line(argv, {"NODE_INDEX": "0", "EXTRA_ARGS": "--x 'open"})


def test_one_gpu_per_replica(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert [containers.gpu_for(i, {}, tmp_path) for i in range(5)] == [0, 1, 2, 0, 1]
    assert containers.gpu_for(5, {"NUM_GPUS": "4"}, tmp_path) == 1
    _, env = containers.command_line(["fedavg", "node"], {"NODE_INDEX": "1",
                                                          "GPU_PER_NODE": "1", "NUM_GPUS": "2"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(UserError, match="sees no GPU"):
        containers.gpu_for(0, {}, tmp_path / "none")


# ---- init ---------------------------------------------------------------------------------

def test_init_makes_certificates_once_and_remakes_them_when_they_do_not_fit(tmp_path, capsys):
    me = (os.getuid(), os.getgid())
    certs, out = tmp_path / "certs", tmp_path / "out"
    containers.init(certs, 2, ["coordinator", "10.1.2.3"], [out], me)
    assert "certificates made" in capsys.readouterr().out
    ca = (certs / "ca.crt").read_bytes()
    assert containers.certs_fit(certs, 2, ["coordinator", "10.1.2.3"])
    assert (certs / "node-1.key").stat().st_mode & 0o077 == 0
    assert len((certs / "authorized-nodes.pub").read_text().splitlines()) == 2
    containers.init(certs, 2, ["coordinator"], [out], me)
    assert "kept" in capsys.readouterr().out and (certs / "ca.crt").read_bytes() == ca
    assert not containers.certs_fit(certs, 3, ["coordinator"])  # a third node needs a key
    assert not containers.certs_fit(certs, 2, ["coordinator", "gpu-box"])  # a new host name
    containers.init(certs, 3, ["coordinator", "gpu-box"], [out], me)
    assert (certs / "ca.crt").read_bytes() != ca
    assert containers.certs_fit(certs, 3, ["coordinator", "gpu-box"])


def stat_of(uid, gid, mode):
    return os.stat_result((0o040000 | mode, 0, 0, 2, uid, gid, 0, 0, 0, 0))


def test_writable_by_reads_owner_group_and_other_bits():
    assert containers.writable_by(stat_of(1000, 1000, 0o755), 1000, 1000)
    assert not containers.writable_by(stat_of(0, 0, 0o755), 1000, 1000)
    assert containers.writable_by(stat_of(0, 1000, 0o775), 1000, 1000)
    assert not containers.writable_by(stat_of(0, 1000, 0o755), 1000, 1000)
    assert containers.writable_by(stat_of(0, 0, 0o1777), 1000, 1000)
    assert not containers.writable_by(stat_of(1000, 1000, 0o555), 1000, 1000)
    assert containers.writable_by(stat_of(1000, 1000, 0o555), 0, 0)  # root


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")
def test_init_hands_a_new_output_folder_to_the_user_but_never_a_users_folder(tmp_path):
    new = tmp_path / "new"
    new.mkdir(mode=0o755)  # as Docker creates a missing bind-mount source: root, 0755
    assert "handed to 4321:4321" in containers.prepare_output(new, 4321, 4321)
    assert (new.stat().st_uid, new.stat().st_gid) == (4321, 4321)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 1111, 1111)
    with pytest.raises(UserError, match="FEDAVG_UID"):
        containers.prepare_output(theirs, 4321, 4321)
    assert theirs.stat().st_uid == 1111
    used = tmp_path / "used"
    used.mkdir(mode=0o755)
    (used / "old-run").touch()
    with pytest.raises(UserError, match="cannot write"):
        containers.prepare_output(used, 4321, 4321)


def test_the_helpers_are_one_line_errors(tmp_path):
    res = subprocess.run([sys.executable, "-m", "fedavg.engines.deployment.containers", "run",
                          "fedavg", "node",
                          "--partition-id={index}"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NODE_INDEX": "x"})
    assert res.returncode == 2 and res.stderr.startswith("error: NODE_INDEX must be")
    assert "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "fedavg.engines.deployment.containers", "run",
                          sys.executable,
                          "-c", "import sys; print(sys.argv[1:])", "{index}"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NODE_INDEX": "3", "EXTRA_ARGS": "--a b"})
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == "['3', '--a', 'b']"


def test_an_engine_folder_left_by_a_killed_run_is_swept(tmp_path):
    from helpers import container_engine as ce

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = tmp_path / "fedavg-ci-left"
    (left / "data" / "overlay2").mkdir(parents=True)
    (left / "owner.pid").write_text(dead)
    (left / "docker.pid").write_text(dead)  # its dockerd is gone too: nothing to stop
    wheel = tmp_path / "wheelhouse" / "x-1.0-py3-none-any.whl"  # staged in the build context
    wheel.parent.mkdir()
    wheel.touch()
    (left / "staged-wheels.txt").write_text(f"{wheel}\n")
    running = tmp_path / "fedavg-ci-running"
    running.mkdir()
    (running / "owner.pid").write_text(str(os.getpid()))  # a run in progress: kept
    assert ce.sweep_stale(tmp_path) == ["fedavg-ci-left"]
    assert not left.exists() and running.exists() and not wheel.exists()


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
    res = subprocess.run([sys.executable, "-m", "fedavg.cli", "evaluate", output, "--json"],
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
    deadline = time.monotonic() + within(600)
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


@pytest.mark.e2e
@pytest.mark.container
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
