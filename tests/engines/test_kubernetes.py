"""The Kubernetes manifests, rendered offline (``kubectl kustomize``) and checked.

``fedavg kubernetes`` writes a run for 1, 4 and 16 nodes with each overlay; every rendered
object is validated against the Kubernetes schemas (``kubernetes-validate``, strict) and the
invariants below, each of which a broken manifest fails (the last tests break one on purpose).
What no test here can show without a cluster: that pods schedule, pull the image, resolve the
Service and train; the deployment engine itself is tested end to end in ``test_deployment.py``
and in containers in ``test_containers.py``.
"""

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helpers.cli import ROOT, assert_one_error_line, run_cli

from fedavg.engines.deployment.kubernetes import LABEL, write_deployment

MANIFESTS = ROOT / "containers" / "kubernetes"
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate ships


def kustomize(folder: Path) -> list[dict]:
    """Render ``folder`` with ``kubectl kustomize``; return its objects."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "the Kubernetes tests need kubectl (it renders Kustomize offline)"
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=[(o, n) for o in ("cpu", "gpu") for n in (1, 4, 16)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def run(request, tmp_path_factory):
    overlay, nodes = request.param
    folder = tmp_path_factory.mktemp(f"k8s-{overlay}-{nodes}") / "run"
    write_deployment(folder, nodes, overlay=overlay, name="exp1", image="reg.example/fedavg:1")
    return {"folder": folder, "overlay": overlay, "nodes": nodes,
            "objects": kustomize(folder),
            "fetch": yaml.safe_load((folder / "fetch.yaml").read_text())}


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    """Return each Job's (and Pod's) name and pod spec."""
    specs = {}
    for obj in objects:
        if obj["kind"] == "Job":
            specs[obj["metadata"]["name"]] = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            specs[obj["metadata"]["name"]] = obj["spec"]
    return specs


def secrets_of(spec: dict) -> set[str]:
    """Return the Secrets a pod spec mounts (plain or projected volumes)."""
    names = set()
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def check_node_keys(objects: list[dict]) -> None:
    """Node i mounts the CA and its own key only; no other pod mounts a node key."""
    for name, spec in pod_specs(objects).items():
        keys = {s for s in secrets_of(spec) if re.fullmatch(r"fedavg-node-\d+-key", s)}
        index = re.fullmatch(r"fedavg-node-(\d+)", name)
        if index:
            assert secrets_of(spec) == {"fedavg-ca", f"fedavg-node-{index[1]}-key"}, name
        else:
            assert not keys, f"{name} mounts node keys {keys}"
    for obj in objects:
        if obj["kind"] == "Secret":
            assert "ca.key" not in obj.get("data", {}), obj["metadata"]["name"]


def check_volumes(objects: list[dict]) -> None:
    """No ReadWriteMany claim; a claim mounted writable is mounted by one pod template only."""
    writers: dict[str, list[str]] = {}
    for obj in objects:
        if obj["kind"] == "PersistentVolumeClaim":
            assert "ReadWriteMany" not in obj["spec"]["accessModes"], obj["metadata"]["name"]
    for name, spec in pod_specs(objects).items():
        read_only = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])
                     if m.get("readOnly")}
        for volume in spec.get("volumes", []):
            claim = volume.get("persistentVolumeClaim")
            if claim and volume["name"] not in read_only:
                writers.setdefault(claim["claimName"], []).append(name)
    assert all(len(pods) == 1 for pods in writers.values()), writers
    assert writers == {"fedavg-output": ["fedavg-coordinator"]}


def check_labels(objects: list[dict], instance: str) -> None:
    """Every object and pod template carries the app's and the run's labels; no namespace."""
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert "namespace" not in obj["metadata"], where
        templates = [obj["metadata"]]
        if obj["kind"] == "Job":
            templates.append(obj["spec"]["template"]["metadata"])
        for meta in templates:
            labels = meta.get("labels", {})
            assert labels.get("app.kubernetes.io/name") == "fedavg", where
            assert labels.get(LABEL) == instance, where


def check_gpus(objects: list[dict], overlay: str) -> None:
    """GPU overlay: one GPU per node and none for the coordinator; CPU overlay: no GPU."""
    for name, spec in pod_specs(objects).items():
        limits = spec["containers"][0]["resources"].get("limits", {})
        wanted = 1 if overlay == "gpu" and name.startswith("fedavg-node-") else None
        assert limits.get("nvidia.com/gpu") == wanted, name


def test_the_base_renders_and_validates():
    objects = kustomize(MANIFESTS / "base")
    assert {o["kind"] for o in objects} == {"ConfigMap", "Job", "Service",
                                           "PersistentVolumeClaim"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_every_object_validates_against_the_schemas(run):
    for obj in [*run["objects"], run["fetch"]]:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_one_job_per_node_each_on_its_partition(run):
    jobs = {o["metadata"]["name"]: o for o in run["objects"] if o["kind"] == "Job"}
    assert set(jobs) == {"fedavg-coordinator", *(f"fedavg-node-{i}" for i in
                                                 range(run["nodes"]))}
    for i in range(run["nodes"]):
        args = jobs[f"fedavg-node-{i}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--partition-id={i}" in args and "--once" in args
    settings = next(o for o in run["objects"] if o["kind"] == "ConfigMap")["data"]
    assert settings["NUM_NODES"] == settings["MIN_NODES"] == str(run["nodes"])
    assert settings["NODE_DEVICE"] == {"cpu": "cpu", "gpu": "cuda"}[run["overlay"]]


def test_the_invariants_hold(run):
    check_node_keys(run["objects"])
    check_volumes([*run["objects"], run["fetch"]])
    check_labels([*run["objects"], run["fetch"]], "exp1")
    check_gpus(run["objects"], run["overlay"])


def test_each_node_key_secret_holds_that_nodes_key(run):
    import base64

    secrets = {o["metadata"]["name"]: o for o in run["objects"] if o["kind"] == "Secret"}
    for i in range(run["nodes"]):
        data = secrets[f"fedavg-node-{i}-key"]["data"]
        assert set(data) == {"node.key"}
        key = (run["folder"] / "secrets" / f"node-{i}.key").read_bytes()
        assert base64.b64decode(data["node.key"]) == key
    assert set(secrets["fedavg-coordinator-tls"]["data"]) == {"ca.crt", "coordinator.crt",
                                                              "coordinator.key"}


def _resolve(value: str, env: dict[str, str]) -> str:
    """Resolve compose's ``${VAR:-default}`` (nested too) with ``env``, else the default."""
    pattern = re.compile(r"\$\{(\w+):-([^${}]*)\}")
    while pattern.search(value):
        value = pattern.sub(lambda m: env.get(m[1], m[2]), value)
    return value


