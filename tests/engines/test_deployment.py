"""The deployment engine: `fedavg coordinator` and `fedavg node`.

Its pieces without a network first (certificates, keys, GPU plans, Flower internals, the
options), then end-to-end runs (marker e2e): real Flower SuperLink / SuperNode processes
started through our commands on localhost, each test checking at its end that none of them
is left alive.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from helpers.cli import run_cli
from helpers.cluster import Cluster, cluster_processes, rounds_of
from helpers.patience import within

from fedavg.config.settings import RunConfig
from fedavg.util.errors import UserError


def test_certs_make_a_ca_a_server_certificate_and_node_keys(tmp_path):
    """`fedavg certs`: a CA, a coordinator certificate it signed for the hosts, node keys."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from fedavg.engines.deployment.certs import make_certs
    from fedavg.engines.deployment.tls import load_auth_keys

    folder = tmp_path / "certs"
    make_certs(folder, hosts=["10.1.2.3", "coord.example"], nodes=2)
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((folder / "coordinator.crt").read_bytes())
    assert cert.issuer == ca.subject
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes,
                           ec.ECDSA(cert.signature_hash_algorithm))  # signed by the CA
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "coord.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "10.1.2.3"} <= {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    for private in ("ca.key", "coordinator.key", "node-0.key", "node-1.key"):
        assert os.stat(folder / private).st_mode & 0o077 == 0, private
    # the authorized list holds both node keys, and a folder of *.pub gives the same two
    assert len(load_auth_keys(folder / "authorized-nodes.pub")) == 2
    assert len(load_auth_keys(folder)) == 2
    with pytest.raises(UserError, match="already holds a CA"):
        make_certs(folder)
    (folder / "notes.txt").write_text("mine")
    make_certs(folder, nodes=1, overwrite=True)  # node-1's pair was left, not authorized
    assert sorted(p.name for p in folder.glob("node-*")) == ["node-0.key", "node-0.pub"]
    assert len(load_auth_keys(folder / "authorized-nodes.pub")) == 1
    make_certs(folder, overwrite=True)  # no node keys: none of the old ones stay
    assert not list(folder.glob("node-*")) and not (folder / "authorized-nodes.pub").exists()
    assert (folder / "notes.txt").read_text() == "mine"  # not ours: kept


def test_auth_key_errors_are_one_line(tmp_path):
    """Missing, malformed or empty --auth-keys files fail with a message naming the file."""
    from fedavg.engines.deployment.tls import load_auth_keys

    with pytest.raises(UserError, match="does not exist"):
        load_auth_keys(tmp_path / "missing.pub")
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-rsa not-a-key\n")
    with pytest.raises(UserError, match=r"bad.pub:1 is not an OpenSSH public key"):
        load_auth_keys(bad)
    empty = tmp_path / "empty.pub"
    empty.write_text("# nobody\n")
    with pytest.raises(UserError, match="holds no public key"):
        load_auth_keys(empty)


def test_gpu_plan_one_node_per_gpu():
    """--gpus gives one node per GPU, partition ids counting up; bad lists are refused."""
    from fedavg.engines.deployment.gpus import plan_gpu_nodes

    assert plan_gpu_nodes("0,1,2,3", None, None, 4) == [
        ("cuda:0", None), ("cuda:1", None), ("cuda:2", None), ("cuda:3", None)]
    assert plan_gpu_nodes("2,3", 4, 8, 4) == [("cuda:2", 4), ("cuda:3", 5)]
    with pytest.raises(UserError, match="lists GPU 2 but this machine has 2"):
        plan_gpu_nodes("0,2", None, None, 2)
    with pytest.raises(UserError, match="distinct"):
        plan_gpu_nodes("1,1", None, None, 4)
    with pytest.raises(UserError, match="GPU indices"):
        plan_gpu_nodes("a,b", None, None, 4)
    with pytest.raises(UserError, match="beyond --num-partitions 3"):
        plan_gpu_nodes("0,1", 2, 3, 4)


def test_address_parsing():
    """host:port, IPv6 in brackets; anything else is refused."""
    from fedavg.engines.deployment.processes import split_address

    assert split_address("127.0.0.1:9092") == ("127.0.0.1", 9092)
    assert split_address("[::1]:9092") == ("::1", 9092)
    assert split_address("coord.example:80") == ("coord.example", 80)
    assert split_address("proj_coordinator_1:9092") == ("proj_coordinator_1", 9092)  # Docker
    for bad in ("9092", "host:", "host:70000", "host:port"):
        with pytest.raises(UserError, match="is not host:port"):
            split_address(bad)
    for bad, problem in (("a b:80", "is not a host name"), (" host:80", "is not a host name"),
                         ("https://coord:80", "no scheme"),
                         ("1.2.3.999:80", "is not a valid IP address")):
        with pytest.raises(UserError, match=problem):
            split_address(bad)


