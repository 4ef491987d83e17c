"""``fedavg simulate``: N nodes on one machine, on Flower's simulation engine (Ray backend).

The driver loads and partitions the data once, writes the partitioned training arrays to a
temporary file that every node process memory-maps once, builds the ServerApp
(:mod:`fedavg.coordinator`) and ClientApp (:mod:`fedavg.node`) and runs them with
``flwr.simulation.run_simulation``. The simulation runs in this process: no SuperLink, no
per-run dependency installation, and Ray is shut down on return, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedavg.config import RunConfig
from fedavg.data import LoadedData, Split, conform, holdout, load
from fedavg.errors import RunError, UserError
from fedavg.partition import label_counts, partition

log = logging.getLogger("fedavg")


@dataclass
class Prepared:
    """Data, partitions and model spec of a run, before any training."""

    data: LoadedData
    parts: list[np.ndarray]
    spec: Any  # fedavg.coordinator.ModelSpec
    meta: dict[str, Any]
    validation: Split | None = None
    distill_x: np.ndarray | None = None


@dataclass
class SimulationResult:
    """What :func:`simulate` returns.

    Attributes
    ----------
    accuracy, loss : float
        Test accuracy (fraction) and mean cross-entropy (nats) of the final merged model.
    rounds : list of dict
        One entry per round, as in ``metrics.jsonl``.
    output : pathlib.Path
        Run folder; ``model_dir`` is the same folder (load it with :func:`fedavg.load_model`).
    wall_s : float
        Seconds from start to end of the run, data loading included.
    """

    accuracy: float
    loss: float
    rounds: list[dict[str, Any]]
    output: Path
    wall_s: float
    num_nodes: int
    failures: list[str] = field(default_factory=list)
    #: the Flower run id (``fedavg coordinator`` only)
    run_id: int | None = None

    @property
    def model_dir(self) -> Path:
        """Folder holding ``model.safetensors`` and ``model.json``."""
        return self.output

    @property
    def metrics_path(self) -> Path:
        """``metrics.jsonl``: one JSON object per round."""
        return self.output / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        """``summary.json``: the run's final figures and settings."""
        return self.output / "summary.json"


def default_output() -> Path:
    """A new ``runs/<YYYYmmdd-HHMMSS>[-N]`` folder under the current folder (created)."""
    base = Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            continue
    raise UserError(f"cannot find a free run folder next to {base}; pass --output")


RUN_FILES = ("model.safetensors", "model.json", "metrics.jsonl", "summary.json")


def make_output(output: str | Path | None) -> Path:
    """Create the run folder: ``output``, or a new :func:`default_output`.

    Raises
    ------
    UserError
        It cannot be created.
    """
    out = Path(output) if output is not None else default_output()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output folder {out}: {exc.strerror}") from None
    return out


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to write over a previous run's files unless ``overwrite``.

    Raises
    ------
    UserError
        ``out`` is a file, or holds a run and ``overwrite`` is false.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a folder")
    if not overwrite and any((out / name).exists() for name in RUN_FILES):
        raise UserError(f"{out} already holds a run; choose another --output or pass "
                        "--overwrite to replace it")


