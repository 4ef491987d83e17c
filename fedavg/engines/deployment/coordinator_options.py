"""The options of ``fedavg coordinator``, declared once (the run's own settings aside).

:class:`CoordinatorOptions` is the one declaration of each coordinator process option
(default, help); the command line is generated from it
(:func:`fedavg.cli.options.with_options`) and
:func:`fedavg.engines.deployment.coordinator.coordinate` takes it whole and checks it. This
module imports nothing heavy: ``fedavg --help`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedavg.config.settings import resume_help, setting


@dataclass(frozen=True)
class CoordinatorOptions:
    """How a coordinator listens, whom it lets in, and how long it waits for nodes.

    Attributes
    ----------
    address : str
        ``host:port`` the SuperLink listens on (nodes connect here). ``0.0.0.0:PORT`` to
        accept other machines.
    certs : path, optional
        Folder from ``fedavg certs`` (``ca.crt``, ``coordinator.crt``, ``coordinator.key``).
    insecure : bool
        No TLS (only when asked for; warns).
    auth_keys : path, optional
        Node public keys allowed to connect (Flower's SuperNode authentication).
    min_nodes : int, optional
        Nodes to wait for before round 1 (default 2; with ``resume``, the run's own).
    min_nodes_per_round : int, optional
        Usable replies each round needs (default: half the nodes a round samples,
        ``fraction x min_nodes``, rounded up).
    wait_timeout : float
        Seconds to wait for nodes before failing with a clear error.
    output : path, optional
        Run folder (default ``runs/<timestamp>``); the files of ``fedavg simulate``.
    overwrite : bool
        Allow ``output`` to hold a previous run.
    verbose : bool
        Show Flower's own logs and every SuperLink line.
    resume : path, optional
        Go on with the interrupted run in this folder (see :func:`fedavg.simulate`).
    """

    address: str = setting("127.0.0.1:9092", "host:port to listen on; 0.0.0.0:PORT for "
                           "other machines")
    certs: Path | None = setting(None, "Folder from `fedavg certs` (TLS)")
    insecure: bool = setting(False, "No TLS (traffic unencrypted)")
    auth_keys: Path | None = setting(None, "Node public keys allowed in (file, one per line, "
                                     "or folder of *.pub)")
    min_nodes: int | None = setting(None, "Nodes to wait for before round 1 (default: 2; "
                                    "with --resume, the run's own)")
    min_nodes_per_round: int | None = setting(None, "Usable replies a round needs (default: "
                                              "half the nodes it samples, rounded up)")
    wait_timeout: float = setting(300.0, "Seconds to wait for --min-nodes nodes")
    output: Path | None = setting(None, "Run folder (default runs/<timestamp>)")
    overwrite: bool = setting(False, "Replace a previous run in --output")
    verbose: bool = setting(False, "Show Flower's logs and every SuperLink line")
    resume: Path | None = setting(None, resume_help("--min-nodes"))
