"""The ``fedavg`` command line: a thin typer layer over :mod:`fedavg`'s functions.

Run settings and strategy options are not listed here: :mod:`fedavg.cli.options` generates
them from their declarations (the config fields, each strategy's ``options``), and each
command passes them on as ``RunConfig().replace(**settings)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

# Ray's core answers SIGTERM (a clean stop here: exit 130, resume command) with a crash report
# on stderr unless this is set before Ray loads; a run's own Ray processes inherit it, and
# their logs go with the run's Ray folder anyway.
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

from fedavg import __version__
from fedavg.cli.listings import list_models, list_strategies
from fedavg.cli.options import (
    ImageColumnOption,
    ModelArgOption,
    SavedModelCodeOption,
    TextColumnOption,
    given,
    model_args,
    non_empty,
    path_argument,
    path_option,
    pop_tracking,
    with_options,
    with_settings,
)
from fedavg.cli.support import console, err_console, guard, interrupted, on_signal, run_app
from fedavg.cli.sweep import report, sweep
from fedavg.config.settings import RunConfig, resume_help
from fedavg.engines.deployment.coordinator_options import CoordinatorOptions
from fedavg.engines.deployment.node_options import NodeOptions
from fedavg.util.errors import UserError


def simulate(
    cpus_per_node: Annotated[float, typer.Option(
        help="CPU cores each simulated node reserves")] = 1.0,
    gpus_per_node: Annotated[Optional[float], typer.Option(
        help="GPUs each node reserves (default 1 with CUDA)")] = None,
    output: Annotated[Optional[Path], path_option(
        help="Run folder (default runs/<timestamp>)")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a previous run in --output")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="Show Flower's and Ray's logs")] = False,
    resume: Annotated[Optional[Path], path_option(
        help=resume_help())] = None,
    model_arg: ModelArgOption = None,
    ray_address: Annotated[Optional[str], typer.Option(
        help="Run the nodes on this existing Ray cluster (HOST:PORT of `ray start --head`, "
             "or auto) instead of this machine alone")] = None,
    **settings: Any,
) -> None:
    """Train N nodes on one machine or a Ray cluster (Flower simulation engine); merge."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.engines.simulation.ray_cleanup import abort_active_runs
    from fedavg.engines.simulation.simulate import simulate as run
    from fedavg.run.lifecycle import RUN_OUTPUT

    tracking = pop_tracking(settings)
    with guard():
        chosen = model_args(model_arg)
        config = None if resume is not None else RunConfig().replace(**settings, **chosen)
    # Stop Ray at once on a signal. (Raising KeyboardInterrupt instead can deadlock inside
    # Flower's worker pool.)
    on_signal(lambda: interrupted(RUN_OUTPUT[0] if RUN_OUTPUT else output or resume),
              abort_active_runs)  # (a resume stopped while it loads: its rounds are kept)
    with guard():
        run(config, output=output, console=console, verbose=verbose,
            cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, overwrite=overwrite,
            resume=resume, tracking=tracking, ray_address=ray_address,
            **({**given(settings), **chosen} if resume is not None else {}))