def prepare(config: RunConfig) -> Prepared:
    """Load the dataset, partition it and choose the model.

    Raises
    ------
    UserError
        Bad dataset, columns, partitioning or model.
    """
    from fedavg.coordinator import ModelSpec
    from fedavg.models import build_model, resolve_model

    d, m = config.data, config.merge
    strategy = config.strategy()
    data = load(d.dataset, image_column=d.image_column, label_column=d.label_column,
                partition_by=d.partition_by if d.partitioner == "natural" else None,
                seed=d.seed, test_fraction=d.test_fraction)
    validation, distill_x = None, None
    if strategy.needs_validation:
        if m.validation:
            validation = _aligned_split(m.validation, data, "--validation")
        else:
            data.splits["train"], validation = holdout(data.train, m.validation_fraction,
                                                       d.seed + 1)
            data.notes.append(f"validation for {m.strategy}: {len(validation)} train samples "
                              f"({m.validation_fraction:.0%}) kept from the nodes")
    if strategy.needs_unlabeled:
        if m.distill_data:
            distill_x = _aligned_split(m.distill_data, data, "--distill-data", labels=False).x
        else:
            data.splits["train"], unlabeled = holdout(data.train, m.distill_fraction, d.seed + 2)
            distill_x = unlabeled.x
            data.notes.append(f"distillation data: {len(distill_x)} train samples "
                              f"({m.distill_fraction:.0%}) kept from the nodes, labels removed")
    parts = partition(data.train.y, config.merge.num_nodes, d.partitioner, alpha=d.alpha,
                      classes_per_node=d.classes_per_node, groups=data.train.groups,
                      seed=d.seed)
    name = resolve_model(config.train.model, data.input_shape)
    spec = ModelSpec(name, data.input_shape, len(data.classes))
    build_model(spec.name, spec.input_shape, spec.num_classes)  # fail early on bad shapes
    meta = {
        "model": spec.as_dict(),
        "classes": data.classes,
        "input": data.input_spec(),
        "dataset": {
            # a local path is stored absolute, so that evaluate works from any folder
            "source": str(Path(data.source).expanduser().resolve())
            if data.source not in ("digits",) and Path(data.source).expanduser().exists()
            else data.source,
            "columns": data.columns,
            "train_samples": len(data.train),
            "test_samples": len(data.test),
            "seed": d.seed,
            "test_fraction": d.test_fraction,
            "validation_samples": 0 if validation is None else len(validation),
            "distill_samples": 0 if distill_x is None else len(distill_x),
            "notes": data.notes,
        },
        "strategy": config.merge.strategy,
        "config": config.as_dict(),
    }
    return Prepared(data, parts, spec, meta, validation, distill_x)


def _aligned_split(source: str, data: LoadedData, flag: str, labels: bool = True) -> Split:
    """The train split of another dataset, checked against ``data``'s inputs and classes."""
    other = load(source)
    return conform(other.train, f"{flag} {source}", data.input_shape,
                   other.classes if labels else None, data.classes)


def write_node_data(path: str | Path, x: np.ndarray, y: np.ndarray,
                    parts: list[np.ndarray]) -> None:
    """Write training arrays and partitions for the node processes (safetensors, no pickle)."""
    from safetensors.numpy import save_file

    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    indices = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    save_file({"x": np.ascontiguousarray(x), "y": np.ascontiguousarray(y, dtype=np.int64),
               "offsets": offsets, "indices": indices}, str(path))


def partition_table(prepared: Prepared, max_rows: int = 12):
    """A rich Table: samples per node and label spread."""
    from rich.table import Table

    classes = prepared.data.classes
    counts = label_counts(prepared.data.train.y, prepared.parts, len(classes))
    table = Table(title=f"{len(prepared.parts)} nodes, {prepared.meta['config']['data']['partitioner']}"
                  f" partition of {len(prepared.data.train)} samples", title_justify="left")
    table.add_column("node", justify="right")
    table.add_column("samples", justify="right")
    table.add_column("labels", justify="right")
    table.add_column("top label (share)", justify="right")
    table.add_column("smallest label (share)", justify="right")
    rows = list(range(len(prepared.parts)))
    if len(rows) > max_rows:
        rows = rows[: max_rows - 2] + rows[-2:]
    for i in rows:
        c = counts[i]
        total = int(c.sum())
        present = np.flatnonzero(c)
        top = int(c.argmax())
        low = int(present[c[present].argmin()]) if len(present) else 0
        table.add_row(str(i), str(total), f"{len(present)}/{len(classes)}",
                      f"{classes[top][:12]} ({c[top] / max(total, 1):.0%})",
                      f"{classes[low][:12]} ({c[low] / max(total, 1):.0%})")
    if len(prepared.parts) > max_rows:
        table.caption = f"{len(prepared.parts) - max_rows} more nodes not shown"
    return table


def _quiet_logs(verbose: bool) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # A Ray call racing the end of a run must fail, not start a new Ray instance.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    import flwr.common.logger  # noqa: F401  (configures the "flwr" logger on import)

    level = logging.INFO if verbose else logging.CRITICAL
    logging.getLogger("flwr").setLevel(level)


