"""A node's options, declared once: checked before it connects, then passed to its SuperNode.

:class:`NodeOptions` is the one declaration of every ``fedavg node`` option (default, help);
the command line is generated from it (:func:`fedavg.cli.options.with_options`), and
:func:`fedavg.engines.deployment.node.serve_node` and
:func:`fedavg.engines.deployment.gpus.serve_gpu_nodes` take it whole. :meth:`NodeOptions.check`
refuses bad options in one line; :meth:`NodeOptions.node_config` lists what the SuperNode's
``--node-config`` carries to :mod:`fedavg.node.deployed`; :func:`use_threads` sets the CPU
threads torch trains with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from rich.markup import escape

from fedavg.config.settings import setting
from fedavg.engines.deployment.tls import check_node_key, resolve_certs
from fedavg.util.errors import UserError


def use_threads(threads: int | None) -> int:
    """Train on ``threads`` CPU threads in this process (default: torch's); return how many."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@dataclass(frozen=True)
class NodeOptions:
    """The options of ``fedavg node``: how one node joins a coordinator's runs.

    Attributes
    ----------
    coordinator : str
        ``host:port`` of ``fedavg coordinator``.
    dataset : str
        The node's data: ``digits``, a local path or a hub id.
    partition_id, num_partitions : int, optional
        Train on partition ``partition_id`` of ``num_partitions`` of ``dataset`` (split as
        ``fedavg simulate`` would with the run's partitioner); default: all of it.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    certs, insecure : path or None, bool
        Folder holding the coordinator's CA certificate ``ca.crt``; or ``insecure``: no TLS.
    auth_key : path, optional
        This node's private key (from ``fedavg certs --nodes``) for SuperNode authentication.
    once : bool
        Exit after the first run ends; by default the node serves runs until stopped.
    max_wait_time : float, optional
        Seconds without reaching the coordinator before giving up (retry; --once: 30 s
        mid-run).
    model : str, optional
        The run's user-code ``--model`` (a file: this machine's copy); needed to run it.
    threads : int, optional
        CPU threads torch trains with (default: one per core; nodes sharing cores: fewer).
    secure_aggregation : bool
        Send this node's update only through Flower's SecAgg+ (:mod:`fedavg.node.secure`):
        a run that asks for it in clear fails on this node.
    """

    coordinator: str = setting("127.0.0.1:9092", "host:port of `fedavg coordinator`")
    dataset: str = setting("digits", "This node's data: digits, a local path, or a hub id")
    partition_id: int | None = setting(None, "Train on this partition of --dataset (split as "
                                       "the run's partitioner says)")
    num_partitions: int | None = setting(None, "Number of partitions of --dataset")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    certs: Path | None = setting(None, "Folder holding the coordinator's ca.crt (TLS)")
    insecure: bool = setting(False, "No TLS (traffic unencrypted)")
    auth_key: Path | None = setting(None, "This node's private key (node-<i>.key from "
                                    "`fedavg certs --nodes`)")
    once: bool = setting(False, "Exit after one run (default: serve runs until stopped)")
    max_wait_time: float | None = setting(
        None, "Give up after this many seconds without reaching the coordinator: at the start "
        "(default: keep retrying) and, with --once, once connected (default: 30)")
    model: str | None = setting(None, "Model code of yours this node may run: the "
                                "coordinator's --model module:function or file.py:function "
                                "(a file: this machine's copy)")
    threads: int | None = setting(None, "CPU threads torch trains with (default: one per "
                                  "core); nodes sharing a machine: cores / nodes each")
    secure_aggregation: bool = setting(False, "Send this node's update only through secure "
                                       "aggregation (Flower's SecAgg+); refuse runs without it")

    def check(self):
        """Check every option; return the certificate folder and the model code to allow.

        The model code (``--model``) is this machine's, checked before connecting; so is a
        hub dataset, which is fetched into the local cache.

        Raises
        ------
        UserError
            An option is out of range, a path is missing, the hub cannot provide the
            dataset, or TLS / key options do not fit.
        """
        # lazy: `fedavg --help` reads this module; these load torch and datasets
        from fedavg.data.load import looks_like_path
        from fedavg.data.sources import BUILTIN, open_source
        from fedavg.models.evaluation import resolve_device
        from fedavg.models.sources import node_model

        pid, parts = self.partition_id, self.num_partitions
        if (pid is None) != (parts is None):
            raise UserError("give --partition-id and --num-partitions together")
        if parts is not None and parts < 1:
            raise UserError(f"--num-partitions must be at least 1, got {parts}")
        if pid is not None and not 0 <= pid < parts:
            raise UserError(f"--partition-id must be in 0..{parts - 1}, got {pid}")
        if looks_like_path(self.dataset) and not Path(self.dataset).expanduser().exists():
            raise UserError(f"--dataset {self.dataset} does not exist")
        if not looks_like_path(self.dataset) and self.dataset not in BUILTIN:
            open_source(self.dataset)  # a hub id: fetched now, or refused before connecting
        resolve_device(self.device)
        certs = resolve_certs(self.certs, self.insecure, "node")
        if self.auth_key is not None:
            if certs is None:
                raise UserError("--auth-key needs TLS: pass --certs, not --insecure")
            check_node_key(self.auth_key)
        if self.max_wait_time is not None and not self.max_wait_time > 0:  # nan too
            raise UserError(f"--max-wait-time must be > 0 seconds, got {self.max_wait_time:g}")
        check_threads(self.threads)
        return certs, node_model(self.model)

    def command_line(self) -> list[str]:
        """Return the ``fedavg node`` arguments that give these options (defaults left out)."""
        args = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                flag = "--" + f.name.replace("_", "-")
                args += [flag] if isinstance(value, bool) else [flag, str(value)]
        return args

    def node_config(self, model: str | None) -> list[str]:
        """List the SuperNode's ``--node-config`` items (read by :mod:`fedavg.node.deployed`).

        ``model``: the checked model code to allow (:meth:`check`), if any.
        """
        from fedavg.data.load import looks_like_path  # lazy: `fedavg --help` reads this module

        dataset = self.dataset
        config = [f'dataset="{Path(dataset).expanduser().resolve()}"'
                  if looks_like_path(dataset) else f'dataset="{dataset}"',
                  f'device="{self.device}"']
        if self.partition_id is not None:
            config += [f"partition-id={self.partition_id}",
                       f"num-partitions={self.num_partitions}"]
        if model is not None:
            config.append(f'model="{model}"')
        if self.secure_aggregation:
            config.append("secure-aggregation=true")
        return config

    def describe(self, threads: int, model: str | None, address: str, tls: bool) -> str:
        """Say what the node trains on (data, device, CPU threads, model code) and where to.

        ``auto`` is shown with the device it stands for here: ``device auto (cpu)``.
        """
        from fedavg.models.evaluation import resolve_device  # lazy: --help reads this module

        device = self.device
        if device == "auto":
            device = f"auto ({resolve_device(device)})"
        part = (f" partition {self.partition_id}/{self.num_partitions}"
                if self.partition_id is not None else "")
        return (f"node: data [bold]{escape(self.dataset)}[/]{part}, device {device}, "
                f"{threads} CPU thread(s)" + (f", model code {escape(model)}" if model else "")
                + f"; connecting to {address}" + (" (TLS)" if tls else " (NO TLS)"))


def check_threads(threads: int | None) -> None:
    """Refuse a ``--threads`` outside 1..this machine's CPU cores.

    Raises
    ------
    UserError
        ``threads`` is below 1 or above ``os.cpu_count()``.
    """
    cores = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cores:
        raise UserError(f"--threads must be in 1..{cores} (this machine's CPU cores), "
                        f"got {threads}")