def test_node_refusals_are_recognised():
    """SuperNode lines that mean "refused" get a reason; ordinary lines do not."""
    from fedavg.flower_compat import node_refusal

    assert "TLS certificate" in node_refusal(
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer")
    assert "only accepts known nodes: pass --auth-key" in node_refusal(
        "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered")
    assert "refused this node's key" in node_refusal("[code: 2004] Failed to activate SuperNode.")
    # an HTTP server that is no SuperLink (`python -m http.server`, measured), or a 404
    assert node_refusal("Server error '501 Unsupported method ('POST')' for url "
                        "'http://127.0.0.1:44683/v1/fleet/register-node'") == (
        "the server there answered HTTP 501 (Unsupported method ('POST')) to the node: it is "
        "no fedavg coordinator, or one of another Flower version; fix --coordinator")
    assert "answered HTTP 404 (Not Found)" in node_refusal(
        "Client error '404 Not Found' for url 'http://10.0.0.9:9092/v1/fleet/register-node'")
    for harmless in ("Uvicorn running on http://127.0.0.1:40372", "SuperNode ID: 4031403",
                     "Connection attempt failed, retrying in 0.40 seconds",
                     "Server error '503 Service Unavailable' for url 'http://a:1/v1/x'"):
        assert node_refusal(harmless) is None


def test_supernode_lines_are_read():
    """Each SuperNode line the node acts on is recognised, and ordinary lines are not."""
    from fedavg.flower_compat import parse_supernode_line

    line = parse_supernode_line("INFO :      Connection attempt failed, retrying in 0.40 seconds")
    assert line.attempt_failed and line.retry_in_s == 0.4 and not line.reconnected
    assert parse_supernode_line("INFO : SuperNode ID: 4031403").node_id == "4031403"
    line = parse_supernode_line("ERROR : Exit Code: 203")
    assert line.exit_code == 203 and line.refusal is None
    line = parse_supernode_line("ERROR : [code: 2004] Failed to activate SuperNode.")
    assert line.key_refused and "refused this node's key" in line.refusal
    line = parse_supernode_line("WARNING : Giving up reconnection after 4.01 seconds and 5 tries.")
    assert line.gave_up and line.notable and line.message.startswith("Giving up")
    assert parse_supernode_line("httpx: Server disconnected without sending a response.").dropped
    quiet = parse_supernode_line("INFO : Uvicorn running on http://127.0.0.1:40372")
    assert not (quiet.notable or quiet.attempt_failed or quiet.node_id or quiet.refusal)


def test_flower_internals_are_the_ones_we_patch():
    """Fails loudly when a flwr upgrade moves what the warm workers rely on."""
    from fedavg import flower_compat

    flower_compat.check_flower_internals()
    flower_compat.check_ray_internals()
    code = (
        "from fedavg import flower_compat\n"
        "flower_compat.patch_supernode(); flower_compat.patch_pull_backoff()\n"
        "flower_compat.disable_ray_auto_connect()\n"
        "from flwr.supernode import start_client_internal as sci, fleet_http_connection as f\n"
        "from flwr.supercore import heartbeat\n"
        "from flwr.supercore.inflatable import inflatable_utils as iu\n"
        "from ray._private import auto_init_hook\n"
        "import time\n"
        "t = time.monotonic(); sci.time.sleep(3); idle = time.monotonic() - t\n"
        "t = time.monotonic(); sci.time.sleep(0.5); wait = time.monotonic() - t\n"
        "assert idle < 1 and wait < 0.3, (idle, wait)\n"
        "assert sci.time.monotonic is time.monotonic\n"
        "assert f.HEARTBEAT_DEFAULT_INTERVAL == heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10\n"
        "for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):\n"
        "    d = fn.__kwdefaults__\n"
        "    assert (d['initial_backoff'], d['backoff_cap'], d['max_tries_per_object'],\n"
        "            d['max_time']) == (0.05, 0.2, None, 7200), d\n"
        "assert auto_init_hook.enable_auto_connect is False\n"
        "from flwr.supercore.retry import make_simple_http_retry_invoker\n"
        "waits = make_simple_http_retry_invoker().wait_gen_factory()\n"
        "delays = [next(waits) for _ in range(12)]  # Flower's: 1, 2, 4 ... then 20\n"
        "assert max(delays) == 4 and delays[:3] == [1, 2, 4], delays\n"
        "print('ok')\n"
    )
    # in a fresh interpreter: the patches are process-wide
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


#: Imports only the fedavg.flower_compat package may make (public flwr.app, flwr.serverapp,
#: flwr.clientapp, flwr.simulation, flwr.common.logger are fine anywhere).
PRIVATE = ("flwr.cli", "flwr.proto", "flwr.supercore", "flwr.supernode", "flwr.superlink",
           "flwr.common.serde", "flwr.common.constant", "ray._private")


def private_imports(path: Path) -> list[str]:
    """``file:line module`` for each import of a private Flower / Ray module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__"):
            names = [node.args[0].value]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {name}" for name in names
                  if any(name == p or name.startswith(p + ".") for p in PRIVATE)]
    return found


def test_only_flower_compat_imports_flower_internals():
    """No fedavg module outside fedavg/flower_compat/ imports private Flower or Ray modules."""
    package = Path(__file__).resolve().parents[2] / "fedavg"
    compat = package / "flower_compat"
    assert private_imports(compat / "tasks.py"), "the check itself finds nothing: it is broken"
    offenders = [hit for path in sorted(package.rglob("*.py")) if compat not in path.parents
                 for hit in private_imports(path)]
    assert not offenders, f"private Flower / Ray imports outside fedavg/flower_compat/: {offenders}"


def test_private_folders_go_even_when_their_process_was_killed():
    """A role's private folder goes with cleanup, with stop_all, and after a SIGKILL."""
    import signal
    import tempfile
    import uuid

    from fedavg.engines.deployment.processes import PrivateDir, stop_all

    prefix = f"fedavg-test-{uuid.uuid4().hex[:8]}-"
    code = ("import sys, time\nfrom fedavg.engines.deployment.processes import PrivateDir\n"
            f"d = PrivateDir({prefix!r}); print(d.name, flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        killed = Path(child.stdout.readline().strip())
        assert killed.is_dir()
        live = PrivateDir(prefix)  # the child still holds its lock: its folder stays
        assert killed.is_dir() and Path(live.name).is_dir()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        later = PrivateDir(prefix)  # the killed one's lock is free now: removed
        assert not killed.exists() and Path(live.name).is_dir()
        live.cleanup()
        stop_all()  # what the CLI's signal handlers call
        assert not Path(live.name).exists() and not Path(later.name).exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
    assert not list(Path(tempfile.gettempdir()).glob(f"{prefix}*"))


def test_fab_carries_the_run_config(tmp_path):
    """The submitted FAB names our ClientApp and carries the whole run config."""
    import tomllib
    from flwr.cli.build import build_fab_from_disk

    from fedavg.engines.deployment.coordinator import write_app

    config = RunConfig().replace(rounds=7, alpha=0.3, partitioner="dirichlet", lr=0.02,
                                 save_node_models=True)
    app = write_app(tmp_path / "app", config)
    doc = tomllib.loads((app / "pyproject.toml").read_text())
    assert doc["tool"]["flwr"]["app"]["components"]["clientapp"] \
        == "fedavg.node.deployed:client_app"
    assert RunConfig.from_flat(doc["tool"]["flwr"]["app"]["config"]) == config
    assert build_fab_from_disk(app)[:2] == b"PK"  # a FAB is a zip archive


def test_node_partition_matches_simulate(tmp_path):
    """`fedavg node --partition-id i` trains on the partition `fedavg simulate` gives node i."""
    import numpy as np

    from fedavg.node.deployed import node_arrays
    from fedavg.run.lifecycle import prepare

    config = RunConfig().replace(partitioner="dirichlet", alpha=0.5, num_nodes=3, seed=4)
    import json

    x, y, classes, _ = node_arrays("digits", 1, 3, json.dumps(config.to_flat()))
    prepared = prepare(config)
    idx = prepared.parts[1]
    assert np.array_equal(x, prepared.data.train.x[idx])
    assert np.array_equal(y, prepared.data.train.y[idx])
    assert classes == prepared.data.classes
    with pytest.raises(UserError, match="outside 0..2"):
        node_arrays("digits", 3, 3, json.dumps(config.to_flat()))


@pytest.mark.parametrize("args, words", [
    (["coordinator", "--rounds", "1"], "TLS is on by default"),
    (["coordinator", "--insecure", "--certs", "."], "either --certs or --insecure"),
    (["coordinator", "--certs", "/nonexistent"], "--certs /nonexistent: no such folder; make "
                                                  "one with `fedavg certs /nonexistent`"),
    (["coordinator", "--insecure", "--address", "localhost"], "is not host:port"),
    (["coordinator", "--insecure", "--min-nodes", "0"], "--min-nodes must be at least 1"),
    (["coordinator", "--insecure", "--min-nodes", "2", "--min-nodes-per-round", "3"],
     "--min-nodes-per-round must be in 1..--min-nodes (2)"),
    (["coordinator", "--insecure", "--alpha", "0", "--partitioner", "dirichlet"], "alpha"),
    (["node", "--insecure", "--partition-id", "1"], "--partition-id and --num-partitions"),
    (["node", "--insecure", "--partition-id", "3", "--num-partitions", "3"], "0..2"),
    (["node", "--insecure", "--dataset", "/no/such/data"], "does not exist"),
    (["node", "--insecure", "--dataset", "no-such-user/no-such-data"],
     "unknown dataset 'no-such-user/no-such-data'"),
    (["node", "--insecure", "--device", "cuda:1"], "cuda"),
    (["node", "--insecure", "--gpus", "0,1"], "--gpus lists GPU 0 but this machine has 0"),
    (["node", "--certs", "/nonexistent"], "no such folder"),
    (["node", "--certs", "/"], "--certs / lacks ca.crt"),
    (["node", "--certs", "/etc/passwd"],  # the CA certificate file, say, not its folder
     "--certs takes a folder (made by `fedavg certs DIR`), not the file /etc/passwd: pass "
     "--certs /etc"),
    (["coordinator", "--certs", "/etc/passwd"], "not the file /etc/passwd"),
    (["certs", "/dev/null/x"], "cannot create /dev/null/x"),
    (["certs", "out", "--nodes", "-1"], "--nodes must be in 0..10000, got -1"),
    (["certs", "out", "--nodes", "100000000"], "--nodes must be in 0..10000, got 100000000"),
    (["certs", "out", "--host", "a:9092"], "is not a host name or an IP address"),
    (["certs", "out", "--host", "bad host!"], "is not a host name or an IP address"),
    (["certs", "out", "--host", "1.2.3.999"], "--host '1.2.3.999' is not a valid IP address"),
    (["coordinator", "--insecure", "--min-nodes", "2", "--min-nodes-per-round", "0"],
     "--min-nodes-per-round must be in 1..--min-nodes (2), got 0"),
    (["node", "--insecure", "--max-wait-time", "-1"], "--max-wait-time must be > 0"),
    (["node", "--insecure", "--max-wait-time", "nan"], "--max-wait-time must be > 0"),
    (["coordinator", "--insecure", "--wait-timeout", "nan"], "--wait-timeout must be > 0"),
    (["node", "--insecure", "--coordinator", "http://127.0.0.1:9092"],
     "'http://127.0.0.1' is not a host name or an IP address (no scheme, port or spaces)"),
    (["node", "--insecure", "--coordinator", "127.0.0.1:9092 "], "is not host:port"),
    (["node", "--insecure", "--threads", "0"],
     f"--threads must be in 1..{os.cpu_count()} (this machine's CPU cores), got 0"),
    (["node", "--insecure", "--threads", "100000"], "got 100000"),
    (["node", "--insecure", "--gpus", "0", "--threads", "0"], "--threads must be in 1.."),
    (["coordinator", "--insecure", "--dp-sgd", "--dp-noise", "1", "--dp-epsilon", "3"],
     "--dp-epsilon with --dp-sgd: the coordinator cannot tell what a round spends"),
])
def test_deployment_user_errors_are_one_line(args, words):
    """Bad coordinator / node / certs options: exit 2 with one line, no traceback."""
    res = run_cli(*args, check=False, timeout=120, env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert words in res.stderr and "connecting" not in res.stdout
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 3


def test_bad_keys_certificates_and_ports_are_one_line(tmp_path):
    """Wrong keys, bad certificates and a busy port: exit 2, one line, nothing written."""
    import shutil
    import socket

    from fedavg.engines.deployment.certs import make_certs
    from fedavg.engines.deployment.processes import free_port

    good = tmp_path / "good"
    make_certs(good, nodes=1)
    port = free_port()
    cases = [
        (["coordinator", "--certs", good, "--auth-keys", good / "node-0.key"],
         "is not an OpenSSH public key"),
        (["node", "--certs", good, "--auth-key", good / "node-0.pub"],
         "is not a node private key"),
        (["node", "--certs", good, "--auth-key", good / "ca.key"], "is not a node private key"),
    ]
    bad_cert = tmp_path / "bad_cert"
    shutil.copytree(good, bad_cert)
    (bad_cert / "coordinator.crt").write_text("not a certificate\n")
    cases.append((["coordinator", "--certs", bad_cert], "coordinator.crt is not a PEM certificate"))
    for name, body in (("junk", b"junk\n"), ("key", (good / "ca.key").read_bytes()),
                       ("cut", (good / "ca.crt").read_bytes()[:300])):
        bad_ca = tmp_path / f"bad_ca_{name}"  # a SuperNode hung, silent, on each of these
        bad_ca.mkdir()
        (bad_ca / "ca.crt").write_bytes(body)
        cases.append((["node", "--certs", bad_ca, "--once", "--max-wait-time", "5"],
                      f"{bad_ca / 'ca.crt'} is not a PEM certificate: copy the ca.crt"))
    other = tmp_path / "other"
    make_certs(other)
    mismatch = tmp_path / "mismatch"
    shutil.copytree(good, mismatch)
    shutil.copy(other / "coordinator.key", mismatch / "coordinator.key")
    cases.append((["coordinator", "--certs", mismatch], "is not the key of"))
    with socket.socket() as busy:  # another program holds the port
        busy.bind(("127.0.0.1", port))
        busy.listen()
        cases.append((["coordinator", "--insecure", "--address", f"127.0.0.1:{port}",
                       "--output", tmp_path / "never"], "is in use"))
        for args, words in cases:
            res = run_cli(*args, "--rounds", "1", check=False, timeout=120) \
                if args[0] == "coordinator" else run_cli(*args, check=False, timeout=120)
            assert res.returncode == 2, (args, res.stdout, res.stderr)
            assert words in res.stderr, (args, res.stderr)
            assert "Traceback" not in res.stderr
    assert not (tmp_path / "never").exists()  # a coordinator that could not start wrote nothing


def test_superlink_refusals_are_one_line():
    """The SuperLink's refusal lines (a whole PEM key each) become one readable line."""
    from fedavg.flower_compat import superlink_node_refusal

    head = "ERROR :     [/v1/fleet/activate-node][ApiError:{}] Attempted to register SuperNode " \
           "with public key: b'-----BEGIN PUBLIC KEY-----\\nMHYwEAYHKoZIzj0CAQYFK4EEACIDYgAE\\n" \
           "-----END PUBLIC KEY-----\\n'"
    in_use = superlink_node_refusal(head.format(2004) + ", exception: SuperNode with node ID "
                                    "123 could not be activated.")
    assert in_use == ("refused a node whose key is already in use by connected node 123: give "
                      "each node its own key (node-<i>.key from `fedavg certs --nodes N`)")
    unknown = superlink_node_refusal(head.format(2004) + ", exception: No SuperNode found with "
                                     "the given public key.")
    assert unknown == "refused a node whose key is not in --auth-keys"
    assert "without a key" in superlink_node_refusal(
        head.format(2001).replace("activate-node", "register-node"))
    assert superlink_node_refusal(head.format(2003) + ", exception: Heartbeat interval 0.0 is "
                                  "out of bounds [10, 1800].") == ""  # a node's key check
    assert superlink_node_refusal("ERROR : [Errno 98] address already in use") is None


def _node(tmp_path, once):
    """Make a node (no SuperNode started) whose messages go to a list."""
    from fedavg.engines.deployment.node import _Node

    said = []
    node = _Node("127.0.0.1:9", [], None, None, once, None, said.append, tmp_path)
    node.finished_runs, node.failed_runs = set(), {}
    return node, said


RETRY = "WARNING :   Connection attempt failed, retrying in 0.08 seconds"


def test_a_serving_node_waits_quietly_after_a_run(tmp_path):
    """Unreachable before a run: said; after a run ended: said once, then quiet until back."""
    node, said = _node(tmp_path, once=False)
    node.on_line(RETRY)
    assert said == ["[yellow]node:[/] cannot reach the coordinator at 127.0.0.1:9; "
                    "retrying in 0.1 s"]
    said.clear()
    node.runs, node.finished_runs = {7, 8}, {7}
    node.failed_runs[8] = "round 1: no usable model from any node (node 3: UserError: shape)"
    assert node.finished() is False and not node.runs
    assert said == ["run 7 finished; waiting for the next run",
                    "run 8 failed: round 1: no usable model from any node (node 3: UserError: "
                    "shape); waiting for the next run"]
    said.clear()  # then quiet until the node is connected again
    for line in (RETRY, "INFO : Connection successful after 3.45 seconds and 4 tries.",
                 "ERROR : The SuperNode could not establish a connection to the SuperLink."):
        node.on_line(line)
    assert said == []
    node.on_line("INFO :      SuperNode ID: 42")
    node.on_line(RETRY)
    node.on_line(RETRY)  # connected once: the loss is said once, not at every retry
    assert said == ["connected to 127.0.0.1:9 as node [bold]42[/]",
                    "[yellow]node:[/] lost the coordinator at 127.0.0.1:9; retrying until it "
                    "is back"]
    node.on_line("INFO : Connection successful after 3.45 seconds and 4 tries.")
    node.on_line(RETRY)  # back, then lost again: said again
    assert said[-1].startswith("[yellow]node:[/] lost the coordinator") and len(said) == 4
    once, told = _node(tmp_path, once=True)
    once.on_line("INFO :      SuperNode ID: 43")
    once.on_line(RETRY)
    assert told[-1] == "[yellow]node:[/] lost the coordinator at 127.0.0.1:9; retrying for " \
        "up to 30 s"


def test_a_once_node_exits_with_the_reason_of_a_failed_run(tmp_path, monkeypatch):
    """--once: a finished run ends the node; a failed one raises RunError with the reason."""
    from fedavg.engines.deployment import node as node_module
    from fedavg.util.errors import RunError

    monkeypatch.setattr(node_module.time, "sleep", lambda s: None)
    node, said = _node(tmp_path, once=True)
    node.runs, node.finished_runs = {7}, {7}
    assert node.finished() is True and said == ["run 7 finished; exiting (--once)"]
    node.runs, node.failed_runs = {8}, {8: "round 1: only 0 usable model(s)"}
    with pytest.raises(RunError, match=r"^round 1: only 0 usable model\(s\)$"):
        node.finished()


def test_a_key_already_connected_is_said_in_one_line(tmp_path, monkeypatch):
    """Flower refuses an unknown key and one in use alike; the node asks which it was."""
    import types

    from fedavg import flower_compat

    node, said = _node(tmp_path, once=False)
    node.certs, node.auth_key = tmp_path, tmp_path / "node-0.key"
    for registered, words in ((True, "a node with this key is already connected to 127.0.0."
                                     "1:9: give each node its own key (node-<i>.key from "
                                     "`fedavg certs --nodes N`)"),
                              (False, "refused by 127.0.0.1:9: the coordinator refused this "
                                      "node's key")):
        monkeypatch.setattr(flower_compat, "node_key_registered", lambda *a, r=registered: r)
        node._reset()
        node.key_retries = 3  # no more "may still be starting" retries
        node.key_in_use_since = time.monotonic() - 60  # refused as in use for a minute
        node.proc = types.SimpleNamespace(lines=[], stop=lambda: None, alive=lambda: False,
                                          returncode=lambda: 1)
        node.on_line("ERROR : [code: 2004] Failed to activate SuperNode.")
        node.on_line("ERROR : The SuperNode could not establish a connection to the SuperLink.")
        assert said == []  # the refusal is said once, by handle_stop
        with pytest.raises(UserError) as err:
            node.handle_stop()
        assert str(err.value).startswith(words), str(err.value)


@pytest.mark.parametrize("returncode, words", [
    (-9, "this node's SuperNode process was killed (SIGKILL) during the run"),
    (1, "lost the coordinator at 127.0.0.1:9 during the run"),  # it left: the coordinator went
])
def test_a_killed_supernode_is_not_blamed_on_the_coordinator(tmp_path, returncode, words):
    import types

    from fedavg.util.errors import RunError

    node, _ = _node(tmp_path, once=True)
    node.on_line("INFO : SuperNode ID: 42")
    node.proc = types.SimpleNamespace(lines=[], stop=lambda: None, alive=lambda: False,
                                      returncode=lambda: returncode)
    with pytest.raises(RunError) as err:
        node.handle_stop()
    assert str(err.value) == words


def test_a_key_refused_before_the_coordinator_registered_it_is_tried_again(tmp_path,
                                                                             monkeypatch):
    """Refused, then registered: one more try at once; refused again: tried for a while.

    The key may be a node's that just stopped (KEY_IN_USE_WAIT_S); then in use, one line.
    """
    import types

    from fedavg import flower_compat
    from fedavg.engines.deployment import node as node_module
    from fedavg.engines.deployment import supernode

    node, said = _node(tmp_path, once=False)
    node.certs, node.auth_key = tmp_path, tmp_path / "node-0.key"
    monkeypatch.setattr(flower_compat, "node_key_registered", lambda *a: True)
    starts, slept = [], []
    monkeypatch.setattr(node, "start_supernode", lambda: starts.append(1))
    monkeypatch.setattr(node_module.time, "sleep", slept.append)

    def refused():
        node._reset()
        node.proc = types.SimpleNamespace(lines=[], stop=lambda: None, alive=lambda: False,
                                          returncode=lambda: 1)
        node.on_line("ERROR : [code: 2004] Failed to activate SuperNode.")
        node.on_line("ERROR : The SuperNode could not establish a connection to the SuperLink.")

    refused()
    node.handle_stop()  # registered only now: not in use, the SuperNode starts again at once
    assert starts == [1] and said == [] and slept == []
    node.on_line("INFO : SuperNode ID: 42")  # it got in: a later refusal starts afresh
    assert node.connected and said == ["connected to 127.0.0.1:9 as node [bold]42[/]"]
    refused()
    node.handle_stop()
    assert starts == [1, 1] and slept == []
    for _ in range(2):  # a node that stopped a moment ago may still hold the key: wait
        refused()
        node.handle_stop()
    assert starts == [1, 1, 1, 1] and slept == [2.0, 2.0]
    assert len(said) == 2 and "still holds this node's key as connected" in said[1] \
        and "let go within 20 s); waiting up to 40 s" in said[1]
    node.key_in_use_since -= supernode.KEY_IN_USE_WAIT_S  # still refused after the wait
    refused()
    with pytest.raises(UserError, match="a node with this key is already connected"):
        node.handle_stop()
    assert len(starts) == 4


def test_a_failed_run_tells_the_nodes_why(tmp_path, monkeypatch, task_identity):
    """The coordinator's failure reaches each node's ClientApp as run-failed + the reason."""
    import types

    from flwr.app import Context, RecordDict

    from fedavg.node import deployed as apps
    from fedavg.run import server_app as coordinator
    from fedavg.run.lifecycle import RunState
    from fedavg.util.errors import RunError

    class Grid:  # each message goes to a node's ClientApp, which acknowledges it
        get_node_ids = staticmethod(lambda: [5])
        push_messages = staticmethod(lambda msgs: [apps._query(m, None) and "m0" for m in msgs])
        pull_messages = staticmethod(lambda ids: [types.SimpleNamespace(
            metadata=types.SimpleNamespace(reply_to_message_id=i)) for i in ids])

    def fail(self, grid):
        raise RunError("round 1: only 0 usable model(s)\nmore text")

    monkeypatch.setattr(coordinator.ServerRun, "__call__", fail)
    state = RunState()
    app = coordinator.make_server_app(RunConfig(), None, tmp_path, state,
                                      deployment=coordinator.Deployment(1, 1.0, 1))
    with pytest.raises(RunError):
        app(Grid(), Context(1, 0, {}, RecordDict(), {}))
    assert isinstance(state.error, RunError) and 1 not in apps.FINISHED_RUNS
    assert apps.FAILED_RUNS.pop(1) == "round 1: only 0 usable model(s)"
    assert coordinator.failure_reason(ValueError("bad\nvalue")) == "ValueError: bad"


def test_verbose_coordinator_shows_every_superlink_line():
    from fedavg.engines.deployment.coordinator import _superlink_echo

    quiet, loud = [], []
    for said, verbose in ((quiet, False), (loud, True)):
        echo = _superlink_echo(said.append, verbose)
        echo("INFO :      Starting Flower SuperLink")
        echo("ERROR :     something broke")
    assert len(quiet) == 1 and "something broke" in quiet[0]
    assert len(loud) == 2 and "Starting Flower SuperLink" in loud[0]


def test_a_tls_mismatch_is_told_apart_from_an_absent_coordinator(tmp_path):
    import socket
    import ssl
    import threading

    from fedavg.engines.deployment.certs import make_certs
    from fedavg.engines.deployment.processes import free_port
    from fedavg.engines.deployment.tls import speaks_tls, tls_mismatch

    make_certs(tmp_path / "c")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "c" / "coordinator.crt", tmp_path / "c" / "coordinator.key")

    def serve(sock, tls):
        conn, _ = sock.accept()
        try:
            if tls:
                context.wrap_socket(conn, server_side=True).close()
            else:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    for tls in (True, False):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            thread = threading.Thread(target=serve, args=(server, tls), daemon=True)
            thread.start()
            assert speaks_tls("127.0.0.1", port) is tls
            thread.join(5)
    assert speaks_tls("127.0.0.1", free_port()) is None  # nobody there: keep retrying
    assert tls_mismatch("127.0.0.1", free_port(), insecure=True) is None


def test_a_refused_certificate_says_whether_its_signer_or_its_name_is_wrong(tmp_path):
    """The node's TLS refusal named both causes; it now says which, and the names held."""
    import socket
    import ssl
    import threading

    from fedavg.engines.deployment.certs import make_certs
    from fedavg.engines.deployment.tls import certificate_problem

    make_certs(tmp_path / "c")
    make_certs(tmp_path / "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "c" / "coordinator.crt", tmp_path / "c" / "coordinator.key")

    def serve(sock):
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed: the test is over
                return
            try:
                context.wrap_socket(conn, server_side=True).close()
            except (OSError, ssl.SSLError):
                pass
            finally:
                conn.close()

    ca, other = tmp_path / "c" / "ca.crt", tmp_path / "other" / "ca.crt"
    for ip in ("127.0.0.1", "127.0.0.2"):  # the second is loopback too, not in the certificate
        with socket.socket() as server:
            server.bind((ip, 0))
            server.listen()
            port = server.getsockname()[1]
            threading.Thread(target=serve, args=(server,), daemon=True).start()
            if ip == "127.0.0.1":
                assert certificate_problem(ip, port, ca) is None
                assert certificate_problem("localhost", port, ca) is None
                assert certificate_problem(ip, port, other) == (
                    f"the coordinator's TLS certificate is not signed by {other}: use the "
                    "ca.crt of the coordinator's `fedavg certs` folder")
            else:
                said = certificate_problem(ip, port, ca)
                assert said.startswith("the coordinator's TLS certificate names localhost, ")
                assert said.endswith(", 127.0.0.1, ::1, not 127.0.0.2: dial one of those, or "
                                     "remake its certificates with `fedavg certs DIR --host "
                                     "127.0.0.2` (the nodes then need the new ca.crt)")
            server.shutdown(socket.SHUT_RDWR)
    assert certificate_problem("127.0.0.1", port, ca) is None  # nobody there: no finding


@pytest.mark.parametrize("tls, insecure, words", [
    (True, True, "uses TLS: pass --certs DIR (holding its ca.crt) instead of --insecure"),
    (False, False, "does not use TLS: pass --insecure on the node, or start the coordinator "
                   "with --certs")])
def test_a_tls_mismatch_also_says_the_address_may_be_wrong(monkeypatch, tls, insecure, words):
    """Another server at that address (an HTTPS or HTTP one) looks like a TLS mismatch."""
    from fedavg.engines.deployment import tls as module

    monkeypatch.setattr(module, "speaks_tls", lambda host, port: tls)
    assert module.tls_mismatch("10.0.0.9", 9092, insecure=insecure) == (
        f"the coordinator at 10.0.0.9:9092 {words}; if no fedavg coordinator listens there, "
        "fix --coordinator")
    assert module.tls_mismatch("10.0.0.9", 9092, insecure=not insecure) is None


class _SlowNodesGrid:
    """A Grid whose nodes never acknowledge: records when each pull happens."""

    def __init__(self):
        self.pulls: list[float] = []

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        import time

        time.sleep(0.2)  # a slow SuperLink: the acknowledgements' own deadline starts later
        return [f"id-{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        import time

        self.pulls.append(time.monotonic())
        return []


def test_the_end_of_run_announcement_makes_no_call_after_it_returns(task_identity):
    """A pull after the task is finished (its token void) makes Flower SIGINT the coordinator."""
    import time

    from fedavg.run.server_app import announce_end

    grid = _SlowNodesGrid()
    started = time.monotonic()
    announce_end(grid, wait_s=1.0)
    returned = time.monotonic()
    time.sleep(0.5)
    assert grid.pulls, "the acknowledgements were never polled"
    assert 0.95 <= returned - started < 5.0  # at most 2 x wait_s, with room for a busy machine
    assert max(grid.pulls) < returned


def test_a_once_nodes_wait_for_a_lost_coordinator_is_max_wait_time_or_30_s(tmp_path):
    from fedavg.engines.deployment.node import _Node
    from fedavg.engines.deployment.supernode import LOST_AFTER_S

    def node(max_wait_time):
        return _Node("127.0.0.1:9092", [], None, None, True, max_wait_time, print, tmp_path)

    assert LOST_AFTER_S == 30.0 and node(None).lost_after_s == 30.0
    assert node(5.0).lost_after_s == 5.0


def test_a_connection_attempt_that_hangs_gives_up_near_max_wait_time(tmp_path):
    """The node stops waiting 5 s past --max-wait-time, counted from the SuperNode's start.

    Flower checks the limit between attempts only, and an attempt on a server that accepts
    and never answers hangs 30 s (65 s for 10, measured).
    """
    from fedavg.engines.deployment.node import _Node

    node = _Node("127.0.0.1:9092", [], None, None, False, 10.0, print, tmp_path)
    assert node._overdue() is None  # no SuperNode yet
    node.on_line("INFO :      Starting Flower SuperNode")
    assert node._overdue() is None  # just started
    node.connecting_since -= 14.0
    assert node._overdue() is None  # within 10 s + 5 s
    node.connecting_since -= 2.0
    assert node._overdue() == ("could not reach the coordinator at 127.0.0.1:9092 within "
                               "--max-wait-time 10 s")
    node.connected = True  # connected in time: the limit is for reaching it
    assert node._overdue() is None
    unlimited = _Node("127.0.0.1:9092", [], None, None, False, None, print, tmp_path)
    unlimited.on_line("INFO :      Starting Flower SuperNode")
    unlimited.connecting_since -= 3600.0
    assert unlimited._overdue() is None  # without --max-wait-time: retry for ever


class _HeartbeatClient:
    """A runtime client whose heartbeat answers ``success`` or raises ``error``."""

    def __init__(self, success=True, error=None):
        self.success, self.error, self.calls = success, error, 0

    def SendTaskHeartbeat(self, request):  # noqa: N802 - Flower's method name
        """Answer one heartbeat."""
        from types import SimpleNamespace

        self.calls += 1
        if self.error is not None:
            raise self.error
        return SimpleNamespace(success=self.success)


def test_a_void_task_never_interrupts_a_warm_node(monkeypatch):
    """Flower's own heartbeat and retry code SIGINT the process; a warm node must go on."""
    import signal

    import httpx

    from fedavg.flower_compat import tasks

    interrupted = []
    monkeypatch.setattr(signal, "raise_signal", lambda sig: interrupted.append(sig))
    monkeypatch.setattr(os, "kill", lambda pid, sig: interrupted.append(sig))
    beat = tasks._task_heartbeat_fn(_HeartbeatClient(success=False))
    assert beat() is True  # the SuperNode no longer knows the task: not retried, no SIGINT
    refused = tasks._task_heartbeat_fn(_HeartbeatClient(error=httpx.ConnectError("gone")))
    assert refused() is False  # unreachable: Flower's sender retries
    request = httpx.Request("POST", "http://127.0.0.1:1/flwr.proto.ClientAppIo/PushMessage")
    void = httpx.HTTPStatusError("401", request=request,
                                 response=httpx.Response(401, request=request))
    endpoint = tasks.Endpoint("127.0.0.1:1")
    client = tasks._runtime_client(endpoint, [], tries=2, seconds=1.0)
    try:
        assert client._retry_invoker.should_giveup(void) is True
    finally:
        client.close()
    assert interrupted == []


def test_a_runtime_api_that_answers_401_fails_the_call_instead_of_interrupting(monkeypatch):
    """A task source polling a port now held by another process (another secret): 401.

    Flower's retry invoker SIGINTs its own process on a 401; a node restarting its SuperNode
    (a held key) stopped with "node stopped" when the old runtime API's port was taken.
    """
    import http.server
    import signal
    import threading

    import httpx

    from fedavg.flower_compat import tasks

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's method name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class Interrupted(Exception):
        pass

    def kill(pid, sig):
        raise Interrupted(sig)  # Flower's SIGINT, made visible (and no 11 s sleep after it)

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(signal, "raise_signal", kill)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unauthorized)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        source = tasks.TaskSource(tasks.Endpoint(f"127.0.0.1:{server.server_port}", None,
                                                 b"secret"), tasks.CLIENT_TASK)
        try:
            with pytest.raises(httpx.HTTPStatusError, match="401"):
                source.acquire()
        finally:
            source.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_flower_log_folder_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    """FEDAVG_FLOWER_LOG naming a missing folder (or a file) was a FileNotFoundError."""
    from fedavg.engines.deployment.processes import FlowerProcess

    (tmp_path / "file").write_text("")
    for where, why in ((tmp_path / "gone", "No such file or directory"),
                       (tmp_path / "file", "Not a directory")):
        monkeypatch.setenv("FEDAVG_FLOWER_LOG", str(where))
        with pytest.raises(UserError, match=f"^FEDAVG_FLOWER_LOG={where}: {why}; give an "
                                            "existing folder or unset it$"):
            FlowerProcess("superlink", ["--help"], dict(os.environ))


def test_an_end_notice_acknowledged_too_late_is_not_a_failed_task(tmp_path, monkeypatch):
    """A node's acknowledgement of the run's end that cannot be delivered is no failure.

    Under load the coordinator may stop waiting for acknowledgements of its end notice
    (``announce_end``) before a node's arrives; the node's push then fails. The run's work
    was delivered before: a ``--once`` node exits 0. A train reply that is lost still counts.
    """
    from types import SimpleNamespace

    from fedavg import flower_compat
    from fedavg.engines.deployment import node as node_module

    monkeypatch.setattr(node_module.time, "sleep", lambda s: None)
    node, said = _node(tmp_path, once=True)
    node.proc, node.endpoint = SimpleNamespace(alive=lambda: True), None
    undelivered = f"{flower_compat.UNDELIVERED} (ObjectPushError)"
    answers = iter([None, undelivered])  # a train round delivered, then the end notice

    def task(endpoint, token, app):
        if token == "end":
            node.finished_runs.add(7)  # as the app notes the end notice
        return next(answers)

    monkeypatch.setattr(flower_compat, "run_client_task", task)
    node.run_task("train", SimpleNamespace(run_id=7))
    node.run_task("end", SimpleNamespace(run_id=7))
    assert node.tasks == 2 and node.task_failures == []
    assert node.finished() is True and said[-1] == "run 7 finished; exiting (--once)"
    node.finished_runs.clear()  # a train reply lost before the end: a failed task
    monkeypatch.setattr(flower_compat, "run_client_task", lambda *a: undelivered)
    node.run_task("train", SimpleNamespace(run_id=8))
    assert node.task_failures == [undelivered]


def test_a_node_says_which_device_auto_stands_for():
    import torch

    from fedavg.engines.deployment.node_options import NodeOptions

    here = "cuda" if torch.cuda.is_available() else "cpu"
    line = NodeOptions(partition_id=0, num_partitions=2).describe(1, None, "127.0.0.1:9092",
                                                                  tls=True)
    assert f", device auto ({here}), 1 CPU thread(s)" in line
    line = NodeOptions(device="cpu").describe(2, None, "127.0.0.1:9092", tls=False)
    assert ", device cpu, 2 CPU thread(s)" in line and line.endswith("(NO TLS)")


def test_node_options_are_declared_once_and_round_trip_through_the_command_line(tmp_path):
    """``fedavg node``'s options come from NodeOptions; a GPU node's command line parses back."""
    import dataclasses

    import typer

    from fedavg.cli.app import app
    from fedavg.engines.deployment.node_options import NodeOptions

    command = typer.main.get_command(app).commands["node"]
    flags = {p.name for p in command.params} - {"gpus", "help"}
    assert flags == {f.name for f in dataclasses.fields(NodeOptions)}
    chosen = NodeOptions(partition_id=1, num_partitions=4, insecure=True, max_wait_time=5.0,
                         certs=tmp_path, threads=1)
    args = chosen.command_line()
    assert args == ["--partition-id", "1", "--num-partitions", "4", "--certs", str(tmp_path),
                    "--insecure", "--max-wait-time", "5.0", "--threads", "1"]
    parsed = command.make_context("node", list(args)).params
    assert NodeOptions(**{k: v for k, v in parsed.items() if k != "gpus"}) == chosen


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
    subprocess.run([sys.executable, "-m", "fedavg.cli", "certs", str(folder), "--nodes", "2"],
                   check=True, capture_output=True)
    return folder


def misfit_data(folder):
    """Write a CSV that does not fit the digits model (10 features; it takes 8x8 images)."""
    bad = folder / "bad.csv"
    rng = np.random.default_rng(0)
    rows = [",".join([f"f{i}" for i in range(10)] + ["label"])]
    rows += [",".join(f"{v:.3f}" for v in rng.random(10)) + f",{i % 3}" for i in range(60)]
    bad.write_text("\n".join(rows) + "\n")
    return bad


@pytest.mark.e2e
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
    ev = subprocess.run([sys.executable, "-m", "fedavg.cli", "evaluate", str(out), "--json"],
                        capture_output=True, text=True, check=True)
    assert json.loads(ev.stdout)["accuracy"] == pytest.approx(rounds[-1]["accuracy"])
    # every node trained its own partition in every round and then left (--once)
    for n in nodes:
        assert "node done: 4 task(s) run (the run's end notice is one)" in cluster.log(n.name)
    # --threads: node0 trains on one thread, the others on torch's default (one per core)
    assert ", 1 CPU thread(s)" in cluster.log("node0")
    assert not any("Warning" in cluster.log(name) for name in ("coordinator", "node0", "node1"))
    assert re.search(r", \d+ CPU thread\(s\)", cluster.log("node1"))


@pytest.mark.e2e
def test_lora_adapters_across_machines_over_tls(cluster, certs, tmp_path):
    """LoRA on a saved Hugging Face model: nodes build the base themselves, send adapters."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageClassification, ViTConfig

    folder = tmp_path / "vit"  # a "pretrained" base: weights in model.safetensors
    AutoModelForImageClassification.from_config(ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_channels=3)).save_pretrained(folder)
    out = tmp_path / "run"
    two_rounds_on_two_nodes(cluster, certs, out, "--model", f"hf:{folder}", "--lora-rank", "2",
                            "--lr", "0.1")
    assert "(TLS)" in cluster.log("coordinator")
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["lora"]["targets"] in (["query", "value"], ["q_proj", "v_proj"])
    saved = load_file(out / "model.safetensors")
    assert all(".lora_" in k or ".classifier." in k or k.endswith("base_layer.weight")
               for k in saved), sorted(saved)
    rounds = rounds_of(out)
    assert [r["num_nodes"] for r in rounds] == [2, 2]
    # up: adapters + head; down the same in round 1 (each node builds the base), then with
    # the low-rank update of the adapted weights beside them
    assert 0 < rounds[0]["bytes_to_nodes"] == rounds[0]["bytes_from_nodes"], rounds
    assert rounds[1]["bytes_to_nodes"] > rounds[1]["bytes_from_nodes"] > 0, rounds
    ev = subprocess.run([sys.executable, "-m", "fedavg.cli", "evaluate", str(out), "--json"],
                        capture_output=True, text=True, check=True)
    assert json.loads(ev.stdout)["accuracy"] == pytest.approx(rounds[-1]["accuracy"])


@pytest.mark.e2e
def test_node_killed_in_round_two_run_still_finishes(cluster, tmp_path):
    """A node SIGKILLed mid-run: its round and the rest finish with the other two."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "4", "--min-nodes", "3", "--insecure",
                                "--local-epochs", "20", "--output", out)
    nodes = [cluster.node(f"node{i}", "--insecure", "--partition-id", i,
                          "--num-partitions", 3, "--once") for i in range(3)]
    deadline = time.monotonic() + within(180)
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_node_training_error_reported_within_seconds(cluster, tmp_path):
    """A node's training error reaches the coordinator at once, with the node's message."""
    bad = misfit_data(tmp_path)
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--min-nodes-per-round",
                                "1", "--insecure", "--output", out)
    good = cluster.node("good", "--insecure", "--once")
    misfit = cluster.node("bad", "--insecure", "--dataset", bad, "--once")
    deadline = time.monotonic() + within(120)
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_wrong_certificate_and_unknown_key_are_refused(cluster, certs, tmp_path):
    """Wrong CA, unknown key, no key, no TLS: exit 2 with the reason; a known key runs."""
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "fedavg.cli", "certs", str(other), "--nodes", "1"],
                   check=True, capture_output=True)
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "1", "--certs", certs,
                                "--auth-keys", certs / "authorized-nodes.pub",
                                "--output", out, "--wait-timeout", "300")
    deadline = time.monotonic() + within(180)  # four nodes start at once
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


