"""The SuperLink's Fleet API as a node sees it: whether its key is registered there.

Flower answers a SuperNode whose key the SuperLink does not know and one whose key is
already in use by a connected SuperNode alike (``[code: 2004] Failed to activate
SuperNode.``). :func:`node_key_registered` tells the two apart.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

log = logging.getLogger("fedavg")


def node_key_registered(superlink: str, ca_cert: Path | None, private_key: Path,
                        timeout_s: float = 10.0) -> bool | None:
    """Whether the SuperLink at ``superlink`` knows the public key of ``private_key``.

    It asks to activate the node with a heartbeat interval Flower rejects (0 s): the
    SuperLink first looks up the key (unknown: ``FLEET_NODE_ACTIVATION_FAILED``), then checks
    the interval (``FLEET_INVALID_HEARTBEAT_INTERVAL``), so nothing is activated either way.

    Parameters
    ----------
    superlink : str
        ``host:port`` of the SuperLink's Fleet API.
    ca_cert : path, optional
        Its CA certificate (``None``: plain HTTP).
    private_key : path
        The node's private key (OpenSSH, from ``fedavg certs --nodes``).
    timeout_s : float
        Seconds to wait for the answer.

    Returns
    -------
    bool or None
        ``True``: registered (a refusal then means a node with this key is connected);
        ``False``: not registered; ``None``: no clear answer.
    """
    import httpx
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.proto.fleet_pb2 import ActivateNodeRequest  # pylint: disable=E0611
    from flwr.supercore.error import ApiErrorCode, FlowerError
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    answers = {ApiErrorCode.FLEET_INVALID_HEARTBEAT_INTERVAL: True,
               ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED: False}
    try:
        key = load_ssh_private_key(Path(private_key).read_bytes(), None)
        public = key.public_key()
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                        NodeAuthHttpInterceptor(key, public)]
        with FleetHttpClient(
                f"{'http' if ca_cert is None else 'https'}://{superlink}",
                interceptors=interceptors, timeout=timeout_s,
                verify=False if ca_cert is None
                else ssl.create_default_context(cafile=str(Path(ca_cert).resolve()))) as client:
            client.ActivateNode(ActivateNodeRequest(public_key=public_key_to_bytes(public),
                                                    heartbeat_interval=0.0))
    except httpx.HTTPStatusError as exc:
        error = FlowerError.from_json(exc.response.text)
        return answers.get(error.code) if error is not None else None
    except Exception as exc:  # noqa: BLE001 - no answer: the caller says what it knows
        log.debug("node key check: %s", exc)
    return None