def merge(
    models: Annotated[Optional[list[Path]], path_argument(
        help="Model folders, or folders of them (a run's nodes/)")] = None,
    models_opt: Annotated[Optional[list[Path]], path_option(
        "--models", help="Same as the arguments; repeatable")] = None,
    strategy: Annotated[str, typer.Option(
        help="Merge strategy (see `fedavg strategies`)")] = "average",
    output: Annotated[Optional[Path], path_option(
        help="Folder for the merged model (default runs/merged-<timestamp>)")] = None,
    dataset: Annotated[Optional[str], typer.Option(
        help="Report accuracy on this dataset's test split")] = None,
    validation: Annotated[Optional[str], typer.Option(
        help="Held-out dataset for greedy-soup, fitted weights, distill")] = None,
    distill_data: Annotated[Optional[str], typer.Option(
        help="Dataset for distill (its labels are dropped)")] = None,
    start: Annotated[Optional[Path], path_option(
        "--start", help="Model folder the merged models started from, for the task-vector "
        "strategies (default: the run's start/ beside its nodes/)")] = None,
    seed: Annotated[int, typer.Option(help="Seed of any random choice")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a previous model in --output")] = False,
    model: SavedModelCodeOption = None,
    **options: Any,
) -> None:
    """Merge saved models offline (e.g. `--save-node-models` output) into one model."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.use.merge import merge_models

    paths = list(models or []) + list(models_opt or [])
    with guard("interrupted: no merged model was written", failed="merge failed"):
        if not paths:
            raise UserError("pass the model folders to merge (or a run's nodes/ folder)")
        config = RunConfig().replace(strategy=strategy, validation=validation,
                                     distill_data=distill_data, seed=seed, device=device,
                                     rounds=1, **options)
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.run.lifecycle import default_output, remove_if_empty

        chosen = output is None
        output = default_output("merged-") if chosen else output
        try:
            res = merge_models(paths, output, config, dataset=dataset, overwrite=overwrite,
                               model=model, start=start)
        except BaseException:
            if chosen:
                remove_if_empty(output)
            raise
    acc = f": test accuracy [bold]{res['accuracy']:.4f}[/]" if "accuracy" in res else ""
    kept = (f"\nkept {len(res['members'])} of {res['num_models']}: "
            + ", ".join(escape(m) for m in res["members"])) if "members" in res else ""
    for note in res.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    console.print(f"merged {res['num_models']} models with {res['strategy']} into "
                  f"[bold]{escape(str(output))}[/]{acc}{kept}", highlight=False)


def evaluate(
    model_dir: Annotated[Path, path_argument(help="A run's output folder")],
    dataset: Annotated[Optional[str], typer.Option(
        help="Dataset (default: the training one)")] = None,
    split: Annotated[str, typer.Option(help="Split to evaluate on")] = "test",
    image_column: ImageColumnOption = None,
    text_column: TextColumnOption = None,
    label_column: Annotated[Optional[str], typer.Option(help="Label column")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    model: SavedModelCodeOption = None,
) -> None:
    """Accuracy and loss of a saved model on a dataset split."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.use.inference import evaluate_model

    with guard(failed="error"), \
            contextlib.redirect_stdout(sys.stderr):  # model code's prints: not in --json
        res = evaluate_model(model_dir, dataset, split=split, image_column=image_column,
                             text_column=text_column, label_column=label_column,
                             device=device, model=model)
    if as_json:
        # lazy: loads with its command: `fedavg --help` stays fast
        from fedavg.run.checkpoint import plain

        print(json.dumps(plain(res)))  # a NaN loss as null: NaN is no JSON
        return

    console.print(f"{escape(res['dataset'])} \\[{escape(res['split'])}]: accuracy "
                  f"[bold]{res['accuracy']:.4f}[/], loss {res['loss']:.4f}, "
                  f"{res['num_examples']} samples")
    for note in res["notes"]:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def export(
    model_dir: Annotated[Path, path_argument(help="A run's output folder (a LoRA model)")],
    output: Annotated[Path, path_option(
        "--output", "-o", help="Folder for the full model")],
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a previous model in --output")] = False,
    model: SavedModelCodeOption = None,
) -> None:
    """Fold a LoRA model's adapters into its base; write a plain full model."""
    from fedavg.use.export import export_model  # lazy: loads with its command

    with guard(failed="error"):
        res = export_model(model_dir, output, overwrite=overwrite, code=model)
    layers = res["adapted_layers"]
    console.print(f"folded the adapters of {layers} layer{'s' if layers != 1 else ''} into "
                  "the base: "
                  f"{res['parameters']:,} parameters written to "
                  f"[bold]{escape(str(res['output']))}[/]", highlight=False)


def predict(
    model_dir: Annotated[Path, path_argument(help="A run's output folder")],
    inputs: Annotated[list[str], typer.Argument(
        parser=non_empty,
        help="Image files, folders of images, .txt files (one text per line), or datasets")],
    output: Annotated[Optional[Path], path_option(
        help="Write predictions to FILE.csv or FILE.json; - for CSV on stdout")] = None,
    split: Annotated[str, typer.Option(help="Split of dataset inputs")] = "test",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    text: Annotated[bool, typer.Option(
        "--text", help="The inputs are texts to classify (a text model)")] = False,
    image_column: ImageColumnOption = None,
    text_column: TextColumnOption = None,
    model: SavedModelCodeOption = None,
) -> None:
    """Predict classes with a saved model."""
    import fedavg.run.output as files  # lazy: loads with its command: `fedavg --help` stays fast

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.use.inference import predict as run

    to_file = output is not None and str(output) != "-"
    with guard("interrupted: no predictions were written", failed="error"), \
            contextlib.redirect_stdout(sys.stderr):  # model code's prints: not in the CSV
        if to_file:
            files.check_predictions_output(output, model_dir, inputs)
        rows = run(model_dir, inputs, split=split, device=device, text=text, model=model,
                   image_column=image_column, text_column=text_column,
                   on_note=lambda note: err_console.print(f"[yellow]note:[/] {note}",
                                                          highlight=False))
        if to_file:
            files.write_predictions(rows, output)
    if to_file:
        console.print(f"{len(rows)} prediction(s) written to {escape(str(output))}",
                      highlight=False)
        return
    if output is not None or not console.is_terminal:  # --output -, piped or redirected:
        files.write_predictions_csv(rows, sys.stdout)  # every prediction, as CSV (a reader that
        return  # leaves early: see run_app)
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.run.display import predictions_table

    console.print(predictions_table(rows, shown=50))
    if len(rows) > 50:
        console.print(f"... and {len(rows) - 50} more (pipe them, or --output FILE.csv)")


def coordinator(
    model_arg: ModelArgOption = None,
    *,
    options: CoordinatorOptions,
    **settings: Any,
) -> None:
    """Coordinate training across machines: start a Flower SuperLink and run the rounds."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.engines.deployment.coordinator import coordinate

    _setup_logging()
    tracking = pop_tracking(settings)
    resume = options.resume
    with guard():
        chosen = model_args(model_arg)
        if resume is not None:  # the run's own settings, with those given checked against them
            # lazy: loads with its command: `fedavg --help` stays fast
            from fedavg.run.resume import load

            config = load(resume).run_config().replace(**given(settings), **chosen)
        else:
            config = RunConfig().replace(**settings, **chosen)

    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.run.lifecycle import RUN_OUTPUT

    on_signal(lambda: interrupted(RUN_OUTPUT[0] if RUN_OUTPUT else resume))  # its rounds
    with guard():
        coordinate(config, options, console=console, tracking=tracking)


def _setup_logging() -> None:
    """Send the SuperLink/SuperNode warnings we pick out to stderr via the fedavg logger."""
    logging.getLogger("fedavg").setLevel(logging.WARNING)


def node(
    gpus: Annotated[Optional[str], typer.Option(
        help="Start one node per listed GPU, e.g. 0,1,2,3 (partition ids count up from "
             "--partition-id)")] = None,
    *,
    options: NodeOptions,
) -> None:
    """Join runs of a coordinator: a Flower SuperNode plus one warm training process."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.engines.deployment.gpus import serve_gpu_nodes
    from fedavg.engines.deployment.node import serve_node

    _setup_logging()
    on_signal("node stopped")
    code = 0
    try:
        with guard():
            if gpus is not None:
                code = serve_gpu_nodes(gpus, options, console=console)
            else:
                n = serve_node(options, console=console)
                console.print(f"node done: {n} task(s) run (the run's end notice is one)")
    except typer.Exit as exc:
        code = exc.exit_code
    # A task abandoned when its coordinator vanished may still block in Flower's transfer
    # threads, which a normal interpreter exit would wait for: leave now (Flower's processes
    # are already stopped).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def certs(
    folder: Annotated[Path, path_argument(
        help="Folder to write ca.crt, coordinator.crt/.key and node keys into")],
    host: Annotated[Optional[list[str]], typer.Option(
        help="Host name or IP nodes use to reach the coordinator; repeatable")] = None,
    nodes: Annotated[int, typer.Option(
        help="Node key pairs to make (for --auth-keys / --auth-key)")] = 0,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an existing CA in FOLDER")] = False,
) -> None:
    """Make a CA, the coordinator's TLS certificate and node keys (quick start)."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.engines.deployment.certs import make_certs, unignored_git_work_tree

    with guard(failed="error"):
        written = make_certs(folder, hosts=host or [], nodes=nodes, overwrite=overwrite)
    for path in written:
        console.print(f"wrote {path}")
    nodes_hint = (f" (and node-<i>.key) and pass --certs DIR --auth-key node-<i>.key; "
                  f"coordinator: --auth-keys {folder}/authorized-nodes.pub" if nodes else "")
    console.print(f"coordinator: --certs {folder}; nodes: copy {folder}/ca.crt{nodes_hint}")
    repo = unignored_git_work_tree(folder)
    if repo is not None:
        err_console.print(f"[yellow]note:[/] {folder} is inside the git work tree {repo}: keep "
                          "its private keys (*.key) out of version control (list the folder "
                          "in .gitignore) and readable only by you", highlight=False)


def kubernetes(
    folder: Annotated[Path, path_argument(
        help="Folder to write the run into, for `kubectl apply -k FOLDER`")],
    nodes: Annotated[int, typer.Option(help="Node Jobs; node i trains partition i")] = 2,
    overlay: Annotated[str, typer.Option(
        help="cpu (one thread per node) or gpu (one GPU per node)")] = "cpu",
    image: Annotated[str, typer.Option(
        help="The fedavg image the cluster pulls, e.g. registry.example/fedavg:0.1 "
             "(containers/Dockerfile, pushed where the cluster pulls from)")] = ...,
    name: Annotated[str, typer.Option(
        help="The run's app.kubernetes.io/instance label, on every object")] = "fedavg",
    host: Annotated[Optional[list[str]], typer.Option(
        help="More names for the coordinator's certificate (nodes outside the cluster); "
             "repeatable")] = None,
    data_claim: Annotated[Optional[str], typer.Option(
        help="PersistentVolumeClaim of your data, mounted read-only at /data")] = None,
    manifests: Annotated[Optional[Path], path_option(
        help="containers/kubernetes of a fedavg checkout (default: this one's)")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a run already in FOLDER, its keys included")] = False,
) -> None:
    """Write a run on Kubernetes: certificates, key Secrets, N node Jobs, a kustomization."""
    # lazy: loads with its command: `fedavg --help` stays fast
    from fedavg.engines.deployment.certs import unignored_git_work_tree
    from fedavg.engines.deployment.kubernetes import LABEL, write_deployment

    with guard(failed="error"):
        written = write_deployment(folder, nodes, overlay=overlay, hosts=host or [],
                                   image=image, name=name, data_claim=data_claim,
                                   manifests=manifests, overwrite=overwrite)
    console.print(f"wrote {len(written)} files into {folder} ({nodes} node Jobs, {overlay}; "
                  f"private keys in {folder}/secrets)", highlight=False)
    console.print(f"run:      kubectl apply -k {folder}\n"
                  "wait:     kubectl wait --for=condition=complete job/fedavg-coordinator "
                  "--timeout=2h\n"
                  f"model:    kubectl apply -f {folder}/fetch.yaml && kubectl wait "
                  "--for=condition=ready pod/fedavg-fetch && kubectl cp "
                  "fedavg-fetch:/output runs/kubernetes\n"
                  f"clean up: kubectl delete -f {folder}/fetch.yaml; kubectl delete -k {folder} "
                  f"(every object carries {LABEL}={name})", highlight=False)
    repo = unignored_git_work_tree(folder / "secrets")
    if repo is not None:
        err_console.print(f"[yellow]note:[/] {folder}/secrets is inside the git work tree "
                          f"{repo}: keep its private keys (*.key) out of version control",
                          highlight=False)


def _show_version(value: bool) -> None:
    if value:
        import importlib.metadata


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
    app.command(name="simulate")(with_settings(simulate, tracking=True))
    app.command(name="merge")(with_settings(merge, config=False, merge=True))
    app.command(name="evaluate")(evaluate)
    app.command(name="predict")(predict)
    app.command(name="export")(export)
    app.command(name="strategies")(list_strategies)
    app.command(name="models")(list_models)
    app.command(name="coordinator")(with_settings(
        with_options(coordinator, CoordinatorOptions), skip=("num_nodes",), tracking=True))
    app.command(name="node")(with_options(node, NodeOptions))
    app.command(name="certs")(certs)
    app.command(name="kubernetes")(kubernetes)
    app.command(name="sweep")(sweep)
    app.command(name="report")(report)
    return app


app = build_app()


def main() -> None:
    """Run the console script ``fedavg``."""
    run_app(app)


if __name__ == "__main__":
    main()
