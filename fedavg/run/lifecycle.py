"""The run lifecycle both engines share: prepare, run folder, round records, summary, result.

``fedavg simulate`` (:mod:`fedavg.engines.simulation.simulate`, Ray) and ``fedavg coordinator``
(:mod:`fedavg.engines.deployment`, SuperLink) differ only in how the ServerApp and the ClientApps
are driven. Everything around that is here, in the order a run goes through it::

    config.validate()  ->  prepare(config)  ->  open_output(...)  ->  [engine runs rounds,
    appending RoundRecords to a RunState]  ->  finish(...)  ->  RunResult
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedavg.config.setting_use import (
    unused_merge_notes,
    unused_setting_notes,
    unused_train_notes,
)
from fedavg.config.settings import RunConfig
from fedavg.data.load import LoadedData, Split, load
from fedavg.data.overlap import overlap_note
from fedavg.data.shares import share_out
from fedavg.data.sources import same_source
from fedavg.run.display import natural_note
from fedavg.run.output import (  # noqa: F401  (re-exported: the run folder)
    RUN_FILES,
    RUN_OUTPUT,
    check_output,
    default_output,
    make_output,
    release_output,
    remove_if_empty,
)
from fedavg.util.errors import RunError, UserError
from fedavg.util.timeline import phases

log = logging.getLogger("fedavg")


@dataclass
class RoundRecord:
    """What one round produced (one line of ``metrics.jsonl``).

    Attributes
    ----------
    round : int
        Round number, from 1.
    accuracy, loss : float
        Test accuracy (fraction) and mean cross-entropy (nats) of the model saved after the
        round: the merged model, or from ``--swa-start`` on the weight average.
    train_loss : float or None
        Sample-weighted mean training loss the nodes reported.
    num_nodes, num_failed : int
        Node models merged, and node replies left out.
    wall_s : float
        Seconds from sending the round's messages to its saved checkpoint.
    train_s : float or None
        The slowest node's training time (seconds); ``wall_s`` minus this is overhead.
    bytes_to_nodes, bytes_from_nodes : int
        Bytes of serialised arrays the round's messages carried coordinator -> nodes (all
        nodes together), and nodes -> coordinator (every reply, usable or not).
    merged_accuracy, merged_loss : float or None
        With ``--swa-start``, from that round on: the test accuracy and loss of the round's
        merged model itself (``accuracy`` and ``loss`` are then the weight average's, the
        model saved); ``None`` otherwise.
    epsilon : float or None
        With DP (``--dp-noise``): the run's epsilon after this round, at its delta.
    dp_steps : dict or None
        With DP-SGD: ``{node: [q, steps]}`` of the nodes this round merged (their partition
        ids), the accountant's input.
    resumed : bool
        The first round of a resumed run: its ``wall_s`` also waited for the start-up
        (written only when true).
    """

    round: int
    accuracy: float
    loss: float
    train_loss: float | None
    num_nodes: int
    num_failed: int
    wall_s: float
    train_s: float | None = None
    bytes_to_nodes: int = 0
    bytes_from_nodes: int = 0
    merged_accuracy: float | None = None
    merged_loss: float | None = None
    epsilon: float | None = None
    dp_steps: dict[str, list] | None = None
    resumed: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Return a plain dict for JSON.

        ``resumed`` only when true, ``epsilon`` and ``dp_steps`` only with DP; a NaN or
        infinite figure None.
        """
        return {k: None if isinstance(v, float) and not abs(v) < float("inf") else v
                for k, v in self.__dict__.items()
                if (k != "resumed" or v) and (k not in ("epsilon", "dp_steps") or v is not None)}