def _backend_config(device: str, cpus_per_node: float, gpus_per_node: float | None,
                    verbose: bool) -> dict[str, Any]:
    import torch

    cores = os.cpu_count() or 1
    use_gpu = device != "cpu" and torch.cuda.is_available()
    gpus = torch.cuda.device_count() if use_gpu else 0
    if gpus_per_node is None:
        gpus_per_node = 1.0 if gpus else 0.0
    if cpus_per_node <= 0 or cpus_per_node > cores:
        raise UserError(f"--cpus-per-node must be in (0, {cores}] on this machine")
    if gpus_per_node < 0 or (gpus_per_node > 0 and not gpus):
        raise UserError("--gpus-per-node > 0 needs a CUDA device; use --device cpu")
    return {
        "client_resources": {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node},
        "init_args": {
            "num_cpus": cores,
            "num_gpus": gpus,
            "include_dashboard": False,
            "logging_level": logging.INFO if verbose else logging.ERROR,
            "log_to_driver": verbose,
        },
    }


def simulate(
    config: RunConfig | None = None,
    *,
    output: str | Path | None = None,
    console=None,
    verbose: bool = False,
    cpus_per_node: float = 1.0,
    gpus_per_node: float | None = None,
    overwrite: bool = False,
    **overrides: Any,
) -> SimulationResult:
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
    **overrides
        Flat settings applied on top of ``config`` (``num_nodes=10``, ``alpha=0.1`` ...).

    Returns
    -------
    SimulationResult

    Raises
    ------
    UserError
        Invalid settings or data (nothing is written).
    RunError
        A round in which no node produced a usable model; finished rounds stay saved.
    """
    t0 = time.monotonic()
    config = config or RunConfig()
    if overrides:
        config = config.replace(**overrides)
    config.validate()
    from fedavg.train import resolve_device

    resolve_device(config.train.device)
    backend = _backend_config(config.train.device, cpus_per_node, gpus_per_node, verbose)
    _quiet_logs(verbose)
    if output is not None:
        check_output(Path(output), overwrite)

    prepared = prepare(config)
    out = make_output(output)
    if console is not None:
        for note in prepared.data.notes:
            console.print(f"[yellow]note:[/] {note}")
        console.print(partition_table(prepared))
        console.print(
            f"model [bold]{prepared.spec.name}[/] on inputs {tuple(prepared.spec.input_shape)}, "
            f"{prepared.spec.num_classes} classes; strategy [bold]{config.merge.strategy}[/], "
            f"{config.merge.rounds} rounds, {config.nodes_per_round}/{config.merge.num_nodes} "
            f"nodes per round, {config.train.local_epochs} local epoch(s)"
        )

    from fedavg.coordinator import RunState, make_server_app
    from fedavg.node import make_client_app

    state = RunState()
    with tempfile.TemporaryDirectory(prefix="fedavg-") as tmp, _abortable(tmp) as since:
        data_path = str(Path(tmp) / "train.safetensors")
        write_node_data(data_path, prepared.data.train.x, prepared.data.train.y, prepared.parts)
        progress, on_round, on_failure = _progress(console, config)
        server = make_server_app(config, prepared.spec, prepared.data.test, prepared.meta, out,
                                 state, on_round=on_round, on_failure=on_failure,
                                 validation=prepared.validation, distill_x=prepared.distill_x)
        client = make_client_app(data_path, device=config.train.device)
        try:
            if progress is not None:
                progress.start()
            _init_ray(backend, str(Path(tmp) / "ray"))
            _run_engine(server, client, config.merge.num_nodes, backend)
        except Exception as exc:
            if state.error is not None and isinstance(state.error, (RunError, UserError)):
                raise state.error from None
            if state.error is not None:
                raise state.error
            raise RunError(f"simulation engine failed: {str(exc).splitlines()[0]}") from exc
        finally:
            if progress is not None:
                progress.stop()
            shutdown_ray(since, tmp)
    if state.error is not None:
        raise state.error
    if len(state.rounds) != config.merge.rounds:
        raise RunError(
            f"the run stopped after {len(state.rounds)} of {config.merge.rounds} rounds; "
            f"finished rounds are in {out}"
        )
    wall = time.monotonic() - t0
    last = state.rounds[-1]
    result = SimulationResult(
        accuracy=last.accuracy,
        loss=last.loss,
        rounds=[r.as_dict() for r in state.rounds],
        output=out,
        wall_s=round(wall, 3),
        num_nodes=config.merge.num_nodes,
        failures=state.failures,
    )
    _write_summary(result, prepared, config)
    if console is not None:
        console.print(rounds_table(result.rounds))
        console.print(
            f"[bold green]done[/] in {wall:.1f} s: test accuracy [bold]{last.accuracy:.4f}[/], "
            f"loss {last.loss:.4f}; model saved in [bold]{out}[/]"
        )
    return result


def _write_summary(result: SimulationResult, prepared: Prepared, config: RunConfig) -> None:
    from fedavg.checkpoint import write_json

    write_json(
        result.summary_path,
        {
            "accuracy": result.accuracy,
            "loss": result.loss,
            "best_accuracy": max(r["accuracy"] for r in result.rounds),
            "rounds": len(result.rounds),
            "num_nodes": result.num_nodes,
            "wall_s": result.wall_s,
            "strategy": config.merge.strategy,
            "model": prepared.spec.name,
            "dataset": prepared.data.source,
            "train_samples": len(prepared.data.train),
            "test_samples": len(prepared.data.test),
            "failures": result.failures,
            "config": config.as_dict(),
        },
    )


def rounds_table(rounds: list[dict[str, Any]]):
    """A rich Table of per-round metrics."""
    from rich.table import Table

    table = Table(title="rounds", title_justify="left")
    for col in ("round", "accuracy", "loss", "train loss", "nodes", "wall s"):
        table.add_column(col, justify="right")
    for r in rounds:
        tl = r.get("train_loss")
        table.add_row(str(r["round"]), f"{r['accuracy']:.4f}", f"{r['loss']:.4f}",
                      "-" if tl is None else f"{tl:.4f}",
                      f"{r['num_nodes']}" + (f" ({r['num_failed']} failed)" if r.get("num_failed")
                                             else ""),
                      f"{r['wall_s']:.2f}")
    return table


def _progress(console, config: RunConfig):
    if console is None:
        return None, None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"),
                        console=console, transient=True)
    task = progress.add_task("training round 1", total=config.merge.rounds)

    def on_round(rec) -> None:
        progress.console.print(
            f"round {rec.round:>3}/{config.merge.rounds}: accuracy {rec.accuracy:.4f}  "
            f"loss {rec.loss:.4f}  train loss "
            f"{rec.train_loss if rec.train_loss is None else format(rec.train_loss, '.4f')}  "
            f"nodes {rec.num_nodes}  {rec.wall_s:.2f} s"
        )
        nxt = rec.round + 1
        progress.update(task, advance=1, description=(
            f"training round {nxt}" if nxt <= config.merge.rounds else "finishing"))

    def on_failure(server_round: int, node: int, reason: str) -> None:
        progress.console.print(f"[red]round {server_round}: node {node} failed:[/] {reason}")

    return progress, on_round, on_failure


def _init_ray(backend: dict[str, Any], temp_dir: str) -> None:
    """Start Ray as Flower's Ray backend would, keeping the application's signal handlers.

    Flower's backend reuses an initialised Ray. Starting it here lets a handler the
    application installed for SIGINT / SIGTERM (the CLI's clean shutdown) stay in force:
    ``ray.init`` replaces it with Ray's own, which exits without our clean-up.
    """
    import signal
    import sys
    import threading

    import ray

    from ray._private import auto_init_hook

    # Flower's engine threads still call Ray while the run ends; with auto-connect on, such a
    # call after shutdown starts a fresh Ray instance that outlives the command.
    auto_init_hook.enable_auto_connect = False
    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    # A Ray folder of this run's own: its processes can be told from another run's.
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, _temp_dir=temp_dir,
             **backend["init_args"])
    for sig, handler in saved.items():
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, handler)


def _run_engine(server, client, num_nodes: int, backend: dict[str, Any]) -> None:
    from flwr.simulation import run_simulation

    run_simulation(server_app=server, client_app=client, num_supernodes=num_nodes,
                   backend_config=backend)


_ACTIVE: list[Callable[[], None]] = []


@contextlib.contextmanager
def _abortable(tmp: str):
    """Register how to clean up this run if the process must stop at once (signal)."""
    since = time.time()

    def abort() -> None:
        # From a signal handler, while Flower's threads still use Ray: any Ray call now can
        # make Ray's core worker end this process, and once the raylet is gone it will (with
        # exit code 1). So: no Ray call; freeze every Ray process, remove the temporary data,
        # and leave the killing to a child that waits for this process to exit first.
        kill_after_exit(since, tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    _ACTIVE.append(abort)
    try:
        yield since
    finally:
        _ACTIVE.remove(abort)


def abort_active_runs() -> None:
    """Stop the engines of runs in progress and remove their temporary files.

    For signal handlers: after this the process can exit at once (``os._exit``) without
    leaving Ray processes or temporary data behind. Finished rounds stay in the run folder.
    """
    for abort in reversed(list(_ACTIVE)):
        with contextlib.suppress(Exception):
            abort()


def _ray_processes(since: float, marker: str) -> list:
    """This run's Ray processes: started at or after ``since`` (epoch seconds), in our
    process group, and using this run's Ray folder ``marker`` (command line or open files).

    Ray's agents can be respawned by a raylet that is shutting down and then outlive it,
    re-parented away from us; they keep our process group and their log files in our Ray
    folder, which is how they are found without touching another run's Ray.
    """
    import psutil

    me, pgid = os.getpid(), os.getpgid(0)
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time", "status"]):
        info = proc.info
        if proc.pid == me or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if (info["create_time"] or 0) < since:
            continue
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
        except OSError:
            continue
        name = info["name"] or ""
        cmd = " ".join(info["cmdline"] or [])
        if not (name.startswith(("ray::", "raylet", "gcs_server")) or "ray::" in cmd
                or f"{os.sep}ray{os.sep}" in cmd):
            continue
        try:
            if marker in cmd or any(f.path.startswith(marker) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_after_exit(since: float, marker: str) -> None:
    """Freeze this run's Ray processes now; kill them once this process has exited.

    All are frozen at once (SIGSTOP), so that none can react (the raylet respawning its
    agents, our own core worker noticing a dead raylet and ending this process with code
    1). A forked child sends the SIGKILLs once this process has exited (at most 5 seconds
    later), so that this process's exit code is its own.
    """
    import signal

    import psutil

    procs = {p.pid: p for p in psutil.Process().children(recursive=True)}
    procs.update({p.pid: p for p in _ray_processes(since, marker)})
    order = []
    for pid, proc in procs.items():
        with contextlib.suppress(psutil.Error):
            if proc.create_time() >= since:
                order.append(pid)
    for pid in order:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    parent = os.getpid()
    if os.fork() != 0:
        return
    try:  # the child: only plain system calls from here
        deadline = time.monotonic() + 5.0
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.005)
        for pid in order:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(0)


def shutdown_ray(since: float, marker: str, timeout_s: float = 10.0) -> None:
    """Stop Ray if this process started it, and wait until its processes are gone.

    ``ray.shutdown()`` returns while the raylet and GCS server are still exiting, and Ray's
    agents can outlive a raylet that died first. This shuts Ray down, waits up to
    ``timeout_s`` seconds for the processes it started (our descendants, and the Ray
    processes using this run's Ray folder ``marker``, started at or after ``since``, epoch
    seconds) and kills whatever is still alive, so that nothing outlives the command.
    """
    import psutil

    me = psutil.Process()

    def ours() -> dict:
        procs = {}
        for p in me.children(recursive=True) + _ray_processes(since, marker):
            with contextlib.suppress(psutil.Error):
                if p.create_time() >= since:
                    procs[p.pid] = p
        return procs

    procs = ours()
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - clean up the processes below in any case
        log.debug("ray.shutdown failed", exc_info=True)
    for attempt in range(3):
        procs.update(ours())
        if not procs:
            return
        _, alive = psutil.wait_procs(list(procs.values()), timeout=timeout_s if attempt == 0 else 2)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=2.0)
        time.sleep(0.3)  # let a respawn race show itself
        procs = {}