@pytest.mark.e2e
def test_too_few_nodes_fails_after_wait_timeout(cluster, tmp_path):
    """Too few nodes: exit 1 after --wait-timeout with one clear line."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "1", "--min-nodes", "2", "--insecure",
                                "--wait-timeout", "3", "--output", out)
    assert cluster.wait(coord, 120) == 1
    text = cluster.log("coordinator")
    assert "0 of 2 nodes connected before round 1 after 3 s" in text
    assert "Traceback" not in text


@pytest.mark.e2e
def test_a_coordinator_whose_superlink_dies_fails_at_once(cluster, tmp_path):
    """It waited for ever (Flower's retries), mid-run and while waiting for nodes."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    cluster.node("node", "--insecure")
    deadline = time.monotonic() + within(120)
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    link = next(int(p.split(":")[0]) for p in cluster_processes(cluster.tag)
                if "deployment.launch superlink" in p)
    os.kill(link, signal.SIGKILL)
    assert cluster.wait(coord, 60) == 1, cluster.log("coordinator")
    text = cluster.log("coordinator")
    assert "run failed: the SuperLink process was killed (SIGKILL) during the run; finished " \
           f"rounds are kept in {out}; resume with: fedavg coordinator" in text, text
    assert "Traceback" not in text and (out / "model.safetensors").exists()


# SIGINT takes the same handler (tests/cli/test_cli.py); tests/e2e/test_e2e.py sends it to a
# simulation
@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signals_stop_every_flower_process(cluster, tmp_path, sig):
    """Ctrl-C / SIGTERM stop coordinator and node with exit 130 and no process left."""
    out = tmp_path / "run"
    coord = cluster.coordinator("--rounds", "50", "--min-nodes", "1", "--insecure",
                                "--local-epochs", "5", "--output", out)
    node = cluster.node("node", "--insecure")
    deadline = time.monotonic() + within(120)
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and coord.poll() is None, cluster.log("coordinator")
        time.sleep(0.2)
    assert any("fedavg.engines.deployment.launch" in p for p in cluster_processes(cluster.tag))
    coord.send_signal(sig)
    assert cluster.wait(coord, 30) == 130, cluster.log("coordinator")
    assert "interrupted: finished rounds are kept" in cluster.log("coordinator")
    assert node.poll() is None  # a node outlives a run and serves the next one
    node.send_signal(sig)
    assert cluster.wait(node, 30) == 130, cluster.log("node")
    assert (out / "model.safetensors").exists()
    deadline = time.monotonic() + within(15)
    while cluster_processes(cluster.tag) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not cluster_processes(cluster.tag)


@pytest.mark.e2e
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


@pytest.mark.e2e
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
    deadline = time.monotonic() + within(120)
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_text_across_machines_and_a_node_with_images(cluster, tmp_path):
    """AG News over the deployment engine; a node holding images says so in one line."""
    from helpers.cli import SHARED_DATA

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



def two_rounds_on_two_nodes(cluster, certs, out, *options):
    """Run a coordinator (2 rounds, TLS, ``options``) and two --once nodes; all exit 0."""
    coord = cluster.coordinator("--rounds", "2", "--min-nodes", "2", "--certs", certs,
                                *options, "--output", out)
    nodes = [cluster.node(f"node{i}", "--certs", certs, "--partition-id", i,
                          "--num-partitions", 2, "--once") for i in range(2)]
    assert cluster.wait(coord) == 0, cluster.log("coordinator")
    for n in nodes:
        assert cluster.wait(n, 60) == 0, cluster.log(n.name)


@pytest.mark.e2e
def test_compressed_updates_across_machines(cluster, certs, tmp_path):
    """--compress int8 across machines: the coordinator receives a quarter of the bytes."""
    out = tmp_path / "run"
    two_rounds_on_two_nodes(cluster, certs, out, "--compress", "int8")
    rounds = rounds_of(out)
    assert [r["num_nodes"] for r in rounds] == [2, 2]
    for r in rounds:  # down: the model whole; up: int8 updates (the biases as they are)
        assert 0.2 < r["bytes_from_nodes"] / r["bytes_to_nodes"] < 0.3, r
    assert rounds[-1]["accuracy"] >= 0.8


@pytest.mark.e2e
def test_private_rounds_with_a_quantised_downlink_across_machines(cluster, certs, tmp_path):
    """Node-level DP and --compress-down int8 across machines.

    Epsilon after each round; the round's weights go out as a quarter of the bytes the nodes
    send back whole.
    """
    out = tmp_path / "run"
    two_rounds_on_two_nodes(cluster, certs, out, "--dp-noise", "0.5", "--dp-clip", "5",
                            "--compress-down", "int8")
    rounds = rounds_of(out)
    assert [r["num_nodes"] for r in rounds] == [2, 2]
    for r in rounds:  # down: int8 weights (the biases as they are); up: the models whole
        assert 0.24 < r["bytes_to_nodes"] / r["bytes_from_nodes"] < 0.3, r
    assert 0 < rounds[0]["epsilon"] < rounds[1]["epsilon"]
    summary = json.loads((out / "summary.json").read_text())
    model = json.loads((out / "model.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(rounds[1]["epsilon"])
    assert model["privacy"] == summary["privacy"] and model["privacy"]["rounds"] == 2
    assert "node-level DP" in cluster.log("coordinator")
