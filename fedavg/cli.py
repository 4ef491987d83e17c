"""The ``fedavg`` command line: a thin typer layer over :mod:`fedavg`'s functions."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fedavg.config import DataConfig, MergeConfig, RunConfig, TrainConfig
from fedavg.errors import RunError, UserError

app = typer.Typer(
    name="fedavg",
    help="Train many, then merge: federated averaging on Flower's engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

_D, _T, _M = DataConfig(), TrainConfig(), MergeConfig()


@contextlib.contextmanager
def _guard():
    """Turn user mistakes into one line on stderr and exit code 2 (1 for failed runs)."""
    try:
        yield
    except UserError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except RunError as exc:
        err_console.print(f"[bold red]run failed:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


# Strategy options shared by `simulate` and `merge` (each strategy takes the ones it knows).
_OPT = dict(
    mu=Annotated[float, typer.Option(help="FedProx proximal coefficient")],
    server_lr=Annotated[Optional[float], typer.Option(help="Server learning rate (fedavgm, fedadam, fedyogi, fedadagrad)")],
    server_momentum=Annotated[float, typer.Option(help="Server momentum (fedavgm)")],
    tau=Annotated[Optional[float], typer.Option(help="Adaptivity of fedadam / fedyogi / fedadagrad")],
    beta=Annotated[float, typer.Option(help="Fraction trimmed at each end (trimmed-mean)")],
    num_malicious=Annotated[int, typer.Option(help="Byzantine nodes tolerated (krum, multi-krum)")],
    ensemble_weights=Annotated[str, typer.Option(help="num-examples | uniform | accuracy | fitted (ensemble)")],
    validation=Annotated[Optional[str], typer.Option(help="Held-out dataset for greedy-soup, fitted weights, distill (default: a slice of train)")],
    distill_data=Annotated[Optional[str], typer.Option(help="Unlabeled dataset for distill (default: a slice of train, labels removed)")],
    distill_steps=Annotated[int, typer.Option(help="Adam steps of distillation")],
)


def _on_signal(message, cleanup=None):
    """Ctrl-C / SIGTERM: print ``message``, run ``cleanup`` (default: stop our Flower
    processes), keep finished rounds, exit 130.

    ``message`` is a string or a function returning one, called at signal time."""
    stopping = []

    def _stop(signum, frame):
        if stopping:  # a second signal while stopping: the first one finishes the job
            return
        stopping.append(signum)
        err_console.print(message() if callable(message) else message, soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        if cleanup is not None:
            cleanup()
        else:
            from fedavg.deploy import stop_all

            stop_all()
        os._exit(130)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


@app.command()
def simulate(
    dataset: Annotated[str, typer.Option(help="digits (built in), a local path, or a hub id")] = _D.dataset,
    num_nodes: Annotated[int, typer.Option(help="Number of nodes (= partitions)")] = _M.num_nodes,
    rounds: Annotated[int, typer.Option(help="Number of rounds")] = _M.rounds,
    strategy: Annotated[str, typer.Option(help="Merge strategy (see `fedavg strategies`)")] = _M.strategy,
    model: Annotated[str, typer.Option(help="Model (see `fedavg models`), or auto")] = _T.model,
    local_epochs: Annotated[int, typer.Option(help="Local epochs per round")] = _T.local_epochs,
    batch_size: Annotated[int, typer.Option(help="Samples per SGD step")] = _T.batch_size,
    lr: Annotated[float, typer.Option(help="SGD learning rate")] = _T.lr,
    momentum: Annotated[float, typer.Option(help="SGD momentum")] = _T.momentum,
    weight_decay: Annotated[float, typer.Option(help="L2 penalty")] = _T.weight_decay,
    fraction: Annotated[float, typer.Option(help="Participation fraction: share of nodes per round")] = _M.fraction,
    partitioner: Annotated[str, typer.Option(help="iid | dirichlet | pathological | natural")] = _D.partitioner,
    alpha: Annotated[float, typer.Option(help="Dirichlet alpha (> 0; smaller = more skew)")] = _D.alpha,
    classes_per_node: Annotated[int, typer.Option(help="Labels per node (pathological)")] = _D.classes_per_node,
    partition_by: Annotated[Optional[str], typer.Option(help="Column of natural node ids (natural)")] = None,
    image_column: Annotated[Optional[str], typer.Option(help="Input column (default: detected)")] = None,
    label_column: Annotated[Optional[str], typer.Option(help="Label column (default: detected)")] = None,
    seed: Annotated[int, typer.Option(help="Seed of partitioning, hold-out, init and sampling")] = _D.seed,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu, cuda, cuda:N")] = _T.device,
    round_timeout: Annotated[float, typer.Option(help="Seconds to wait for nodes in a round")] = _M.round_timeout,
    mu: _OPT["mu"] = _M.mu,
    server_lr: _OPT["server_lr"] = None,
    server_momentum: _OPT["server_momentum"] = _M.server_momentum,
    tau: _OPT["tau"] = None,
    beta: _OPT["beta"] = _M.beta,
    num_malicious: _OPT["num_malicious"] = _M.num_malicious,
    ensemble_weights: _OPT["ensemble_weights"] = _M.ensemble_weights,
    validation: _OPT["validation"] = None,
    distill_data: _OPT["distill_data"] = None,
    distill_steps: _OPT["distill_steps"] = _M.distill_steps,
    save_node_models: Annotated[bool, typer.Option(help="Also save each node's final model in OUTPUT/nodes/")] = False,
    cpus_per_node: Annotated[float, typer.Option(help="CPU cores each simulated node reserves")] = 1.0,
    gpus_per_node: Annotated[Optional[float], typer.Option(help="GPUs each node reserves (default 1 with CUDA)")] = None,
    output: Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<timestamp>)")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a previous run in --output")] = False,
    verbose: Annotated[bool, typer.Option(help="Show Flower's and Ray's logs")] = False,
) -> None:
    """Train N nodes on one machine (Flower simulation engine) and save the merged model."""
    from fedavg.simulation import abort_active_runs, simulate as run

    settings = {k: v for k, v in locals().items()
                if k not in ("output", "verbose", "cpus_per_node", "gpus_per_node", "run",
                             "abort_active_runs", "overwrite")}
    with _guard():
        config = RunConfig().replace(**settings)

    def interrupted() -> str:
        done = output is not None and (output / "metrics.jsonl").exists()
        return "interrupted" + (f": finished rounds are kept in {output}" if done else "")

    # Stop Ray at once on a signal. (Raising KeyboardInterrupt instead can deadlock inside
    # Flower's worker pool.)
    _on_signal(interrupted, abort_active_runs)
    with _guard():
        run(config, output=output, console=console, verbose=verbose,
            cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, overwrite=overwrite)


@app.command()
def merge(
    models: Annotated[Optional[list[Path]], typer.Argument(help="Model folders, or folders of them (a run's nodes/)")] = None,
    models_opt: Annotated[Optional[list[Path]], typer.Option("--models", help="Same as the arguments; repeatable")] = None,
    strategy: Annotated[str, typer.Option(help="Merge strategy (see `fedavg strategies`)")] = "average",
    output: Annotated[Path, typer.Option(help="Folder for the merged model")] = Path("runs/merged"),
    dataset: Annotated[Optional[str], typer.Option(help="Report accuracy on this dataset's test split")] = None,
    mu: _OPT["mu"] = _M.mu,
    server_lr: _OPT["server_lr"] = None,
    server_momentum: _OPT["server_momentum"] = _M.server_momentum,
    tau: _OPT["tau"] = None,
    beta: _OPT["beta"] = _M.beta,
    num_malicious: _OPT["num_malicious"] = _M.num_malicious,
    ensemble_weights: _OPT["ensemble_weights"] = _M.ensemble_weights,
    validation: _OPT["validation"] = None,
    distill_data: _OPT["distill_data"] = None,
    distill_steps: _OPT["distill_steps"] = _M.distill_steps,
    seed: Annotated[int, typer.Option(help="Seed of any random choice")] = _D.seed,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
) -> None:
    """Merge saved models offline (e.g. `--save-node-models` output) into one model."""
    from fedavg.merge import merge_models

    paths = list(models or []) + list(models_opt or [])
    settings = {k: v for k, v in locals().items()
                if k not in ("models", "models_opt", "output", "dataset", "merge_models", "paths")}
    with _guard():
        if not paths:
            raise UserError("pass the model folders to merge (or a run's nodes/ folder)")
        config = RunConfig().replace(**settings)
        config.strategy()  # unknown names and bad options fail before any loading
        res = merge_models(paths, output, config, dataset=dataset)
    acc = f": test accuracy [bold]{res['accuracy']:.4f}[/]" if "accuracy" in res else ""
    console.print(f"merged {res['num_models']} models with {res['strategy']} into "
                  f"[bold]{output}[/]{acc}")


@app.command()
def evaluate(
    model_dir: Annotated[Path, typer.Argument(help="A run's output folder")],
    dataset: Annotated[Optional[str], typer.Option(help="Dataset (default: the training one)")] = None,
    split: Annotated[str, typer.Option(help="Split to evaluate on")] = "test",
    image_column: Annotated[Optional[str], typer.Option(help="Input column")] = None,
    label_column: Annotated[Optional[str], typer.Option(help="Label column")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Accuracy and loss of a saved model on a dataset split."""
    from fedavg.inference import evaluate_model

    with _guard():
        res = evaluate_model(model_dir, dataset, split=split, image_column=image_column,
                             label_column=label_column, device=device)
    if as_json:
        print(json.dumps(res))
    else:
        from rich.markup import escape

        console.print(
            f"{escape(res['dataset'])} \\[{escape(res['split'])}]: accuracy "
            f"[bold]{res['accuracy']:.4f}[/], loss {res['loss']:.4f}, "
            f"{res['num_examples']} samples"
        )


