"""The ``fedavg`` command line: a thin typer layer over :mod:`fedavg`'s functions.

Run settings and strategy options are not listed here: :mod:`fedavg.cli_options` generates
them from their declarations (the config fields, each strategy's ``options``), and each
command passes them on as ``RunConfig().replace(**settings)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from fedavg.cli_options import with_settings
from fedavg.config import RunConfig
from fedavg.errors import RunError, UserError

# soft_wrap: long lines are never broken up, so they read whole in a terminal of any width
# and in a log file; tables fold their cells instead of cutting them.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


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


def _on_signal(message, cleanup=None):
    """Install the Ctrl-C / SIGTERM handler: say ``message``, clean up, exit 130.

    ``message`` is a string or a function returning one, called at signal time;
    ``cleanup`` defaults to stopping our Flower processes. Finished rounds are kept.
    """
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
            from fedavg.deployment import stop_all

            stop_all()
        os._exit(130)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


def _interrupted(output: Path | None) -> str:
    done = output is not None and (output / "metrics.jsonl").exists()
    return "interrupted" + (f": finished rounds are kept in {output}" if done else "")


def simulate(
    cpus_per_node: Annotated[float, typer.Option(
        help="CPU cores each simulated node reserves")] = 1.0,
    gpus_per_node: Annotated[Optional[float], typer.Option(
        help="GPUs each node reserves (default 1 with CUDA)")] = None,
    output: Annotated[Optional[Path], typer.Option(
        help="Run folder (default runs/<timestamp>)")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a previous run in --output")] = False,
    verbose: Annotated[bool, typer.Option(help="Show Flower's and Ray's logs")] = False,
    **settings: Any,
) -> None:
    """Train N nodes on one machine (Flower simulation engine) and save the merged model."""
    from fedavg.simulation import abort_active_runs
    from fedavg.simulation import simulate as run

    with _guard():
        config = RunConfig().replace(**settings)
    # Stop Ray at once on a signal. (Raising KeyboardInterrupt instead can deadlock inside
    # Flower's worker pool.)
    _on_signal(lambda: _interrupted(output), abort_active_runs)
    with _guard():
        run(config, output=output, console=console, verbose=verbose,
            cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, overwrite=overwrite)


def merge(
    models: Annotated[Optional[list[Path]], typer.Argument(
        help="Model folders, or folders of them (a run's nodes/)")] = None,
    models_opt: Annotated[Optional[list[Path]], typer.Option(
        "--models", help="Same as the arguments; repeatable")] = None,
    strategy: Annotated[str, typer.Option(
        help="Merge strategy (see `fedavg strategies`)")] = "average",
    output: Annotated[Path, typer.Option(help="Folder for the merged model")] = Path("runs/merged"),
    dataset: Annotated[Optional[str], typer.Option(
        help="Report accuracy on this dataset's test split")] = None,
    validation: Annotated[Optional[str], typer.Option(
        help="Held-out dataset for greedy-soup, fitted weights, distill")] = None,
    distill_data: Annotated[Optional[str], typer.Option(
        help="Unlabeled dataset for distill")] = None,
    seed: Annotated[int, typer.Option(help="Seed of any random choice")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Replace a previous model in --output")] = False,
    **options: Any,
) -> None:
    """Merge saved models offline (e.g. `--save-node-models` output) into one model."""
    from fedavg.merge import merge_models

    paths = list(models or []) + list(models_opt or [])
    with _guard():
        if not paths:
            raise UserError("pass the model folders to merge (or a run's nodes/ folder)")
        config = RunConfig().replace(strategy=strategy, validation=validation,
                                     distill_data=distill_data, seed=seed, device=device,
                                     rounds=1, **options)
        res = merge_models(paths, output, config, dataset=dataset, overwrite=overwrite)
    acc = f": test accuracy [bold]{res['accuracy']:.4f}[/]" if "accuracy" in res else ""
    console.print(f"merged {res['num_models']} models with {res['strategy']} into "
                  f"[bold]{output}[/]{acc}")


def evaluate(
    model_dir: Annotated[Path, typer.Argument(help="A run's output folder")],
    dataset: Annotated[Optional[str], typer.Option(
        help="Dataset (default: the training one)")] = None,
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


def predict(
    model_dir: Annotated[Path, typer.Argument(help="A run's output folder")],
    inputs: Annotated[list[str], typer.Argument(
        help="Image files, folders of images, or datasets")],
    output: Annotated[Optional[Path], typer.Option(
        help="Write predictions to FILE.csv or FILE.json")] = None,
    split: Annotated[str, typer.Option(help="Split of dataset inputs")] = "test",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
) -> None:
    """Predict classes with a saved model."""
    from fedavg.inference import predict as run
    from fedavg.inference import write_predictions

    with _guard():
        if output is not None and output.suffix.lower() not in (".csv", ".json"):
            raise UserError(f"--output must end in .csv or .json (got {output.name})")
        rows = run(model_dir, inputs, split=split, device=device,
                   on_note=lambda note: err_console.print(f"[yellow]note:[/] {note}",
                                                          highlight=False))
        if output is not None:
            write_predictions(rows, output)
            console.print(f"{len(rows)} prediction(s) written to {output}")
            return
    from rich.table import Table

    table = Table()
    table.add_column("input", overflow="fold")
    table.add_column("prediction", overflow="fold")
    table.add_column("confidence", justify="right")
    for row in rows[:50]:
        table.add_row(row["input"], row["prediction"], f"{row['confidence']:.3f}")
    console.print(table)
    if len(rows) > 50:
        console.print(f"... and {len(rows) - 50} more (use --output FILE.csv for all)")


def list_strategies() -> None:
    """List the merge strategies with their papers and options."""
    from rich.table import Table

    import strategies

    table = Table(show_lines=True)
    table.add_column("name", no_wrap=True)
    table.add_column("method, options (default) and paper", overflow="fold")
    for name, cls in strategies.available().items():
        options = "".join(f"\n  {o.flag} {o.default}: {o.help}"
                          + (f" ({' | '.join(o.choices)})" if o.choices else "")
                          for o in cls.options)
        table.add_row(name, f"{cls.description}{options}\n[dim]{cls.paper}[/]")
    console.print(table)


def models() -> None:
    """List the registered models."""
    from rich.table import Table

    from fedavg.models import available_models

    table = Table()
    for column in ("name", "description"):
        table.add_column(column, overflow="fold")
    for name, desc in available_models().items():
        table.add_row(name, desc)
    table.add_row("auto", "mlp for tabular or < 16x16 inputs, cnn for grey, cnn-cifar for colour")
    console.print(table)


def coordinator(
    address: Annotated[str, typer.Option(
        help="host:port to listen on; 0.0.0.0:PORT for other machines")] = "127.0.0.1:9092",
    certs: Annotated[Optional[Path], typer.Option(help="Folder from `fedavg certs` (TLS)")] = None,
    insecure: Annotated[bool, typer.Option(help="No TLS (traffic unencrypted)")] = False,
    auth_keys: Annotated[Optional[Path], typer.Option(
        help="Node public keys allowed in (file, one per line, or folder of *.pub)")] = None,
    min_nodes: Annotated[int, typer.Option(help="Nodes to wait for before round 1")] = 2,
    min_nodes_per_round: Annotated[Optional[int], typer.Option(
        help="Usable replies a round needs (default: half the nodes it samples, "
             "rounded up)")] = None,
    wait_timeout: Annotated[float, typer.Option(
        help="Seconds to wait for --min-nodes nodes")] = 300.0,
    output: Annotated[Optional[Path], typer.Option(
        help="Run folder (default runs/<timestamp>)")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a previous run in --output")] = False,
    verbose: Annotated[bool, typer.Option(
        help="Show Flower's logs and every SuperLink line")] = False,
    **settings: Any,
) -> None:
    """Coordinate training across machines: start a Flower SuperLink and run the rounds."""
    from fedavg.deployment import coordinate

    _setup_logging()
    with _guard():
        config = RunConfig().replace(**settings)

    def interrupted() -> str:
        from fedavg.deployment import RUN_OUTPUT

        out = RUN_OUTPUT[0] if RUN_OUTPUT else None
        if out is not None and (out / "metrics.jsonl").exists():
            return f"interrupted: finished rounds are kept in {out}"
        return "interrupted before the first round finished"

    _on_signal(interrupted)
    with _guard():
        coordinate(config, console=console, address=address, certs=certs, insecure=insecure,
                   auth_keys=auth_keys, min_nodes=min_nodes,
                   min_nodes_per_round=min_nodes_per_round, wait_timeout=wait_timeout,
                   output=output, overwrite=overwrite, verbose=verbose)


def _setup_logging() -> None:
    """Send the SuperLink/SuperNode warnings we pick out to stderr via the fedavg logger."""
    logging.getLogger("fedavg").setLevel(logging.WARNING)


def node(
    coordinator: Annotated[str, typer.Option(
        help="host:port of `fedavg coordinator`")] = "127.0.0.1:9092",
    dataset: Annotated[str, typer.Option(
        help="This node's data: digits, a local path, or a hub id")] = "digits",
    partition_id: Annotated[Optional[int], typer.Option(
        help="Train on this partition of --dataset (split as the run's partitioner says)")] = None,
    num_partitions: Annotated[Optional[int], typer.Option(
        help="Number of partitions of --dataset")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N")] = "auto",
    gpus: Annotated[Optional[str], typer.Option(
        help="Start one node per listed GPU, e.g. 0,1,2,3 (partition ids count up from "
             "--partition-id)")] = None,
    certs: Annotated[Optional[Path], typer.Option(
        help="Folder holding the coordinator's ca.crt (TLS)")] = None,
    insecure: Annotated[bool, typer.Option(help="No TLS (traffic unencrypted)")] = False,
    auth_key: Annotated[Optional[Path], typer.Option(
        help="This node's private key (node-<i>.key from `fedavg certs --nodes`)")] = None,
    once: Annotated[bool, typer.Option(
        help="Exit after one run (default: serve runs until stopped)")] = False,
    max_wait_time: Annotated[Optional[float], typer.Option(
        help="Give up after this many seconds without reaching the coordinator (default: keep "
             "retrying)")] = None,
) -> None:
    """Join runs of a coordinator: a Flower SuperNode plus one warm training process."""
    from fedavg.deployment import serve_gpu_nodes, serve_node

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


def certs(
    folder: Annotated[Path, typer.Argument(
        help="Folder to write ca.crt, coordinator.crt/.key and node keys into")],
    host: Annotated[Optional[list[str]], typer.Option(
        help="Host name or IP nodes use to reach the coordinator; repeatable")] = None,
    nodes: Annotated[int, typer.Option(
        help="Node key pairs to make (for --auth-keys / --auth-key)")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing CA in FOLDER")] = False,
) -> None:
    """Make a CA, the coordinator's TLS certificate and node keys (quick start)."""
    from fedavg.certs import make_certs

    with _guard():
        written = make_certs(folder, hosts=host or [], nodes=nodes, overwrite=overwrite)
    for path in written:
        console.print(f"wrote {path}")
    nodes_hint = (f" (and node-<i>.key) and pass --certs DIR --auth-key node-<i>.key; "
                  f"coordinator: --auth-keys {folder}/authorized-nodes.pub" if nodes else "")
    console.print(f"coordinator: --certs {folder}; nodes: copy {folder}/ca.crt{nodes_hint}")
    repo = _git_work_tree(folder)
    if repo is not None:
        err_console.print(f"[yellow]note:[/] {folder} is inside the git work tree {repo}: keep "
                          "its private keys (*.key) out of version control (list the folder "
                          "in .gitignore) and readable only by you", highlight=False)


