"""The coordinator role: ``fedavg coordinator``.

It starts a Flower SuperLink (``--isolation process``), submits the run through its Control
API as a FAB whose run config holds every training setting (:func:`write_app`), and runs our
ServerApp for it in this process (:func:`fedavg.flower_compat.run_server_task`). The rounds
and everything around them are the same as in ``fedavg simulate`` (:mod:`fedavg.run.lifecycle`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rich.markup import escape

from fedavg import __version__, flower_compat
from fedavg.engines.deployment.coordinator_options import CoordinatorOptions
from fedavg.engines.deployment.processes import (
    FlowerProcess,
    PrivateDir,
    check_port_free,
    flower_env,
    join_address,
    secret_file,
    split_address,
)
from fedavg.engines.deployment.tls import (
    CA_CERT,
    SERVER_CERT,
    SERVER_KEY,
    check_server_certs,
    load_auth_keys,
    resolve_certs,
)
from fedavg.run import privacy
from fedavg.run.display import Progress, recipe_text, reporter, show_plan
from fedavg.run.lifecycle import (
    RunState,
    check_output,
    finish,
    make_output,
    prepare,
    quiet_logs,
    remove_if_empty,
)
from fedavg.run.output import RUN_OUTPUT
from fedavg.run.tracking import tracked
from fedavg.util.errors import RunError, UserError

if TYPE_CHECKING:
    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import RunResult

log = logging.getLogger("fedavg")

CERT_HINT = ("the coordinator cannot verify its own certificate: --certs must hold a "
             "coordinator.crt signed by its ca.crt and valid for {host} (make one with "
             "`fedavg certs DIR --host {host}`)")


@dataclass
class _Options:
    """The checked options of one coordinator run."""

    config: RunConfig
    host: str
    port: int
    certs: Path | None
    keys_pem: list[bytes] | None
    min_nodes: int
    per_round: int
    wait_timeout: float
    verbose: bool = False
    output: Path | None = None
    resume_from: Any = None  # a fedavg.run.resume.Checkpoint
    overwrite: bool = False
    budget_note: str | None = None  # --dp-epsilon cut the rounds

    @property
    def local(self) -> str:
        """Where this machine reaches its own SuperLink."""
        return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    @property
    def connect(self) -> str:
        """``host:port`` of the SuperLink from this machine."""
        return join_address(self.local, self.port)

    @property
    def ca_cert(self) -> Path | None:
        """The CA certificate, or ``None`` without TLS."""
        return None if self.certs is None else self.certs / CA_CERT


def coordinate(config: RunConfig, options: CoordinatorOptions = CoordinatorOptions(),
               console=None, tracking=None) -> RunResult:
    """Run the coordinator of one run across machines and save the merged model.

    Parameters
    ----------
    config : RunConfig
        Run settings (``num_nodes`` is replaced by ``options.min_nodes``).
    options : CoordinatorOptions
        Where to listen, TLS and node keys, the nodes to wait for, the run folder, resume.
    console : rich.console.Console, optional
        Where to print progress.
    tracking : fedavg.run.tracking.TrackingOptions, optional
        Also log the rounds to TensorBoard and/or MLflow.

    Returns
    -------
    fedavg.run.lifecycle.RunResult
        As from ``fedavg simulate``, with the Flower ``run_id``; ``wall_s`` includes
        waiting for nodes.

    Raises
    ------
    UserError
        Bad settings, certificates, keys or address (nothing is written).
    RunError
        Too few nodes in time, or a round without enough usable models; finished rounds
        stay saved.
    """
    started = time.monotonic()
    opts = _check_options(config, options)
    flower_compat.check_flower_internals()
    flower_compat.patch_pull_backoff()
    with tracked(tracking, opts.config.to_flat()) as trackers:
        return _prepare_and_run(opts, console, trackers, started)


def _prepare_and_run(opts: _Options, console, trackers, started: float) -> RunResult:
    """Prepare the data, run the rounds across machines and finish the run."""
    prepared = prepare(opts.config)
    check_port_free(opts.host, opts.port)
    quiet_logs(opts.verbose)
    state = RunState()
    out, run_id = _run_keeping_nothing_empty(opts, prepared, state, console, trackers)
    return finish(state, prepared, opts.config, out, started, num_nodes=opts.min_nodes,
                  run_id=run_id, console=console)


def _run_keeping_nothing_empty(opts: _Options, prepared, state, console,
                               trackers) -> tuple[Path, int]:
    """Run :func:`_run`; remove the run folder again if the run failed before round 1."""
    RUN_OUTPUT.clear()
    try:
        return _run(opts, prepared, state, console, trackers)
    except BaseException:
        if RUN_OUTPUT:
            remove_if_empty(RUN_OUTPUT[0])
        raise


def _run(opts: _Options, prepared, state, console, trackers) -> tuple[Path, int]:
    """Start the SuperLink, submit the run and run its rounds; stop the SuperLink either way.

    Returns
    -------
    tuple
        The run folder and Flower's run id.
    """
    say = reporter(console, opts.certs is None)
    tmp = PrivateDir("fedavg-coordinator-")
    link = None
    try:
        home = Path(tmp.name)
        secret_path, secret = secret_file(home)
        link = FlowerProcess("superlink", _superlink_args(opts, secret_path), flower_env(home),
                             echo=_superlink_echo(say, opts.verbose))
        out, run_id = _submit(link, opts, home, opts.output, say)
        if opts.budget_note:
            say(f"[yellow]note:[/] {opts.budget_note}")
        show_plan(console, prepared, opts.config, table=False)
        if opts.resume_from is not None:
            say(f"resuming {out} after round {opts.resume_from.round} of "
                f"{opts.config.merge.rounds}")
        say(f"run {run_id}: model [bold]{prepared.spec.name}[/], strategy "
            f"[bold]{opts.config.merge.strategy}[/], {opts.config.merge.rounds} "
            f"round{'' if opts.config.merge.rounds == 1 else 's'}"
            f"{recipe_text(opts.config, prepared)}; waiting "
            f"for {opts.min_nodes} node(s) (up to {opts.wait_timeout:g} s)")
        endpoint = flower_compat.Endpoint(
            opts.connect, None if opts.ca_cert is None else opts.ca_cert.read_bytes(), secret)
        trackers.open(out, 1 if opts.resume_from is None else opts.resume_from.round + 1)
        _run_rounds(link, endpoint, run_id, opts, prepared, out, state, console, say,
                    trackers)
    finally:
        if link is not None:
            link.stop()
        tmp.cleanup()
    return out, run_id


def _check_options(config: RunConfig, options: CoordinatorOptions) -> _Options:
    """Check every option before anything starts (see :func:`coordinate`)."""
    # lazy: loads torch, which only this path needs
    from fedavg.models.evaluation import resolve_device
    from fedavg.run.resume import MAY_CHANGE, resolve_settings

    o = options
    config, ckpt, output = resolve_settings(config, {}, o.resume, o.output,
                                            may_change=MAY_CHANGE | {"num-nodes"},
                                            overwrite=o.overwrite)
    min_nodes, wait_timeout = o.min_nodes, o.wait_timeout
    if min_nodes is None:  # a resumed run waits for as many nodes as it did
        min_nodes = ckpt.run_config().merge.num_nodes if ckpt is not None else 2
    if min_nodes < 1:
        raise UserError(f"--min-nodes must be at least 1, got {min_nodes}")
    if not wait_timeout > 0:  # nan too
        raise UserError(f"--wait-timeout must be > 0 seconds, got {wait_timeout:g}")
    config = config.replace(num_nodes=min_nodes).validate()
    if config.train.dp_sgd and config.merge.dp_epsilon is not None:
        raise UserError("--dp-epsilon with --dp-sgd: the coordinator cannot tell what a round "
                        "spends before the nodes report their partitions' sizes; leave the "
                        "budget out and choose --rounds (each round's line gives epsilon)")
    config, budget_note = privacy.within_budget(config, None if ckpt is None else ckpt.rounds)
    least = 2 if config.merge.secure_aggregation else 1  # SecAgg+ sums 2 nodes or more
    per_round = (o.min_nodes_per_round if o.min_nodes_per_round is not None
                 else max(least, -(-config.nodes_per_round // 2)))
    if config.merge.secure_aggregation and per_round == 1:
        raise UserError(f"--secure-aggregation needs --min-nodes-per-round of at least 2, "
                        f"got {per_round}")
    if not 1 <= per_round <= min_nodes:
        raise UserError(f"--min-nodes-per-round must be in 1..--min-nodes ({min_nodes}), "
                        f"got {per_round}")
    host, port = split_address(o.address)
    certs = resolve_certs(o.certs, o.insecure, "coordinator")
    if certs is not None:
        check_server_certs(certs)
    keys_pem = load_auth_keys(o.auth_keys) if o.auth_keys is not None else None
    if keys_pem is not None and certs is None:
        raise UserError("--auth-keys needs TLS: pass --certs, not --insecure")
    resolve_device(config.train.device)
    if output is not None and ckpt is None:
        check_output(Path(output), o.overwrite)
    return _Options(config, host, port, certs, keys_pem, min_nodes, per_round, wait_timeout,
                    o.verbose, output, ckpt, o.overwrite, budget_note)


def _superlink_args(opts: _Options, secret_path: Path) -> list[str]:
    args = ["--isolation", "process", "--host", opts.host, "--port", str(opts.port),
            "--superexec-auth-secret-file", str(secret_path),
            "--disable-runtime-dependency-installation"]
    if opts.certs is None:
        args.append("--insecure")
    else:
        args += ["--ssl-ca-certfile", str(opts.certs / CA_CERT),
                 "--ssl-certfile", str(opts.certs / SERVER_CERT),
                 "--ssl-keyfile", str(opts.certs / SERVER_KEY)]
    if opts.keys_pem is not None:
        args.append("--enable-supernode-auth")
    return args


def _superlink_echo(say: Callable[[str], None], verbose: bool = False,
                    repeat_after_s: float = 60.0) -> Callable[[str], None]:
    """Show the SuperLink's errors, or every line if ``verbose``.

    A refused node is said in one line, at most once a minute.
    """
    shown: dict[str, float] = {}

    def echo(line: str) -> None:
        refusal = flower_compat.superlink_node_refusal(line)
        if refusal is None:
            if flower_compat.superlink_line_is_error(line):
                say(f"[red]superlink:[/] {escape(line[:160])}")
            elif verbose:
                say(f"[dim]superlink:[/] {escape(line)}")
            return
        now = time.monotonic()
        if refusal and now - shown.get(refusal, -repeat_after_s) >= repeat_after_s:
            shown[refusal] = now
            say(f"[yellow]coordinator:[/] {escape(refusal)}")

    return echo


def _submit(link: FlowerProcess, opts: _Options, home: Path, output: Path | None,
            say: Callable[[str], None]) -> tuple[Path, int]:
    """Wait for the SuperLink, create the run folder, register node keys, start the run."""
    control = _wait_ready(link, opts)
    try:
        # only once the SuperLink runs: a failed start writes nothing
        out = make_output(output, lock=True,
                          overwrite=None if opts.resume_from is not None else opts.overwrite)
        say(f"coordinator listening on [bold]{join_address(opts.host, opts.port)}[/] "
            f"({'TLS' if opts.certs else 'NO TLS'}"
            f"{', node authentication' if opts.keys_pem else ''})")
        if opts.keys_pem is not None:
            flower_compat.register_node_keys(control, opts.keys_pem)
            say(f"{len(opts.keys_pem)} node key(s) registered")
        run_id = flower_compat.start_run(control, write_app(home / "app", opts.config))
    finally:
        control.close()
    return out, run_id


def _wait_ready(link: FlowerProcess, opts: _Options, timeout_s: float = 60.0):
    """Wait for the SuperLink's Control API; return a client for it."""
    def check_alive() -> None:
        if not link.alive():
            raise UserError(f"the SuperLink could not start: {link.last_error()}")

    try:
        return flower_compat.wait_control_ready(opts.connect, opts.ca_cert, check_alive,
                                                timeout_s)
    except flower_compat.CertificateRejected as exc:
        raise UserError(CERT_HINT.format(host=opts.local) + f" ({exc})") from None
    except TimeoutError as exc:
        raise RunError(f"the SuperLink did not answer on {opts.connect} within {timeout_s:g} s "
                       f"({exc})") from None