@app.command()
def predict(
    model_dir: Annotated[Path, typer.Argument(help="A run's output folder")],
    inputs: Annotated[list[str], typer.Argument(help="Image files, folders of images, or datasets")],
    output: Annotated[Optional[Path], typer.Option(help="Write predictions to FILE.csv or FILE.json")] = None,
    split: Annotated[str, typer.Option(help="Split of dataset inputs")] = "test",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
) -> None:
    """Predict classes with a saved model."""
    from fedavg.inference import predict as run, write_predictions

    with _guard():
        if output is not None and output.suffix.lower() not in (".csv", ".json"):
            raise UserError(f"--output must end in .csv or .json (got {output.name})")
        rows = run(model_dir, inputs, split=split, device=device)
        if output is not None:
            write_predictions(rows, output)
            console.print(f"{len(rows)} prediction(s) written to {output}")
            return
    from rich.table import Table

    table = Table("input", "prediction", "confidence")
    for row in rows[:50]:
        table.add_row(row["input"], row["prediction"], f"{row['confidence']:.3f}")
    console.print(table)
    if len(rows) > 50:
        console.print(f"... and {len(rows) - 50} more (use --output FILE.csv for all)")


@app.command()
def strategies() -> None:
    """List the merge strategies with their papers."""
    import strategies as registry
    from rich.table import Table

    table = Table("name", "description", "paper")
    for name, cls in registry.available().items():
        table.add_row(name, cls.description, cls.paper)
    console.print(table)


