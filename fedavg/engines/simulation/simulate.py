"""``fedavg simulate``: N nodes on one machine, on Flower's simulation engine (Ray backend).

Only what is Ray lives here; the run lifecycle (prepare, run folder, summary) is
:mod:`fedavg.run.lifecycle`, the ServerApp :mod:`fedavg.run.server_app`, the ClientApp
:mod:`fedavg.node.clientapp`. The driver writes the partitioned training arrays to a temporary file
that every node process memory-maps once, starts Ray in a folder of its own (in a thread, with the
node actors, while the rest is set up: :mod:`fedavg.engines.simulation.ray_start`) and runs Flower's
``run_simulation`` in this process: no SuperLink, no per-run dependency installation, and Ray is
shut down on return, error or Ctrl-C (:mod:`fedavg.engines.simulation.ray_cleanup`). Both folders
are private ones (:class:`fedavg.util.tempdirs.PrivateDir`): the next run removes those of a run
killed outright. With ``--ray-address`` the run is a job of an existing Ray cluster instead: the
node data goes through the cluster's object store, and the cluster is left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import fedavg
from fedavg.config.settings import RunConfig
from fedavg.engines.simulation.ray_cleanup import abortable, free_engine_threads, shutdown_ray
from fedavg.engines.simulation.ray_start import RayStart
from fedavg.flower_compat import (
    NodeContexts,
    fast_message_dispatch,
    prestarted_actors,
    prompt_stop,
    seeded_simulation_ids,
)
from fedavg.models.evaluation import resolve_device
from fedavg.run import lifecycle as run
from fedavg.run import privacy
from fedavg.run.display import Progress, show_plan
from fedavg.run.resume import resolve_settings
from fedavg.run.tracking import TrackingOptions, tracked
from fedavg.util.errors import RunError, UserError
from fedavg.util.interrupts import held_interrupts
from fedavg.util.tempdirs import PrivateDir

log = logging.getLogger("fedavg")


def write_node_data(path: str | Path, x: np.ndarray, y: np.ndarray,
                    parts: list[np.ndarray]) -> None:
    """Write training arrays and partitions for the node processes (safetensors, no pickle).

    Parameters
    ----------
    path : path
        The file to write.
    x, y : numpy.ndarray
        ``(N, ...)`` inputs and ``(N,)`` labels of the whole train split.
    parts : list of numpy.ndarray
        One index array per node (see :func:`fedavg.node.clientapp.partition_arrays`).
    """
    from safetensors.numpy import save_file

    save_file(node_arrays(x, y, parts), str(path))


def node_arrays(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Return the node data as flat arrays: ``x``, ``y``, ``offsets`` and ``indices``."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    indices = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return {"x": np.ascontiguousarray(x), "y": np.ascontiguousarray(y, dtype=np.int64),
            "offsets": offsets, "indices": indices}


def _check_arguments(**given: Any) -> None:
    """Raise ``TypeError`` naming the first :func:`simulate` argument of a wrong type.

    An empty ``output`` / ``resume`` string is a ``UserError`` (it is not the current folder).
    """
    number = (int, float)
    path = (str, os.PathLike, type(None))
    kinds = {"output": path, "resume": path, "verbose": (bool,), "overwrite": (bool,),
             "cpus_per_node": number, "gpus_per_node": (*number, type(None)),
             "tracking": (TrackingOptions, type(None)), "ray_address": (str, type(None))}
    for name, value in given.items():
        if name == "console":
            bad = value is not None and not callable(getattr(value, "print", None))
            wanted = "a rich.console.Console or None"
        else:
            bad = not isinstance(value, kinds[name]) or (
                isinstance(value, bool) and bool not in kinds[name])
            wanted = " or ".join("None" if k is type(None) else k.__name__
                                 for k in kinds[name])
        if bad:
            raise TypeError(f"{name} must be {wanted}, got {value!r}")
        if name in ("output", "resume") and isinstance(value, str) and not value.strip():
            raise UserError(f"{name} needs a path, not an empty string")


def _import_libraries(device: str) -> None:
    """Import torch and datasets with Ctrl-C held; check ``device``.

    An import cut short would break every later call in the process.
    """
    with held_interrupts():
        import datasets  # noqa: F401
        import torch  # noqa: F401

    resolve_device(device)


def check_resources(device: str, cpus_per_node: float, gpus_per_node: float | None) -> None:
    """Raise the error ``fedavg simulate`` stops with at its start for these settings here.

    Raises
    ------
    UserError
        An unknown device, CUDA asked for on a machine without it, or more cores (or GPUs)
        per node than this machine has.
    """
    resolve_device(device)
    _backend_config(device, cpus_per_node, gpus_per_node, verbose=False)


#: Ray counts resources in units of 0.0001 (its MIN_RESOURCE_GRANULARITY): a smaller share
#: is zero to it, and its engine fails on it only as the run starts.
RAY_RESOURCE_UNIT = 0.0001


def _check_resource_units(cpus_per_node: float, gpus_per_node: float | None) -> None:
    """Refuse a positive CPU or GPU share per node below Ray's resource unit.

    Raises
    ------
    UserError
        ``cpus_per_node`` or ``gpus_per_node`` is above 0 and below :data:`RAY_RESOURCE_UNIT`.
    """
    for flag, share in (("--cpus-per-node", cpus_per_node), ("--gpus-per-node", gpus_per_node)):
        if share is not None and 0 < share < RAY_RESOURCE_UNIT:
            raise UserError(f"{flag} must be at least {RAY_RESOURCE_UNIT:g} (got {share:g}): "
                            "Ray counts resources in units of 0.0001")


def _backend_config(device: str, cpus_per_node: float, gpus_per_node: float | None,
                    verbose: bool, ray_address: str | None = None) -> dict[str, Any]:
    import torch

    logs = {"logging_level": logging.INFO if verbose else logging.ERROR,
            "log_to_driver": verbose}
    _check_resource_units(cpus_per_node, gpus_per_node)
    if ray_address is not None:  # the cluster's machines have the cores and GPUs
        if not cpus_per_node > 0:
            raise UserError(f"--cpus-per-node must be > 0 (got {cpus_per_node:g})")
        if not (gpus_per_node or 0) >= 0:
            raise UserError(f"--gpus-per-node must be >= 0 (got {gpus_per_node:g})")
        address = cluster_address(ray_address)
        return {"client_resources": {"num_cpus": cpus_per_node,
                                     "num_gpus": gpus_per_node or 0.0},
                "init_args": {"address": address, **logs}}
    cores = os.cpu_count() or 1
    use_gpu = device != "cpu" and torch.cuda.is_available()
    gpus = torch.cuda.device_count() if use_gpu else 0
    if gpus_per_node is None:
        gpus_per_node = 1.0 if gpus else 0.0
    if not 0 < cpus_per_node <= cores:  # nan too
        raise UserError(f"--cpus-per-node must be in (0, {cores}] on this machine")
    if not gpus_per_node >= 0:
        raise UserError(f"--gpus-per-node must be >= 0 (got {gpus_per_node:g})")
    if gpus_per_node > 0 and not gpus:
        raise UserError("--gpus-per-node > 0 needs a CUDA device; use --device cpu")
    return {
        "client_resources": {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node},
        "init_args": {"num_cpus": cores, "num_gpus": gpus, "include_dashboard": False, **logs},
    }


def cluster_address(given: str, timeout_s: float = 5.0) -> str:
    """Return the ``HOST:PORT`` of ``--ray-address``, checked to answer within ``timeout_s``.

    ``auto`` is ``RAY_ADDRESS`` when set, else the cluster that ``ray start`` recorded on this
    machine (``ray_current_cluster`` in Ray's folder, ``$RAY_TMPDIR/ray`` or ``/tmp/ray``);
    never, as Ray's own ``auto`` would, any Ray instance found running (another run's private
    one). Ray itself retries an address where nothing answers for minutes.

    Raises
    ------
    UserError
        An empty or malformed address, no recorded cluster for ``auto``, or nothing
        answering at the address.
    """
    import socket

    address = given.strip()
    if address == "auto":
        address = _recorded_cluster()
    host, sep, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    host = host.strip("[]")
    if not sep or not host or bare_ipv6 or not port.isdigit() or \
            not 0 < int(port) < 65536 or "/" in address:
        raise UserError(f"--ray-address {given!r}: write HOST:PORT of the cluster's head "
                        "(e.g. 10.0.0.1:6379, printed by `ray start --head`) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(f"no Ray cluster answers at {address} ({exc.strerror or exc}); start "
                        "its head with `ray start --head --port PORT` or fix --ray-address")
    return address


def _recorded_cluster() -> str:
    """Return the address ``auto`` stands for (see :func:`cluster_address`)."""
    if os.environ.get("RAY_ADDRESS", "").strip() not in ("", "auto"):
        return os.environ["RAY_ADDRESS"].strip()
    record = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"
    try:
        return record.read_text().strip()
    except OSError:
        raise UserError(f"--ray-address auto: no cluster started with `ray start` on this "
                        f"machine ({record} not found) and no RAY_ADDRESS; give HOST:PORT of "
                        "the cluster's head") from None


def simulate(
    config: RunConfig | None = None,
    *,
    output: str | Path | None = None,
    console=None,
    verbose: bool = False,
    cpus_per_node: float = 1.0,
    gpus_per_node: float | None = None,
    overwrite: bool = False,
    resume: str | Path | None = None,
    tracking=None,
    ray_address: str | None = None,
    **overrides: Any,
) -> run.RunResult:
    """Train ``num_nodes`` nodes on Flower's simulation engine and save the merged model.

    Parameters
    ----------
    config : RunConfig, optional
        Run settings; defaults (digits, 5 nodes, 10 rounds, FedAvg) when omitted.
    output : path, optional
        Run folder (default ``runs/<timestamp>``): ``model.safetensors``, ``model.json``,
        ``metrics.jsonl``, ``summary.json``.
    console : rich.console.Console, optional
        Where to print the partition table and progress; ``None`` prints nothing.
    verbose : bool
        Show Flower's and Ray's own logs.
    cpus_per_node, gpus_per_node : float
        Resources each simulated node reserves; nodes run in parallel as far as the
        machine's cores (and GPUs) allow. GPUs: 1 per node when CUDA is used, else 0.
    overwrite : bool
        Allow ``output`` to hold a previous run, whose files are replaced.
    resume : path, optional
        Go on with the interrupted run in this folder from its last completed round
        (:mod:`fedavg.run.resume`); ``config`` defaults to its settings, of which only
        those in :data:`fedavg.run.resume.MAY_CHANGE` may change.
    tracking : fedavg.run.tracking.TrackingOptions, optional
        Also log the rounds to TensorBoard and/or MLflow.
    ray_address : str, optional
        Run the nodes on this existing Ray cluster (``HOST:PORT`` of its head, or
        ``auto``) instead of a Ray instance of the run's own; the node data goes through
        the cluster's object store, and the cluster keeps running afterwards.
    **overrides
        Flat settings applied on top of ``config`` (``num_nodes=10``, ``alpha=0.1`` ...).

    Returns
    -------
    fedavg.run.lifecycle.RunResult

    Raises
    ------
    UserError
        Invalid settings or data (nothing is written).
    RunError
        A round in which no node produced a usable model; finished rounds stay saved.
    TypeError
        An argument of another type (``overwrite="no"`` would read as yes), naming it.
    """
    started = time.monotonic()
    if config is not None and not isinstance(config, RunConfig):
        raise TypeError(f"config must be a RunConfig, got {type(config).__name__}; pass "
                        "settings as keywords: simulate(dataset=..., num_nodes=...)")
    _check_arguments(output=output, console=console, verbose=verbose, overwrite=overwrite,
                     resume=resume, tracking=tracking, ray_address=ray_address,
                     cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node)
    config, ckpt, output = resolve_settings(config, overrides, resume, output,
                                                overwrite=overwrite)
    config.validate()
    config, cut = privacy.within_budget(config, None if ckpt is None else ckpt.rounds)
    if cut and console is not None:
        console.print(f"[yellow]note:[/] {cut}", highlight=False, soft_wrap=True)
    _import_libraries(config.train.device)
    backend = _backend_config(config.train.device, cpus_per_node, gpus_per_node, verbose,
                              ray_address)
    run.quiet_logs(verbose)
    if output is not None and ckpt is None:
        run.check_output(Path(output), overwrite)

    with tracked(tracking, config.to_flat()) as trackers:
        return _prepare_and_run(config, ckpt, output, backend, console, trackers, started,
                                overwrite)


def _prepare_and_run(config: RunConfig, ckpt, output, backend: dict[str, Any], console,
                     trackers, started: float, overwrite: bool = False) -> run.RunResult:
    """Prepare the data, make the run folder, run the rounds and finish the run."""
    prepared = run.prepare(config)
    largest = max((len(p) for p in prepared.parts), default=0)
    weighs_one = config.merge.dp_clip_on == "node" and config.merge.dp_noise > 0
    if config.merge.secure_aggregation and not weighs_one and \
            largest > config.merge.secagg_max_weight:
        raise UserError(f"--secagg-max-weight {config.merge.secagg_max_weight:g} is below the "
                        f"largest partition ({largest} samples): SecAgg+ weighs a node by its "
                        f"samples up to it, so that node would drop out; give "
                        f"--secagg-max-weight {largest} or more")
    if config.train.dp_sgd:  # a record-level budget: the partitions' sizes are known now
        config, cut = privacy.within_budget(config, None if ckpt is None else ckpt.rounds,
                                            [len(p) for p in prepared.parts])
        prepared.meta["config"] = config.as_dict()
        if cut and console is not None:
            console.print(f"[yellow]note:[/] {cut}", highlight=False, soft_wrap=True)
    out = run.make_output(output, lock=True, overwrite=None if ckpt is not None else overwrite)

    show_plan(console, prepared, config)
    if ckpt is not None and console is not None:
        console.print(f"resuming {out} after round {ckpt.round} of {config.merge.rounds}")

    state = run.RunState()
    state.marks.update(imported=fedavg.IMPORTED_AT, entered=started, prepared=time.monotonic())
    try:
        trackers.open(out, 1 if ckpt is None else ckpt.round + 1)
        _run_on_ray(config, prepared, out, state, backend, console, ckpt, trackers)
    except KeyboardInterrupt:
        run.remove_if_empty(out)
        if not state.rounds:
            raise
        raise KeyboardInterrupt(f"interrupted after round {state.rounds[-1].round}, which is "
                                f"kept in {out}: fedavg.simulate(resume={str(out)!r}) goes "
                                "on") from None
    except BaseException:
        run.remove_if_empty(out)
        raise
    state.marks["stopped"] = time.monotonic()
    return run.finish(state, prepared, config, out, started,
                      num_nodes=config.merge.num_nodes, console=console)


def _run_on_ray(config: RunConfig, prepared: run.Prepared, out: Path, state: run.RunState,
                backend: dict[str, Any], console, resume_from=None, trackers=None) -> None:
    """Run the rounds on a Ray instance of this run's own, then stop it."""
    # lazy: loads cryptography, flwr, which only this path needs
    from fedavg.run.server_app import make_server_app

    with PrivateDir("fedavg-sim-") as tmp, _ray_folder(tmp) as (ray_dir, own), \
            abortable([tmp, own], ray_dir) as since:
        starting = RayStart(backend, ray_dir).start()  # while the rest is set up here
        progress, threads = None, set(threading.enumerate())
        try:
            cluster = "address" in backend["init_args"]
            data_path = str(Path(tmp) / "train.safetensors")
            if not cluster:  # memory-mapped by every node process of this machine
                write_node_data(data_path, prepared.data.train.x, prepared.data.train.y,
                                prepared.parts)
            progress = Progress(console, config.merge.rounds,
                                0 if resume_from is None else resume_from.round, trackers)
            contexts = _node_contexts(prepared.strategy.name, resume_from)
            server = make_server_app(config, prepared, out, state, progress,
                                     resume_from=resume_from, node_contexts=contexts)
            with held_interrupts():  # the engine's imports, while Ray starts
                import flwr.simulation  # noqa: F401

            _engine(config, prepared, state, backend, starting, server, contexts, data_path,
                    progress)
        except BaseException:  # Ctrl-C, an error: no engine thread may outlive the run
            state.stop.set()
            free_engine_threads(starting.actors, threads)
            raise
        finally:
            if progress is not None:
                progress.stop()
            starting.settle()
            shutdown_ray(since, ray_dir)
            starting.release()


