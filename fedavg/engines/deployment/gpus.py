"""Several GPUs on one machine: ``fedavg node --gpus 0,1,2,3`` starts one node per GPU."""

from __future__ import annotations

from dataclasses import replace

from fedavg.engines.deployment.node_options import NodeOptions, check_threads
from fedavg.engines.deployment.processes import start_command, stop_commands
from fedavg.util.errors import UserError


def plan_gpu_nodes(gpus: str, partition_id: int | None, num_partitions: int | None,
                   cuda_devices: int) -> list[tuple[str, int | None]]:
    """One node per listed GPU: ``(device, partition_id)`` for each.

    Parameters
    ----------
    gpus : str
        Comma-separated CUDA device indices, e.g. ``"0,1,2,3"``.
    partition_id, num_partitions : int, optional
        When given, GPU ``k`` of the list trains on partition ``partition_id + k``.
    cuda_devices : int
        CUDA devices this machine has.

    Returns
    -------
    list of tuple
        ``("cuda:<index>", partition id or None)``, in the order of ``gpus``.

    Raises
    ------
    UserError
        Not a list of distinct indices, an index this machine lacks, or partition ids
        beyond ``num_partitions``.
    """
    try:
        ids = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise UserError(f"--gpus takes GPU indices like 0,1,2,3, got {gpus!r}") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise UserError(f"--gpus takes distinct GPU indices like 0,1,2,3, got {gpus!r}")
    missing = [g for g in ids if g >= cuda_devices]
    if missing:
        raise UserError(f"--gpus lists GPU {missing[0]} but this machine has {cuda_devices} "
                        "CUDA device(s)")
    if partition_id is None:
        return [(f"cuda:{g}", None) for g in ids]
    if num_partitions is None or partition_id + len(ids) > num_partitions:
        raise UserError(f"--gpus starts {len(ids)} nodes on partitions {partition_id}.."
                        f"{partition_id + len(ids) - 1}, beyond --num-partitions {num_partitions}")
    return [(f"cuda:{g}", partition_id + k) for k, g in enumerate(ids)]


def serve_gpu_nodes(gpus: str, options: NodeOptions, console=None) -> int:
    """Start one ``fedavg node`` process per GPU and wait for them all.

    Parameters
    ----------
    gpus : str
        Comma-separated CUDA device indices (see :func:`plan_gpu_nodes`).
    options : NodeOptions
        Every node's options; each node gets its own GPU as its device and, from
        ``partition_id`` up, its own partition. ``device`` must be ``auto`` and
        ``auth_key`` unset: one key fits one node.
    console : rich.console.Console, optional
        Where to print which node starts on which GPU.

    Returns
    -------
    int
        The worst exit code of the node processes.

    Raises
    ------
    UserError
        Bad ``gpus`` (see :func:`plan_gpu_nodes`) or ``threads``, ``--device`` or
        ``--auth-key`` given too.
    """
    import torch

    if options.device != "auto":
        raise UserError("--gpus sets each node's device (cuda:<index>); drop --device")
    if options.auth_key is not None:
        raise UserError("each node needs its own key: with --auth-key, start one node per GPU "
                        "(--device cuda:N --auth-key node-N.key)")
    check_threads(options.threads)  # once here, not once per node started
    plan = plan_gpu_nodes(gpus, options.partition_id, options.num_partitions,
                          torch.cuda.device_count())
    try:
        procs = []
        for dev, pid in plan:
            one = replace(options, device=dev, partition_id=pid,
                          num_partitions=None if pid is None else options.num_partitions)
            if console is not None:
                console.print(f"starting node on {dev}"
                              + (f" (partition {pid})" if pid is not None else ""))
            procs.append(start_command(["node", *one.command_line()]))
        return max(p.wait() for p in procs)
    finally:
        stop_commands()