@app.command()
def models() -> None:
    """List the registered models."""
    from rich.table import Table

    from fedavg.models import available_models

    table = Table("name", "description")
    for name, desc in available_models().items():
        table.add_row(name, desc)
    table.add_row("auto", "mlp for tabular or < 16x16 inputs, cnn for grey, cnn-cifar for colour")
    console.print(table)



_SIM_ONLY = ("num_nodes", "cpus_per_node", "gpus_per_node", "verbose")


def coordinator(**kwargs) -> None:
    """Coordinate training across machines: start a Flower SuperLink and run the rounds."""
    from fedavg.deploy import coordinate

    deploy = {k: kwargs.pop(k) for k in ("address", "certs", "insecure", "auth_keys",
                                          "min_nodes", "min_nodes_per_round", "wait_timeout",
                                          "output", "overwrite")}
    _setup_logging()
    with _guard():
        config = RunConfig().replace(**kwargs)
    def interrupted() -> str:
        from fedavg.deploy import RUN_OUTPUT

        out = RUN_OUTPUT[0] if RUN_OUTPUT else None
        if out is not None and (out / "metrics.jsonl").exists():
            return f"interrupted: finished rounds are kept in {out}"
        return "interrupted before the first round finished"

    _on_signal(interrupted)
    with _guard():
        coordinate(config, console=console, **deploy)


def _coordinator_signature() -> None:
    import inspect

    params = [p for name, p in inspect.signature(simulate).parameters.items()
              if name not in _SIM_ONLY and name != "output" and name != "overwrite"]
    extra = dict(
        min_nodes=(Annotated[int, typer.Option(help="Nodes to wait for before round 1")], 2),
        min_nodes_per_round=(Annotated[Optional[int], typer.Option(help="Usable replies a round needs (default: half the nodes it samples, rounded up)")], None),
        wait_timeout=(Annotated[float, typer.Option(help="Seconds to wait for --min-nodes nodes")], 300.0),
        address=(Annotated[str, typer.Option(help="host:port to listen on; 0.0.0.0:PORT for other machines")], "127.0.0.1:9092"),
        certs=(Annotated[Optional[Path], typer.Option(help="Folder from `fedavg certs` (TLS)")], None),
        insecure=(Annotated[bool, typer.Option(help="No TLS (traffic unencrypted)")], False),
        auth_keys=(Annotated[Optional[Path], typer.Option(help="Node public keys allowed in (file, one per line, or folder of *.pub)")], None),
        output=(Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<timestamp>)")], None),
        overwrite=(Annotated[bool, typer.Option(help="Replace a previous run in --output")], False),
    )
    for name, (ann, default) in extra.items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=ann))
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
    coordinator.__signature__ = inspect.Signature(params)
    coordinator.__annotations__ = {p.name: p.annotation for p in params}