def _engine(config: RunConfig, prepared: run.Prepared, state: run.RunState, backend, starting,
            server, contexts, data_path, progress) -> None:
    """Wait for Ray and the node actors, then run the rounds on Flower's engine."""
    # lazy: loads cryptography, flwr, which only this path needs
    from fedavg.node.clientapp import make_client_app

    try:
        progress.start()
        state.marks["node_data"] = time.monotonic()
        actors = starting.wait()
        state.marks["ray"] = time.monotonic()
        if "address" in backend["init_args"]:  # other machines' nodes read the object store
            import ray

            data_path = ray.put(node_arrays(prepared.data.train.x, prepared.data.train.y,
                                            prepared.parts))
        client = make_client_app(data_path, device=config.train.device)
        with contexts.attached(), prestarted_actors(actors):
            _run_engine(server, client, config.merge.num_nodes, backend, config.data.seed)
    except UserError:
        raise
    except Exception as exc:
        if state.error is not None:
            raise state.error from None
        raise RunError(f"simulation engine failed: {str(exc).splitlines()[0]}") from exc


def _node_contexts(method: str, resume_from=None):
    """Return the engine's node contexts, seeded with a resumed run's node states."""
    # lazy: loads cryptography, flwr, which only this path needs
    from fedavg.node.clientapp import node_records

    saved = {} if resume_from is None else resume_from.node_states
    return NodeContexts({pid: node_records(method, sd, resume_from.round)
                         for pid, sd in saved.items()})