@dataclass
class RunState:
    """Shared by the ServerApp thread and the caller: progress, results, and ``stop``.

    The caller sets ``stop`` when the engine is gone (Ctrl-C): the ServerApp stops waiting.
    """

    rounds: list[RoundRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    error: BaseException | None = None
    #: ``time.monotonic()`` per step of the run (:mod:`fedavg.util.timeline`)
    marks: dict[str, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class Prepared:
    """Data, partitions, model and strategy of a run, before any training.

    Attributes
    ----------
    data : LoadedData
        The dataset; ``data.train`` is what the nodes share out.
    parts : list of numpy.ndarray
        One index array into ``data.train`` per node.
    spec : fedavg.models.registry.ModelSpec
        The model every node trains.
    meta : dict
        Base of ``model.json``: model, classes, input normalisation, dataset, config.
    strategy : strategies.Strategy
        The run's merge strategy (built once, here).
    validation : Split, optional
        Held-out labelled data for data-driven merges (never the test split).
    distill_x : numpy.ndarray, optional
        ``(M, ...)`` unlabeled inputs for distillation.
    """

    data: LoadedData
    parts: list[np.ndarray]
    spec: Any
    meta: dict[str, Any]
    strategy: Any = None
    validation: Split | None = None
    distill_x: np.ndarray | None = None


@dataclass
class RunResult:
    """What a finished run returns (``fedavg simulate`` and ``fedavg coordinator``).

    Attributes
    ----------
    accuracy, loss : float
        Test accuracy (fraction) and mean cross-entropy (nats) of the final merged model.
    rounds : list of dict
        One entry per round, as in ``metrics.jsonl``.
    output : pathlib.Path
        Run folder; ``model_dir`` is the same folder (load it with :func:`fedavg.load_model`).
    wall_s : float
        Seconds from start to end of the run, data loading (and waiting for nodes) included.
    num_nodes : int
        Nodes of the run (``--num-nodes``, or ``--min-nodes`` across machines).
    failures : list of str
        One line per node reply left out of a merge.
    run_id : int, optional
        The Flower run id (``fedavg coordinator`` only).
    startup_s : dict, optional
        Seconds per start-up phase (:func:`fedavg.util.timeline.phases`; simulation only).
    """

    accuracy: float
    loss: float
    rounds: list[dict[str, Any]]
    output: Path
    wall_s: float
    num_nodes: int
    failures: list[str] = field(default_factory=list)
    run_id: int | None = None
    startup_s: dict[str, float] | None = None

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


# --------------------------------------------------------------------------- prepare


def prepare(config: RunConfig, *, model: bool = True, data: LoadedData | None = None) -> Prepared:
    """Load the dataset, hold out merge data, partition it, choose the model and strategy.

    ``model=False`` (a node finding its partition) neither resolves nor builds the model:
    a node imports no model code it was not told to run. ``data``: the dataset already
    loaded with ``config.data``'s :func:`~fedavg.data.load.data_settings` (used as is, not changed).

    Raises
    ------
    UserError
        Bad dataset, columns, partitioning, model or strategy options.
    """
    from fedavg.models.registry import ModelSpec  # lazy: loads torch, which only this path needs

    d = config.data
    strategy = config.build_strategy()
    data = load(d.dataset, **config.data_settings()) if data is None else data.copy()
    leak = overlap_note(data.test.x, data.train.x, "test", d.dataset) if model else None
    if leak:  # (a deployment node, model=False, shows no notes)
        data.notes.append(leak)
    if config.train.augment and data.kind != "image":
        data.notes.append(f"--augment does nothing for {data.kind} inputs (it augments "
                          "images only)")
    if d.tokenizer != "hashed" and data.kind != "text":
        data.notes.append(f"--tokenizer {d.tokenizer} does nothing for {data.kind} inputs "
                          "(it tokenizes text only)")
    data.notes.extend(unused_setting_notes(d) + unused_train_notes(
        config.train, strategy.node_defaults) + unused_merge_notes(config.merge))
    if features := data.columns.get("features"):  # chosen, not named: say which
        data.notes.append(f"tabular: label column {data.columns['label']!r}, {len(features)} "
                          f"feature column(s): {', '.join(features[:8])}"
                          f"{', ...' if len(features) > 8 else ''}")
    parts, validation, distill_x = share_out(config, strategy, data)
    data.notes.extend(_coverage_notes(data, parts, d.partitioner))
    spec = None
    if model:
        t = config.train
        given = sorted(set(t.model_args) & set(text_model_args(data)))
        if given:
            raise UserError(f"--model-arg {', '.join(given)}: for text these come from the "
                            "tokenizer; leave them out (see --tokenizer, --max-tokens)")
        spec = ModelSpec.resolve(t.model, data.input_shape, len(data.classes),
                                 {**t.model_args, **text_model_args(data)},
                                 pretrained=t.pretrained, kind=data.kind,
                                 lora=_lora_settings(t, strategy, data.notes),
                                 group_norm=t.group_norm)
        # fail early on shapes the model cannot take; say how its inputs are adapted
        built = spec.build()
        # lazy: loads torch, which only this path needs
        from fedavg.node.train import check_batch_size

        check_batch_size(built, t.batch_size)  # BatchNorm needs two samples a batch
        if t.dp_sgd:
            _check_dp_sgd(built, spec.name, data)
        data.notes.extend(spec.check(built))
        data.notes.extend(_strategy_notes(strategy, built, config))
    meta = _metadata(config, data, spec, validation, distill_x)
    prepared = Prepared(data, parts, spec, meta, strategy, validation, distill_x)

    grouped = natural_note(prepared)
    if grouped:
        data.notes.append(grouped)  # shown with the plan, kept in model.json
    return prepared


def _check_dp_sgd(built, name: str, data: LoadedData) -> None:
    """Refuse a model DP-SGD cannot train before anything starts (a probe of zeros).

    Raises
    ------
    UserError
        A layer without per-sample gradients (BatchNorm), or a model Opacus fails on.
    """
    import torch  # lazy: loads torch, which only this path needs

    from fedavg.data.load import normalize
    from fedavg.node.dp_sgd import per_sample_mode, unsupported_layer

    if problem := unsupported_layer(built):
        raise UserError(f"--dp-sgd: {problem}")
    dtype = torch.as_tensor(data.train.x[:1]).dtype
    probe = normalize(torch.zeros((2, *data.input_shape), dtype=dtype), data.input_spec())
    built.train()
    per_sample_mode(built, probe, name)


def _lora_settings(t, strategy, notes: list[str]) -> dict | None:
    """Return the LoRA settings of the model spec; an ensemble keeps each node's adapters.

    An output ensemble merges no parameters, so the ``exact`` merge (which folds each node's
    adapters into the adapted weights) would only make every member carry those weights:
    its members keep their own adapters instead (``average`` transport), said in a note.
    """
    lora = t.lora()
    if lora and lora["merge"] == "exact" and getattr(strategy, "keeps_members", False):
        lora["merge"] = "average"
        notes.append(f"--lora-merge exact: {strategy.name} merges no parameters; each member "
                     "keeps its own adapters (one base, one set of adapters per node)")
    return lora


def _coverage_notes(data: LoadedData, parts: list[np.ndarray], partitioner: str) -> list[str]:
    """Say which classes no train sample has, and which samples no node's partition holds."""
    def named(idx) -> str:
        return ", ".join(data.classes[i] for i in idx[:5]) + (", ..." if len(idx) > 5 else "")

    notes, n = [], len(data.classes)
    if len(absent := np.flatnonzero(np.bincount(data.train.y, minlength=n) == 0)):
        notes.append(f"{len(absent)} class(es) without train samples, never learnt: "
                     f"{named(absent)}")
    used = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if len(used) < len(data.train):
        left = np.setdiff1d(np.flatnonzero(np.bincount(data.train.y, minlength=n)),
                            data.train.y[used])
        notes.append(f"the {partitioner} partition gives the nodes {len(used)} of "
                     f"{len(data.train)} train samples" + (
                         f"; {len(left)} class(es) in no node's partition: {named(left)}"
                         if len(left) else ""))
    return notes


def _strategy_notes(strategy, model, config: RunConfig) -> list[str]:
    """Return the strategy's notes on the model and node settings (``UserError``: unusable)."""
    import strategies  # lazy: loads torch, which only this path needs

    note = strategy.nodes_note(config.nodes_per_round)
    skew = [strategy.skew_note] if strategy.skew_note and config.data.partitioner != "iid" \
        else []
    if strategy.rounds_note and config.merge.rounds > 1:
        skew.append(f"{strategy.name}: {strategy.rounds_note}")
    try:
        train = {**asdict(config.train), **asdict(config.local_training())}
        return skew + strategy.check_setup(model, train) + (
            [f"{strategy.name}: {note}"] if note else [])
    except strategies.MergeError as exc:
        raise UserError(f"{strategy.name}: {exc}") from None


def text_model_args(data: LoadedData) -> dict:
    """Builder arguments that text data adds: the tokenizer's ``vocab_size`` and ``pad_id``."""
    if data.tokenizer is None:
        return {}
    return {"vocab_size": int(data.tokenizer.vocab_size), "pad_id": int(data.tokenizer.pad_id)}


def _metadata(config: RunConfig, data: LoadedData, spec, validation, distill_x) -> dict:
    # a local path is stored absolute, so that evaluate works from any folder
    source = data.source
    if source != "digits" and Path(source).expanduser().exists():
        source = str(Path(source).expanduser().resolve())
    return {
        "model": None if spec is None else spec.as_dict(),
        "classes": data.classes, "input": data.input_spec(),
        "dataset": {
            "source": source, "columns": data.columns,
            "train_samples": len(data.train), "test_samples": len(data.test),
            "seed": config.data.seed, "test_fraction": config.data.test_fraction,
            "validation_samples": 0 if validation is None else len(validation),
            "validation_kept": 0 if validation is None or (  # of these, kept from train
                config.merge.validation and not same_source(config.merge.validation,
                                                            config.data.dataset))
            else len(validation),
            "distill_samples": 0 if distill_x is None else len(distill_x),
            "notes": data.notes,
        },
        "strategy": config.merge.strategy, "config": config.as_dict(),
        # what the nodes train with: given, else the strategy's own, else the default
        "local_training": asdict(config.local_training()),
    }


def quiet_logs(verbose: bool) -> None:
    """Keep Flower's and Ray's own logs (and telemetry) off unless ``verbose``."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # A Ray call racing the end of a run must fail, not start a new Ray instance.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    import flwr.common.logger  # noqa: F401  (configures the "flwr" logger on import)

    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.CRITICAL)


# --------------------------------------------------------------------------- finish


def finish(state: RunState, prepared: Prepared, config: RunConfig, out: Path, started: float,
           *, num_nodes: int, run_id: int | None = None, console=None) -> RunResult:
    """Check every round finished, write ``summary.json``, print the rounds table.

    Parameters
    ----------
    state : RunState
        What the ServerApp recorded.
    prepared : Prepared
        The run's data and model.
    config : RunConfig
        The run's settings.
    out : pathlib.Path
        The run folder.
    started : float
        ``time.monotonic()`` at the start of the run.
    num_nodes : int
        Nodes of the run, for the summary.
    run_id : int, optional
        Flower's run id (deployment).
    console : rich.console.Console, optional
        Where to print the table and the closing line.

    Raises
    ------
    RunError
        The run stopped before its last round (finished rounds stay in ``out``).
    """
    release_output(out)
    if state.error is not None:
        raise state.error
    if len(state.rounds) != config.merge.rounds:
        raise RunError(f"the run stopped after {len(state.rounds)} of {config.merge.rounds} "
                       f"rounds; finished rounds are in {out}")
    wall = time.monotonic() - started
    last = state.rounds[-1]
    result = RunResult(accuracy=last.accuracy, loss=last.loss,
                       rounds=[r.as_dict() for r in state.rounds], output=out,
                       wall_s=round(wall, 3), num_nodes=num_nodes, failures=state.failures,
                       run_id=run_id, startup_s=_startup(state))
    write_summary(result, prepared, config)
    if console is not None:  # each round was printed as it ended
        console.print(f"[bold green]done[/] in {wall:.1f} s: test accuracy "
                      f"[bold]{last.accuracy:.4f}[/], loss {last.loss:.4f}; model saved in "
                      f"[bold]{out}[/]", soft_wrap=True)
    return result


def _privacy(config: RunConfig, rounds: list[dict]) -> dict[str, Any]:
    """``{"privacy": ...}`` of a DP run (the accountant replayed), else ``{}``."""
    from fedavg.run import privacy  # lazy: loads torch, which only this path needs

    dp = privacy.for_run(config)
    if dp is None:
        return {}
    dp.replay_records(rounds)
    return {"privacy": dp.describe()}


def write_summary(result: RunResult, prepared: Prepared, config: RunConfig) -> None:
    """Write ``summary.json``: final and best accuracy, timing, sizes, failures, settings."""
    from fedavg.run.checkpoint import write_json  # lazy: loads torch, which only this path needs

    write_json(result.summary_path, {
        "accuracy": result.accuracy,
        "loss": result.loss,
        "best_accuracy": max(r["accuracy"] for r in result.rounds),
        "rounds": len(result.rounds),
        "num_nodes": result.num_nodes,
        "wall_s": result.wall_s,
        # serialised arrays of every round's messages (a resumed run's rounds included)
        "bytes_to_nodes": sum(int(r.get("bytes_to_nodes") or 0) for r in result.rounds),
        "bytes_from_nodes": sum(int(r.get("bytes_from_nodes") or 0) for r in result.rounds),
        "strategy": config.merge.strategy,
        "model": prepared.spec.name,
        "dataset": prepared.meta["dataset"]["source"],  # a local path made absolute
        "train_samples": len(prepared.data.train),
        "test_samples": len(prepared.data.test),
        "failures": result.failures,
        **_privacy(config, result.rounds),
        **({"startup_s": result.startup_s} if result.startup_s else {}),
        "config": config.as_dict(),
    })


def _startup(state: RunState) -> dict[str, float] | None:
    return phases(state.marks) if "entered" in state.marks else None
