"""Every private Flower and Ray name fedavg uses, and every Flower output line it parses.

Nothing outside this package imports ``flwr.cli``, ``flwr.proto``, ``flwr.supercore``,
``flwr.supernode``, ``flwr.superlink``, ``flwr.common.serde``, ``flwr.common.constant`` or
``ray._private``, or reads Flower's log lines; everything is used as ``fedavg.flower_compat.X``.
:func:`check_flower_internals` fails loudly when the installed flwr is not
:data:`FLOWER_VERSION` or no longer has a name or log line used here.

- :mod:`~fedavg.flower_compat.checks`: that guard, and Ray's auto-connect switch;
- :mod:`~fedavg.flower_compat.launch`: SuperLink / SuperNode entry points, SuperNode patches;
- :mod:`~fedavg.flower_compat.engine`: the simulation engine's message dispatch, actors, stop;
- :mod:`~fedavg.flower_compat.control`: the SuperLink's Control API (submit a run);
- :mod:`~fedavg.flower_compat.fleet`: the Fleet API as a node sees it (is its key known?);
- :mod:`~fedavg.flower_compat.tasks`: warm task workers on the runtime API;
- :mod:`~fedavg.flower_compat.logs`: what SuperLink / SuperNode output lines mean;
- :mod:`~fedavg.flower_compat.privacy`: the privacy accountant (node-level DP);
- :mod:`~fedavg.flower_compat.secagg`: Flower's SecAgg+ workflow and mod under the Message API.
"""

from fedavg.flower_compat.checks import (
    FLOWER_VERSION,
    LOOPBACK_VAR,
    check_flower_internals,
    check_ray_internals,
    disable_ray_auto_connect,
    disconnect_ray,
    ray_on_loopback,
)
from fedavg.flower_compat.control import (
    CertificateRejected,
    control_client,
    register_node_keys,
    start_run,
    wait_control_ready,
)
from fedavg.flower_compat.engine import (
    QUEUE_WAIT_S,
    NodeContexts,
    fast_message_dispatch,
    node_actors,
    prestarted_actors,
    prompt_stop,
)
from fedavg.flower_compat.fleet import node_key_registered
from fedavg.flower_compat.launch import (
    HEARTBEAT_S,
    IDLE_POLL_S,
    PULL_BACKOFF_S,
    REPLY_WAIT_S,
    patch_pull_backoff,
    patch_supernode,
    run_superlink,
    run_supernode,
    seeded_simulation_ids,
)
from fedavg.flower_compat.logs import (
    KEY_HINT,
    TLS_REFUSAL,
    SuperNodeLine,
    error_summary,
    is_certificate_failure,
    most_telling_line,
    node_refusal,
    parse_supernode_line,
    superlink_line_is_error,
    superlink_node_refusal,
)
from fedavg.flower_compat.privacy import gaussian_release, rdp_accountant
from fedavg.flower_compat.tasks import (
    CLIENT_TASK,
    SERVER_TASK,
    UNDELIVERED,
    Endpoint,
    TaskSource,
    run_client_task,
    run_server_task,
)

__all__ = [
    "error_summary",
    "gaussian_release",
    "rdp_accountant",
    "CLIENT_TASK",
    "FLOWER_VERSION",
    "LOOPBACK_VAR",
    "HEARTBEAT_S",
    "IDLE_POLL_S",
    "KEY_HINT",
    "TLS_REFUSAL",
    "PULL_BACKOFF_S",
    "NodeContexts",
    "QUEUE_WAIT_S",
    "REPLY_WAIT_S",
    "SERVER_TASK",
    "CertificateRejected",
    "Endpoint",
    "SuperNodeLine",
    "TaskSource",
    "UNDELIVERED",
    "check_flower_internals",
    "check_ray_internals",
    "control_client",
    "disable_ray_auto_connect",
    "disconnect_ray",
    "ray_on_loopback",
    "fast_message_dispatch",
    "is_certificate_failure",
    "most_telling_line",
    "node_actors",
    "node_key_registered",
    "node_refusal",
    "parse_supernode_line",
    "patch_pull_backoff",
    "patch_supernode",
    "prestarted_actors",
    "prompt_stop",
    "register_node_keys",
    "run_client_task",
    "run_server_task",
    "run_superlink",
    "run_supernode",
    "seeded_simulation_ids",
    "start_run",
    "superlink_line_is_error",
    "superlink_node_refusal",
    "wait_control_ready",
]
