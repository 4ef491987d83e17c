"""``fedavg kubernetes``: a folder that ``kubectl apply -k`` turns into a run on a cluster.

The manifests live in ``containers/kubernetes/`` of the checkout: ``base/`` (the coordinator's
Job and Service, the output volume, the settings ConfigMap), ``node/node.yaml`` (one node's
Job, ``{index}`` to fill in) and ``overlays/cpu``, ``overlays/gpu`` (Kustomize components).
A pod template cannot mount a different Secret in each pod of one Job, and Kustomize cannot
repeat a resource N times, so this writes, per run:

- ``secrets/``: a CA, the coordinator's certificate for the Service's name, N node key pairs
  (:func:`fedavg.engines.deployment.certs.make_certs`); ``ca.key`` goes into no Secret;
- ``nodes.yaml``: N node Jobs, node i mounting only the Secret ``fedavg-node-<i>-key``;
- ``kustomization.yaml``: the base, the overlay, the nodes, the Secrets, ``NUM_NODES``, the
  image and the run's label ``app.kubernetes.io/instance`` on every object;
- ``fetch.yaml``: a pod that mounts the output read-only, to copy the model out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from fedavg.util.errors import UserError

#: The Service the nodes dial, a name the coordinator's certificate holds.
SERVICE = "fedavg-coordinator"
OVERLAYS = ("cpu", "gpu")
LABEL = "app.kubernetes.io/instance"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def default_manifests() -> Path:
    """Return ``containers/kubernetes`` of the checkout this package runs from."""
    return Path(__file__).resolve().parents[3] / "containers" / "kubernetes"


def _check(nodes: int, overlay: str, name: str, data_claim: str | None, image: str,
           manifests: Path) -> None:
    if overlay not in OVERLAYS:
        raise UserError(f"--overlay must be one of {', '.join(OVERLAYS)} (got {overlay!r})")
    if not nodes >= 1:
        raise UserError(f"--nodes must be >= 1 (got {nodes})")
    for option, value in (("--name", name), ("--data-claim", data_claim)):
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise UserError(f"{option} must be lower-case letters, digits and '-', at most 63, "
                            f"starting and ending with a letter or digit (got {value!r})")
    if not re.fullmatch(r"[\w./:@-]+", image):
        raise UserError(f"--image must be an image reference such as registry.example/fedavg:0.1 "
                        f"(got {image!r})")
    if not (manifests / "base" / "kustomization.yaml").is_file():
        raise UserError(f"no Kubernetes manifests in {manifests} (base/kustomization.yaml): "
                        "run from a checkout of fedavg or pass --manifests "
                        "PATH/containers/kubernetes")


def _image(image: str) -> dict[str, str]:
    """Kustomize's ``images`` entry that puts ``image`` in place of ``fedavg``."""
    entry = {"name": "fedavg"}
    if "@" in image:
        entry["newName"], entry["digest"] = image.split("@", 1)
    elif ":" in image.rsplit("/", 1)[-1]:
        entry["newName"], entry["newTag"] = image.rsplit(":", 1)
    else:
        entry["newName"] = image
    return entry


def _data_patch(claim: str) -> dict:
    """Return a patch mounting the PersistentVolumeClaim ``claim`` read-only at ``/data``."""
    ops = [{"op": "add", "path": "/spec/template/spec/volumes/-",
            "value": {"name": "data", "persistentVolumeClaim": {"claimName": claim,
                                                                "readOnly": True}}},
           {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
            "value": {"name": "data", "mountPath": "/data", "readOnly": True}}]
    return {"target": {"kind": "Job", "labelSelector": "app.kubernetes.io/name=fedavg"},
            "patch": yaml.safe_dump(ops, sort_keys=False)}


