"""Training across machines on Flower's deployment engine: ``fedavg coordinator`` / ``node``.

Only what is SuperLink / SuperNode lives here; the rounds and the run folder are shared with
``fedavg simulate`` (:mod:`fedavg.run`, :mod:`fedavg.coordinator`), and every private Flower
name is in :mod:`fedavg.flower_compat`.

- :mod:`~fedavg.deployment.processes`: the Flower child processes, their folder, addresses;
- :mod:`~fedavg.deployment.tls`: certificates and node keys;
- :mod:`~fedavg.deployment.coordinator`: the coordinator role (:func:`coordinate`);
- :mod:`~fedavg.deployment.node`: the node role (:func:`serve_node`);
- :mod:`~fedavg.deployment.gpus`: one node per GPU (:func:`serve_gpu_nodes`).
"""

from fedavg.deployment.coordinator import RUN_OUTPUT, coordinate, write_app
from fedavg.deployment.gpus import plan_gpu_nodes, serve_gpu_nodes
from fedavg.deployment.node import serve_node
from fedavg.deployment.processes import (
    DEFAULT_ADDRESS,
    free_port,
    join_address,
    split_address,
    stop_all,
)
from fedavg.deployment.tls import load_auth_keys, resolve_certs
from fedavg.flower_compat import node_refusal

__all__ = [
    "DEFAULT_ADDRESS",
    "RUN_OUTPUT",
    "coordinate",
    "free_port",
    "join_address",
    "load_auth_keys",
    "node_refusal",
    "plan_gpu_nodes",
    "resolve_certs",
    "serve_gpu_nodes",
    "serve_node",
    "split_address",
    "stop_all",
    "write_app",
]