def _run_rounds(link: FlowerProcess, endpoint, run_id: int, opts: _Options, prepared, out: Path,
                state, console, say: Callable[[str], None], trackers=None) -> None:
    """Take the run's ServerApp task from the SuperLink and run the rounds in this process."""
    # lazy: loads cryptography, flwr, torch, which only this path needs
    from fedavg.run.server_app import Deployment, make_server_app

    known: list[int] = []

    def on_nodes(nodes: list[int]) -> None:
        joined = [n for n in nodes if n not in known]
        left = [n for n in known if n not in nodes]
        known[:] = nodes
        change = ", ".join([f"+{n}" for n in joined] + [f"-{n}" for n in left])
        say(f"{len(nodes)} node(s) connected ({change})")

    deployment = Deployment(min_nodes=opts.min_nodes, wait_timeout=opts.wait_timeout,
                            min_nodes_per_round=opts.per_round, on_nodes=on_nodes)
    done = 0 if opts.resume_from is None else opts.resume_from.round
    progress = Progress(console, opts.config.merge.rounds, done, trackers)
    server = make_server_app(opts.config, prepared, out, state, progress=progress,
                             deployment=deployment, resume_from=opts.resume_from)
    token = _acquire_server_task(endpoint, run_id, link)
    try:
        progress.start()
        flower_compat.run_server_task(endpoint, token, server, alive=link.alive)
    except (RunError, UserError):
        if not link.alive():
            raise RunError(f"the SuperLink process {link.ended()} during the run") from None
        raise
    except Exception as exc:
        if not link.alive():  # what the grid's failed request comes from
            raise RunError(f"the SuperLink process {link.ended()} during the run") from None
        if state.error is not None and isinstance(state.error, (RunError, UserError)):
            raise state.error from None
        raise RunError(f"the run failed: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                       ) from exc
    finally:
        progress.stop()


def _acquire_server_task(endpoint, run_id: int, link: FlowerProcess,
                         timeout_s: float = 60.0) -> str:
    """Wait for the SuperLink to hand over the ServerApp task of ``run_id``; return its token."""
    source = flower_compat.TaskSource(endpoint, flower_compat.SERVER_TASK)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not link.alive():
                raise RunError(f"the SuperLink stopped: {link.last_error()}")
            try:
                got = source.acquire()
            except Exception as exc:  # noqa: BLE001 - checked against the SuperLink next
                log.debug("acquire: %s", exc)
                got = None
            if got is not None:
                token, task = got
                if int(task.run_id) == run_id:
                    return token
                log.warning("ignoring task of run %s, which this coordinator did not submit",
                            task.run_id)
            time.sleep(0.1)
    finally:
        source.close()
    raise RunError(f"the SuperLink did not hand over run {run_id} within {timeout_s:g} s")


def write_app(folder: Path, config: RunConfig) -> Path:
    """Write the Flower app (``pyproject.toml``) whose FAB carries the run's settings.

    The FAB names our apps as components and holds no code: nodes run the installed
    ``fedavg``. Its ``[tool.flwr.app.config]`` is the run config the nodes read.

    Returns
    -------
    pathlib.Path
        ``folder``.
    """
    def toml_value(v: Any) -> str:
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


    lines = [
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", 'name = "fedavg-run"', f'version = "{__version__}"',
        'description = "A fedavg run"', 'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fedavg"', "",
        "[tool.flwr.app.components]", 'serverapp = "fedavg.node.deployed:server_app"',
        'clientapp = "fedavg.node.deployed:client_app"', "",
        "[tool.flwr.app.config]",
    ]
    lines += [f'"{k}" = {toml_value(v)}' for k, v in sorted(config.to_flat().items())]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return folder