#: Ray's longest socket path below its folder, ``/session_<date>_<time>_<us>_<pid>/sockets/
#: plasma_store`` with a pid of up to 7 digits; a Unix socket path holds at most 107 bytes.
_RAY_SOCKET_TAIL = 64


@contextlib.contextmanager
def _ray_folder(tmp: str):
    """Yield Ray's folder for this run, ``tmp/ray``, and the folder to remove on exit.

    Where that path is too long for Ray's Unix sockets (a deep ``TMPDIR``), Ray's folder is
    in a short folder of ours in ``/tmp`` instead (``fedavg-ray-<pid>-*``).
    """
    folder, short = str(Path(tmp) / "ray"), None
    if len(os.fsencode(folder)) + _RAY_SOCKET_TAIL > 107:
        short = PrivateDir("fedavg-ray-", base="/tmp", tag=f"{os.getpid()}-")
        folder = str(Path(short.name) / "ray")
    try:
        yield folder, (folder if short is None else short.name)
    finally:
        if short is not None:
            short.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


def _run_engine(server, client, num_nodes: int, backend: dict[str, Any], seed: int) -> None:
    from flwr.simulation import run_simulation

    # the same nodes sampled in every run of a seed; rounds that do not slow down with nodes;
    # an engine that ends with its last round and leaves stopping Ray to shutdown_ray
    with seeded_simulation_ids(seed), fast_message_dispatch(), prompt_stop():
        run_simulation(server_app=server, client_app=client, num_supernodes=num_nodes,
                       backend_config=backend)