_coordinator_signature()
app.command(name="coordinator")(coordinator)


def _setup_logging() -> None:
    """Send the SuperLink/SuperNode warnings we pick out to stderr via the fedavg logger."""
    logging.getLogger("fedavg").setLevel(logging.WARNING)


@app.command()
def node(
    coordinator: Annotated[str, typer.Option(help="host:port of `fedavg coordinator`")] = "127.0.0.1:9092",
    dataset: Annotated[str, typer.Option(help="This node's data: digits, a local path, or a hub id")] = "digits",
    partition_id: Annotated[Optional[int], typer.Option(help="Train on this partition of --dataset (split as the run's partitioner says)")] = None,
    num_partitions: Annotated[Optional[int], typer.Option(help="Number of partitions of --dataset")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N")] = "auto",
    gpus: Annotated[Optional[str], typer.Option(help="Start one node per listed GPU, e.g. 0,1,2,3 (partition ids count up from --partition-id)")] = None,
    certs: Annotated[Optional[Path], typer.Option(help="Folder holding the coordinator's ca.crt (TLS)")] = None,
    insecure: Annotated[bool, typer.Option(help="No TLS (traffic unencrypted)")] = False,
    auth_key: Annotated[Optional[Path], typer.Option(help="This node's private key (node-<i>.key from `fedavg certs --nodes`)")] = None,
    once: Annotated[bool, typer.Option(help="Exit after one run (default: serve runs until stopped)")] = False,
    max_wait_time: Annotated[Optional[float], typer.Option(help="Give up after this many seconds without reaching the coordinator (default: keep retrying)")] = None,
) -> None:
    """Join runs of a coordinator: a Flower SuperNode plus one warm training process."""
    from fedavg.deploy import serve_gpu_nodes, serve_node

    _setup_logging()
    _on_signal("node stopped")
    code = 0
    try:
        with _guard():
            if gpus is not None:
                code = serve_gpu_nodes(gpus, coordinator=coordinator, dataset=dataset,
                                       partition_id=partition_id,
                                       num_partitions=num_partitions, device=device,
                                       certs=certs, insecure=insecure, auth_key=auth_key,
                                       once=once, max_wait_time=max_wait_time, console=console)
            else:
                n = serve_node(coordinator, dataset=dataset, partition_id=partition_id,
                               num_partitions=num_partitions, device=device, certs=certs,
                               insecure=insecure, auth_key=auth_key, once=once,
                               max_wait_time=max_wait_time, console=console)
                console.print(f"node done: {n} task(s) run")
    except typer.Exit as exc:
        code = exc.exit_code
    # A task abandoned when its coordinator vanished may still block in Flower's transfer
    # threads, which a normal interpreter exit would wait for: leave now (Flower's processes
    # are already stopped).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@app.command()
def certs(
    folder: Annotated[Path, typer.Argument(help="Folder to write ca.crt, coordinator.crt/.key and node keys into")],
    host: Annotated[Optional[list[str]], typer.Option(help="Host name or IP nodes use to reach the coordinator; repeatable")] = None,
    nodes: Annotated[int, typer.Option(help="Node key pairs to make (for --auth-keys / --auth-key)")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing CA in FOLDER")] = False,
) -> None:
    """Make a CA, the coordinator's TLS certificate and node keys (quick start)."""
    from fedavg.certs import make_certs

    with _guard():
        written = make_certs(folder, hosts=host or [], nodes=nodes, overwrite=overwrite)
    for path in written:
        console.print(f"wrote {path}")
    console.print(soft_wrap=True, *[f"coordinator: --certs {folder}; nodes: copy {folder}/ca.crt"
                  + (f" (and node-<i>.key) and pass --certs DIR --auth-key node-<i>.key; "
                     f"coordinator: --auth-keys {folder}/authorized-nodes.pub" if nodes else "")])


def main() -> None:
    """Console-script entry point."""
    # The CLI shows node failures and progress itself; keep library warnings off stderr.
    logging.getLogger("fedavg").addHandler(logging.NullHandler())
    app()


if __name__ == "__main__":
    main()