def _git_work_tree(folder: Path) -> Path | None:
    """Return the git work tree holding ``folder``, if any (no git command is run)."""
    for parent in [folder.resolve(), *folder.resolve().parents]:
        if (parent / ".git").exists():
            return parent
    return None


def _show_version(value: bool) -> None:
    if value:
        import importlib.metadata

        from fedavg import __version__

        versions = []
        for dist in ("flwr", "torch"):
            try:
                versions.append(f"{dist} {importlib.metadata.version(dist)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{dist} not installed")
        console.print(f"fedavg {__version__} ({', '.join(versions)})")
        raise typer.Exit()


def _root(
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="Print the version (and Flower's and PyTorch's) and exit")] = None,
) -> None:
    """Train many, then merge: federated averaging on Flower's engines."""


def build_app() -> typer.Typer:
    """Build the ``fedavg`` typer app, with options generated from the registered strategies."""
    app = typer.Typer(
        name="fedavg",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    app.command(name="simulate")(with_settings(simulate))
    app.command(name="merge")(with_settings(merge, config=False))
    app.command(name="evaluate")(evaluate)
    app.command(name="predict")(predict)
    app.command(name="strategies")(list_strategies)
    app.command(name="models")(models)
    app.command(name="coordinator")(with_settings(coordinator, skip=("num_nodes",)))
    app.command(name="node")(node)
    app.command(name="certs")(certs)
    return app


app = build_app()


def main() -> None:
    """Run the console script: a usage mistake is one line and exit code 2."""
    import click

    # The CLI shows node failures and progress itself; keep library warnings off stderr.
    logging.getLogger("fedavg").addHandler(logging.NullHandler())
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="fedavg", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()  # the help text
        code = exc.exit_code
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "fedavg"
        if where == "fedavg" and len(sys.argv) > 1 and sys.argv[1] in command.commands:
            where = f"fedavg {sys.argv[1]}"
        err_console.print(f"[bold red]error:[/] {exc.format_message()} (see `{where} --help`)",
                          highlight=False)
        code = exc.exit_code
    except click.Abort:
        err_console.print("aborted")
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