def test_image_and_arguments_match_the_compose_stack(run):
    compose = yaml.safe_load((ROOT / "containers" / "compose.yml").read_text())
    n = run["nodes"]
    env = {"NUM_NODES": str(n)}
    jobs = {o["metadata"]["name"]: o for o in run["objects"] if o["kind"] == "Job"}
    settings = next(o for o in run["objects"] if o["kind"] == "ConfigMap")["data"]
    for service, job, index in (("coordinator", "fedavg-coordinator", None),
                                ("node", "fedavg-node-0", "0")):
        container = jobs[job]["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "reg.example/fedavg:1"
        assert container["command"] == compose["x-fedavg"]["entrypoint"]
        ours = [re.sub(r"\$\((\w+)\)", lambda m: settings[m[1]], a) for a in container["args"]]
        theirs = [_resolve(a, env).replace("{index}", index or "")
                  for a in compose["services"][service]["command"]]
        # the differences, each for a reason: the Service's name; one key file per pod; the
        # device and thread count of the overlay; waits for pods that start all at once
        theirs = [a.replace("coordinator:9092", "fedavg-coordinator:9092")
                  .replace("/certs/node-0.key", "/certs/node.key") for a in theirs]
        theirs = [a for a in theirs if not a.startswith("--device=")]
        ours = [a for a in ours if not a.startswith(("--device=", "--threads=", "--wait-timeout=",
                                                    "--max-wait-time="))]
        assert ours == theirs, service


def test_a_broken_manifest_fails_the_invariants(tmp_path):
    write_deployment(tmp_path / "run", 4, overlay="gpu", name="exp1")
    rendered = kustomize(tmp_path / "run")
    objects = copy.deepcopy(rendered)
    node1 = next(o for o in objects if o["metadata"]["name"] == "fedavg-node-1")
    sources = node1["spec"]["template"]["spec"]["volumes"][0]["projected"]["sources"]
    sources.append({"secret": {"name": "fedavg-node-2-key"}})
    with pytest.raises(AssertionError, match="fedavg-node-1"):
        check_node_keys(objects)
    objects = copy.deepcopy(rendered)
    next(o for o in objects if o["kind"] == "PersistentVolumeClaim")["spec"]["accessModes"] = [
        "ReadWriteMany"]
    with pytest.raises(AssertionError):
        check_volumes(objects)
    objects = copy.deepcopy(rendered)
    objects[0]["metadata"]["namespace"] = "default"
    with pytest.raises(AssertionError, match="namespace|ConfigMap"):
        check_labels(objects, "exp1")
    with pytest.raises(AssertionError):
        check_gpus(rendered, "cpu")


def test_the_data_claim_is_mounted_read_only_everywhere(tmp_path):
    folder = tmp_path / "run"
    write_deployment(folder, 2, data_claim="my-data")
    objects = kustomize(folder)
    for name, spec in pod_specs(objects).items():
        volume = next(v for v in spec["volumes"] if v["name"] == "data")
        assert volume["persistentVolumeClaim"] == {"claimName": "my-data", "readOnly": True}
        mount = next(m for c in spec["containers"] for m in c["volumeMounts"]
                     if m["name"] == "data")
        assert mount == {"name": "data", "mountPath": "/data", "readOnly": True}, name
    check_volumes(objects)


@pytest.mark.parametrize("args,message", [
    (["--overlay", "tpu"], "--overlay must be one of cpu, gpu (got 'tpu')"),
    (["--nodes", "0"], "--nodes must be >= 1 (got 0)"),
    (["--name", "Exp_1"], "--name must be lower-case letters"),
    (["--manifests", "/nonexistent"], "no Kubernetes manifests in /nonexistent"),
    (["--image", "my image"], "--image must be an image reference"),
])
def test_bad_options_are_one_line(tmp_path, args, message):
    res = run_cli("kubernetes", tmp_path / "run", "--image", "reg.example/fedavg:1", *args,
                  check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert_one_error_line(res.stderr)
    assert not (tmp_path / "run").exists()


def test_a_folder_with_a_run_is_not_written_over(tmp_path):
    folder = tmp_path / "run"
    res = run_cli("kubernetes", folder, "--nodes", "2", "--image", "fedavg:1")
    assert "kubectl apply -k" in res.stdout
    before = (folder / "secrets" / "node-0.key").read_bytes()
    res = run_cli("kubernetes", folder, "--nodes", "3", "--image", "fedavg:1", check=False)
    assert res.returncode == 2 and "--overwrite" in res.stderr
    assert (folder / "secrets" / "node-0.key").read_bytes() == before
    run_cli("kubernetes", folder, "--nodes", "3", "--image", "fedavg:1", "--overwrite")
    assert (folder / "secrets" / "node-2.key").is_file()
    assert (folder / "secrets" / "node-0.key").read_bytes() != before