def kustomization(folder: Path, nodes: int, overlay: str, name: str, image: str,
                  data_claim: str | None, manifests: Path) -> dict:
    """Return the run's ``kustomization.yaml`` (as a dict) for ``folder``."""
    rel = Path(os.path.relpath(manifests, folder))
    secrets = [
        {"name": "fedavg-coordinator-tls", "files": [f"secrets/{f}" for f in
                                                     ("ca.crt", "coordinator.crt",
                                                      "coordinator.key")]},
        {"name": "fedavg-authorized-nodes", "files": ["secrets/authorized-nodes.pub"]},
        {"name": "fedavg-ca", "files": ["secrets/ca.crt"]},
        *({"name": f"fedavg-node-{i}-key", "files": [f"node.key=secrets/node-{i}.key"]}
          for i in range(nodes)),
    ]
    config = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(rel / "base"), "nodes.yaml"],
        "components": [str(rel / "overlays" / overlay)],
        "configMapGenerator": [{"name": "fedavg-settings", "behavior": "merge",
                                "literals": [f"NUM_NODES={nodes}", f"MIN_NODES={nodes}"]}],
        "secretGenerator": [{**s, "type": "Opaque"} for s in secrets],
        "generatorOptions": {"disableNameSuffixHash": True},
        "labels": [{"pairs": {"app.kubernetes.io/name": "fedavg", LABEL: name},
                    "includeSelectors": False,
                    "includeTemplates": True}],
        "images": [_image(image)],
    }
    if data_claim:
        config["patches"] = [_data_patch(data_claim)]
    return config


def node_jobs(manifests: Path, nodes: int) -> str:
    """Return ``nodes`` node Jobs, ``node/node.yaml`` with ``{index}`` as 0 .. nodes-1."""
    template = (manifests / "node" / "node.yaml").read_text()
    return "---\n".join(template.replace("{index}", str(i)) for i in range(nodes))


def fetch_pod(name: str, image: str) -> dict:
    """Return a pod that mounts the run's output read-only, to ``kubectl cp`` it out."""
    user = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "fedavg-fetch", "labels": {
            "app.kubernetes.io/name": "fedavg", LABEL: name,
            "app.kubernetes.io/component": "fetch"}},
        "spec": {
            "restartPolicy": "Never", "automountServiceAccountToken": False,
            "securityContext": user,
            "containers": [{
                "name": "fetch", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "3600"],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                "volumeMounts": [{"name": "output", "mountPath": "/output",
                                  "readOnly": True}]}],
            "volumes": [{"name": "output", "persistentVolumeClaim": {
                "claimName": "fedavg-output", "readOnly": True}}]},
    }


def write_deployment(folder: Path, nodes: int, overlay: str = "cpu",
                     hosts: list[str] | None = None, image: str = "fedavg",
                     name: str = "fedavg", data_claim: str | None = None,
                     manifests: Path | None = None, overwrite: bool = False) -> list[Path]:
    """Write a run for ``kubectl apply -k folder``: secrets, node Jobs, its kustomization.

    Parameters
    ----------
    folder : pathlib.Path
        Created if missing; ``secrets/`` in it holds private keys (mode 0600).
    nodes : int
        Node Jobs, node i training partition i of ``nodes``.
    overlay : {"cpu", "gpu"}
        ``gpu``: one GPU per node (``nvidia.com/gpu: 1``), scheduled on GPU machines.
    hosts : list of str, optional
        More names the coordinator's certificate holds (for nodes outside the cluster that
        reach it through an exposed Service); ``fedavg-coordinator`` always.
    image : str
        The fedavg image the cluster pulls (``registry/fedavg:tag``).
    name : str
        The run's ``app.kubernetes.io/instance`` label, on every object.
    data_claim : str, optional
        A PersistentVolumeClaim of the data, mounted read-only at ``/data`` (then set
        ``DATASET=/data/...`` in the settings).
    manifests : pathlib.Path, optional
        ``containers/kubernetes`` (default: the checkout's, :func:`default_manifests`).
    overwrite : bool
        Replace a folder's earlier run (its keys included).

    Returns
    -------
    list of pathlib.Path
        The files written.

    Raises
    ------
    UserError
        A bad option value, no manifests, or ``folder`` holding a run (without
        ``overwrite``).
    """
    from fedavg.engines.deployment.certs import make_certs

    manifests = (manifests or default_manifests()).resolve()
    _check(nodes, overlay, name, data_claim, image, manifests)
    folder = folder.resolve()
    target = folder / "kustomization.yaml"
    if target.exists() and not overwrite:
        raise UserError(f"{folder} already holds a run (kustomization.yaml): pass --overwrite "
                        "to replace it, its keys included, or choose another folder")
    written = make_certs(folder / "secrets", hosts=[SERVICE, *(hosts or [])], nodes=nodes,
                         overwrite=overwrite)
    files = {
        target: yaml.safe_dump(kustomization(folder, nodes, overlay, name, image, data_claim,
                                             manifests), sort_keys=False),
        folder / "nodes.yaml": node_jobs(manifests, nodes),
        folder / "fetch.yaml": yaml.safe_dump(fetch_pod(name, image), sort_keys=False),
    }
    for path, text in files.items():
        path.write_text(text)
    return [*written, *files]
