"""A node's options: checked before it connects, then passed to its SuperNode.

:func:`check_node_options` refuses bad ``fedavg node`` options in one line;
:func:`node_config` lists what the SuperNode's ``--node-config`` carries to
:mod:`fedavg.node.deployed`; :func:`use_threads` sets the CPU threads torch trains with.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.markup import escape

from fedavg.engines.deployment.tls import check_node_key, resolve_certs
from fedavg.util.errors import UserError


def use_threads(threads: int | None) -> int:
    """Train on ``threads`` CPU threads in this process (default: torch's); return how many."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def check_node_options(dataset: str, partition_id: int | None, num_partitions: int | None,
                       device: str, certs: Path | None, insecure: bool, auth_key: Path | None,
                       max_wait_time: float | None, model: str | None = None,
                       threads: int | None = None):
    """Check the options of ``serve_node``; return the certificate folder and model code.

    The model code (``--model``) is this machine's, checked before connecting; so is a hub
    dataset, which is fetched into the local cache.

    Raises
    ------
    UserError
        An option is out of range, a path is missing, the hub cannot provide the dataset,
        or TLS / key options do not fit.
    """
    from fedavg.data.load import looks_like_path
    from fedavg.data.sources import BUILTIN, open_source
    from fedavg.models.evaluation import resolve_device
    from fedavg.models.sources import node_model

    if (partition_id is None) != (num_partitions is None):
        raise UserError("give --partition-id and --num-partitions together")
    if num_partitions is not None and num_partitions < 1:
        raise UserError(f"--num-partitions must be at least 1, got {num_partitions}")
    if partition_id is not None and not 0 <= partition_id < num_partitions:
        raise UserError(f"--partition-id must be in 0..{num_partitions - 1}, got {partition_id}")
    if looks_like_path(dataset) and not Path(dataset).expanduser().exists():
        raise UserError(f"--dataset {dataset} does not exist")
    if not looks_like_path(dataset) and dataset not in BUILTIN:
        open_source(dataset)  # a hub id: fetched now, or refused before connecting
    resolve_device(device)
    certs = resolve_certs(certs, insecure, "node")
    if auth_key is not None:
        if certs is None:
            raise UserError("--auth-key needs TLS: pass --certs, not --insecure")
        check_node_key(auth_key)
    if max_wait_time is not None and not max_wait_time > 0:  # nan too
        raise UserError(f"--max-wait-time must be > 0 seconds, got {max_wait_time:g}")
    check_threads(threads)
    return certs, node_model(model)


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


def node_config(dataset: str, device: str, partition_id: int | None,
                num_partitions: int | None, model: str | None = None) -> list[str]:
    """List the SuperNode's ``--node-config`` items (read by :mod:`fedavg.node.deployed`)."""
    from fedavg.data.load import looks_like_path

    config = [f'dataset="{Path(dataset).expanduser().resolve()}"'
              if looks_like_path(dataset) else f'dataset="{dataset}"', f'device="{device}"']
    if partition_id is not None:
        config += [f"partition-id={partition_id}", f"num-partitions={num_partitions}"]
    if model is not None:
        config.append(f'model="{model}"')
    return config


def describe_node(dataset: str, partition_id: int | None, num_partitions: int | None,
                  device: str, threads: int, model: str | None, address: str,
                  tls: bool) -> str:
    """Say what the node trains on (data, device, CPU threads, model code) and where to.

    ``auto`` is shown with the device it stands for here: ``device auto (cpu)``.
    """
    from fedavg.models.evaluation import resolve_device

    if device == "auto":
        device = f"auto ({resolve_device(device)})"
    return (f"node: data [bold]{dataset}[/]"
            + (f" partition {partition_id}/{num_partitions}" if partition_id is not None else "")
            + f", device {device}, {threads} CPU thread(s)"
            + (f", model code {escape(model)}" if model else "")
            + f"; connecting to {address}" + (" (TLS)" if tls else " (NO TLS)"))
