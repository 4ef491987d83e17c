"""Flower ServerApp: config -> strategy -> rounds, for both engines.

Flower's strategy loop (``Strategy.start``) runs the rounds; :class:`FlowerAdapter` merges
with the run's registered strategy; a round-end hook (Flower's ``evaluate_fn``) evaluates the
merged model on the test split, writes ``model.safetensors`` + ``model.json`` and appends to
``metrics.jsonl``, so an interrupted run keeps every finished round. Nothing here copies
Flower's round loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

import strategies
from fedavg.config.checks import secagg_workflow
from fedavg.config.settings import RunConfig
from fedavg.models.evaluation import evaluate, evaluation_device
from fedavg.models.sources import first_line
from fedavg.node import keys
from fedavg.node.clientapp import saved_node_state
from fedavg.node.wire import TrainSettings
from fedavg.run import checkpoint, privacy, resume
from fedavg.run.display import Progress
from fedavg.run.flower_adapter import FlowerAdapter, StreamingGrid
from fedavg.run.lifecycle import Prepared, RoundRecord, RunState
from fedavg.run.lora_transport import LoraTransport
from fedavg.run.merge_context import merge_context
from fedavg.run.output import clear_previous_run
from fedavg.run.resume_checks import check_same_data, check_same_model
from fedavg.run.secure import SecureGrid
from fedavg.util.errors import RunError, UserError
from strategies.swa import WeightAverage

log = logging.getLogger("fedavg")


@dataclass
class Deployment:
    """How a run across machines (``fedavg coordinator``) waits for and tolerates nodes.

    Attributes
    ----------
    min_nodes : int
        Nodes that must be connected before round 1 starts.
    wait_timeout : float
        Seconds to wait for them (and, before a later round, for ``min_nodes_per_round``).
    min_nodes_per_round : int
        Usable replies a round needs; fewer fails the run. Nodes sampled per round are
        ``max(min_nodes_per_round, fraction x connected nodes)``.
    on_nodes : callable, optional
        Called with the sorted node ids whenever the set of connected nodes changes.
    """

    min_nodes: int
    wait_timeout: float
    min_nodes_per_round: int
    on_nodes: Callable[[list[int]], None] | None = None
    _reported: list[int] = field(default_factory=list, init=False, repr=False)

    def wait_for_nodes(self, grid: Grid, needed: int, why: str) -> list[int]:
        """Block until ``needed`` nodes are connected; report changes.

        Raises
        ------
        RunError
            Fewer than ``needed`` nodes after ``wait_timeout`` seconds.
        """
        deadline = time.monotonic() + self.wait_timeout
        while True:
            nodes = sorted(int(n) for n in grid.get_node_ids())
            if nodes != self._reported and self.on_nodes is not None:
                self.on_nodes(nodes)
            self._reported = nodes
            if len(nodes) >= needed:
                return nodes
            if time.monotonic() >= deadline:
                raise RunError(f"{len(nodes)} of {needed} nodes connected {why} after "
                               f"{self.wait_timeout:g} s; start more nodes (fedavg node) or "
                               "lower --min-nodes / raise --wait-timeout")
            time.sleep(0.2)


def _remove_node_models_before(folder: Path, last_round: int) -> None:
    """Remove the saved node models in ``folder`` of a round before ``last_round``.

    A run resumed to train longer saved its node models at its earlier last round; those of
    nodes not sampled in the new last round would stay beside the new ones.
    """
    import shutil

    for node in folder.glob("node-*"):
        try:
            rounds = json.loads((node / checkpoint.META).read_text()).get("rounds")
        except (OSError, ValueError, AttributeError):
            continue  # not a node model this run saved: left alone
        if isinstance(rounds, int) and rounds < last_round:
            shutil.rmtree(node, ignore_errors=True)


def announce_end(grid: Grid, wait_s: float = 5.0, failure: str | None = None) -> None:
    """Tell every connected node the run is over (a ``query`` message).

    The message's config record holds ``run-finished: True``, or ``run-failed: <failure>``
    when the run failed (:data:`fedavg.node.keys.RUN_FAILED`). Nodes started with ``--once`` exit
    on it. Waits at most ``wait_s`` seconds for the acknowledgements.
    """
    entry = {keys.RUN_FINISHED: True} if failure is None else {keys.RUN_FAILED: failure}
    stop = threading.Event()

    def tell() -> None:
        try:
            record = RecordDict({keys.CONFIG: ConfigRecord(entry)})
            messages = [Message(record, dst_node_id=node, message_type="query")
                        for node in grid.get_node_ids()]
            pending = set(grid.push_messages(messages))
            deadline = time.monotonic() + wait_s
            while pending and time.monotonic() < deadline and not stop.is_set():
                for msg in grid.pull_messages(pending):
                    pending.discard(msg.metadata.reply_to_message_id)
                stop.wait(0.05)
        except Exception as exc:  # noqa: BLE001 - the model is saved; this is a courtesy
            log.debug("could not tell the nodes the run ended: %s", exc)

    # A node that exits while its acknowledgement is in flight must not hold up the run. Once
    # the task is finished its token is void, and a pull with it makes Flower's retry logic
    # SIGINT this process: so no pull may outlive this call.
    thread = threading.Thread(target=tell, daemon=True)
    thread.start()
    thread.join(wait_s)
    stop.set()
    thread.join(wait_s)


def failure_reason(exc: BaseException) -> str:
    """One line saying why a run failed, for the nodes (at most 300 characters)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if not isinstance(exc, (RunError, UserError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return (text or "unknown error")[:300]


class ServerRun:
    """The body of one run's ServerApp: the adapter, Flower's round loop and its hooks.

    Parameters
    ----------
    config : RunConfig
        Validated run settings.
    prepared : Prepared
        Data, model spec, metadata and the run's strategy (from
        :func:`fedavg.run.lifecycle.prepare`).
    output : pathlib.Path
        Run folder for ``model.safetensors``, ``model.json``, ``metrics.jsonl``.
    state : RunState
        Filled with one :class:`~fedavg.run.lifecycle.RoundRecord` per round.
    progress : fedavg.run.display.Progress, optional
        Told of each finished round and each node left out.
    deployment : Deployment, optional
        For runs across machines: wait for nodes, stop waiting for nodes that left, and
        tell the nodes when the run is over. ``None`` in simulation.
    resume_from : fedavg.run.resume.Checkpoint, optional
        Go on from this checkpoint (``--resume``): its model, strategy state, random state
        and rounds; only the remaining rounds are run.
    node_contexts : fedavg.flower_compat.NodeContexts, optional
        The simulated nodes' contexts: each checkpoint holds the node states of methods
        that keep one (SCAFFOLD, FedDyn, MOON). ``None`` in deployment, where every node
        keeps its own.
    """

    def __init__(self, config: RunConfig, prepared: Prepared, output: Path, state: RunState,
                 progress: Progress | None = None, deployment: Deployment | None = None,
                 resume_from: resume.Checkpoint | None = None, node_contexts=None) -> None:
        self.config, self.prepared, self.output, self.state = config, prepared, output, state
        self.progress = progress or Progress(None, config.merge.rounds)
        self.deployment, self.resume_from = deployment, resume_from
        self.node_contexts = node_contexts
        self.metrics_path = output / "metrics.jsonl"
        self.model: torch.nn.Module | None = None
        self.eval_device = evaluation_device(config.train.device)  # the merged model's
        self.adapter: FlowerAdapter | None = None
        self.swa = WeightAverage() if config.merge.swa_start is not None else None
        self.stale_summary = False
        self.stale_metrics = False  # metrics.jsonl to rewrite from the checkpoint's rounds
        self.saved_nodes: dict[str, int] = {}  # node model folder -> the node saved there
        self.saved_start = False  # the last round's start, saved beside its node models
        self.stale_nodes = resume_from is not None  # a resumed run's earlier last round saved

    def __call__(self, grid: Grid) -> None:
        """Run every round on ``grid``."""
        seed = self.config.data.seed
        random.seed(seed)  # Flower samples nodes with the random module
        torch.manual_seed(seed)
        # only a new run's initial model loads weights (pretrained, an hf: folder's)
        self.model = self.prepared.spec.build(initial=self.resume_from is None)
        initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        done = 0 if self.resume_from is None else self.resume_from.round
        if self.resume_from is not None:
            initial = self._resume(self.resume_from, initial)
            # a finished run trained longer: its summary.json goes with its first new round
            self.stale_summary = (self.output / "summary.json").exists()
        else:  # a run replaced with --overwrite goes as a whole, now that training starts
            clear_previous_run(self.output)
        if self.deployment is not None:
            self.deployment.wait_for_nodes(grid, self.deployment.min_nodes,
                                           f"before round {done + 1}")
        self.adapter = self._adapter(grid, initial, done)
        settings = TrainSettings.for_run(self.config, self.prepared.meta, self.prepared.strategy)
        if self.resume_from is not None:
            self.resume_from.restore_random()  # the same node sampling as an unbroken run
        streaming = StreamingGrid(grid, on_lost=self._lost if self.deployment else None,
                                  stop=self.state.stop)
        self.adapter.start(
            grid=SecureGrid(streaming, secagg_workflow(self.config.merge))
            if self.config.merge.secure_aggregation else streaming,
            initial_arrays=ArrayRecord(initial),
            num_rounds=self.config.merge.rounds - done,
            timeout=self.config.merge.round_timeout,
            train_config=settings.to_record(),
            evaluate_fn=self.round_end,
        )
        if self.deployment is not None:
            announce_end(grid)

    def _resume(self, ckpt: resume.Checkpoint,
                fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the checkpoint's model, strategy state and rounds; return the model."""
        where = self.output / resume.CHECKPOINT
        check_same_data(self.output, self.prepared.meta["input"],
                        self.prepared.meta.get("dataset"))
        check_same_model(self.output, self.prepared.meta.get("model"))
        problem = resume.model_mismatch(fresh, ckpt.model)
        if problem:
            raise UserError(f"{where} does not fit this run's model: {problem}")
        try:
            self.prepared.strategy.load_state(ckpt.strategy, fresh)
        except strategies.MergeError as exc:
            raise UserError(f"{where} does not fit this run: {exc}") from None
        self._resume_swa(ckpt, fresh)
        self.state.rounds[:] = [RoundRecord(**r) for r in ckpt.rounds]
        self.state.failures[:] = ckpt.failures
        if self.config.merge.rounds > ckpt.round:  # rewritten as the first new round ends
            self.stale_metrics = True  # (interrupted before: the file stays as it was)
        else:
            resume.write_metrics(self.metrics_path, [r.as_dict() for r in self.state.rounds])
        return ckpt.model

    def _resume_swa(self, ckpt: resume.Checkpoint, fresh: dict[str, torch.Tensor]) -> None:
        """Take the checkpoint's weight average (``--swa-start``); it must fit the model."""
        count = resume.averaged_rounds(self.config.merge.swa_start, ckpt.round)
        if count:
            try:
                self.swa.load(ckpt.swa, count, fresh)
            except strategies.MergeError as exc:
                raise UserError(f"{self.output / resume.CHECKPOINT} is damaged: {exc}; start "
                                "a new run") from None

    def _adapter(self, grid: Grid, initial: dict[str, torch.Tensor],
                 done: int) -> FlowerAdapter:
        m, p, deployment = self.config.merge, self.prepared, self.deployment
        if deployment is None:
            per_round, before_round = self.config.nodes_per_round, None
        else:
            per_round = deployment.min_nodes_per_round

            def before_round(r: int) -> None:
                deployment.wait_for_nodes(grid, per_round, f"for round {r}")
        folded = exact_lora(self.model)  # the LoRA layers an exact merge folds, if any
        return FlowerAdapter(
            p.strategy, initial, self.report_failure,
            buffers=frozenset(name for name, _ in self.model.named_buffers()),
            context=merge_context(p.spec, p.meta["input"], self.config.data.seed,
                                  p.validation, p.distill_x, self.config.train.device),
            on_node_model=self.save_node_model,
            before_round=before_round,
            fraction_train=m.fraction,
            fraction_evaluate=0.0,
            min_train_nodes=per_round,
            min_evaluate_nodes=0,
            min_available_nodes=m.num_nodes if deployment is None else per_round,
            min_replies=1 if deployment is None else per_round,
            max_update_norm=m.max_update_norm,
            round_offset=done,
            exact_lora=folded,
            compress_down=m.compress_down,
            dp=self._privacy(),
            lora_transport=None if folded is None else LoraTransport(
                sorted(self.model.downlink_only()), self.model.spec.rank, version=done),
        )

    def _privacy(self):
        """Return the run's DP accounting, caught up with a resumed run's rounds (or None)."""
        dp = privacy.for_run(self.config)
        if dp is not None:
            dp.replay_records([r.as_dict() for r in self.state.rounds])
        return dp

    def report_failure(self, server_round: int, node: int, reason: str) -> None:
        """Record a node reply left out of a round, and tell the progress display."""
        self.state.failures.append(f"round {server_round}, node {node}: {reason}")
        log.warning("round %d: node %d left out: %s", server_round, node, reason)
        self.progress.on_failure(server_round, node, reason)

    def _lost(self, node: int) -> None:
        self.report_failure(self.adapter.current_round, node, "node disconnected during the round")

    def save_node_model(self, server_round: int, state_dict: dict, info: dict,
                        extras: dict | None = None) -> None:
        """With ``--save-node-models``: keep each node's model of the last round.

        The model they all started from goes to ``start/`` beside ``nodes/``, for the
        task-vector merges of ``fedavg merge`` (TIES, DARE, task arithmetic). ``extras``:
        the reply records the strategy merges with (Fisher's estimate), kept beside the
        model as ``<name>.safetensors``.
        """
        if not self.config.merge.save_node_models or server_round != self.config.merge.rounds:
            return
        pid = info["partition_id"]
        name = f"node-{pid if pid >= 0 else info['node_id']}"
        other = self.saved_nodes.setdefault(name, info["node_id"])
        if other != info["node_id"]:  # two nodes of one partition: both models are kept
            self.progress.on_note(f"nodes {other} and {info['node_id']} both trained partition "
                                  f"{pid}: its samples count twice in the merge")
            name = f"{name}-{info['node_id']}"
        extras = extras or {}
        for record, tensors in extras.items():  # first: the model's files then vouch for them
            checkpoint.save_tensors(self.output / "nodes" / name / f"{record}.safetensors",
                                    tensors)
        checkpoint.save(self.output / "nodes" / name, state_dict,
                        {**self.prepared.meta, "rounds": server_round, "node": info,
                         **({"extras_sha256": {r: checkpoint.tensor_digest(t)
                                               for r, t in extras.items()}} if extras else {})})
        if not self.saved_start:  # what the nodes started from: task-vector merges need it
            checkpoint.save(self.output / checkpoint.START, self.adapter.reference,
                            {**self.prepared.meta, "rounds": server_round - 1})
            self.saved_start = True

    def drop_stale_node_models(self, last_round: int) -> None:
        """Remove the node models a resumed run saved at its earlier last round.

        Called once ``last_round``'s checkpoint is written: a run stopped during that round
        still has them (its resume redoes the round).
        """
        self.stale_nodes = False
        _remove_node_models_before(self.output / "nodes", last_round)

    def _evaluate(self, model: torch.nn.Module, server_round: int) -> dict[str, float]:
        """Evaluate ``model`` on the test split; a failure of the model's code is one line.

        Raises
        ------
        fedavg.util.errors.RunError
            The model's forward raised or called ``sys.exit`` (it may differ in eval mode).
        """
        test = self.prepared.data.test
        try:
            return evaluate(model, test.x, test.y, self.prepared.meta["input"],
                            device=self.eval_device)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the model's own code

            raise RunError(f"round {server_round}'s merged model failed on the test data, in "
                           f"eval mode ({first_line(exc)}): fix the model's "
                           "forward") from None

    def round_end(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's ``evaluate_fn``: end a round, in five steps whose order matters.

        1. :meth:`_score`: evaluate the merged model on the test split (with SWA, the average
           of the rounds' merged models, and the last merged model beside it);
        2. :meth:`_keep_record`: add the round's record to the run state and mark the
           start-up timeline (the first round this process ran ends the start-up);
        3. :meth:`_save`: drop a ``summary.json`` the round makes stale, save the merged
           model, then the checkpoint (and node models of a resumed run's last round);
        4. :meth:`_append_metrics`: the round's line in ``metrics.jsonl``, after the
           checkpoint, so that every round listed is one a resume goes on from;
        5. :meth:`_report`: the progress line, and a merge's note.

        Round 0 (Flower's evaluation of the initial model) does nothing.

        Returns
        -------
        flwr.app.MetricRecord or None
            ``accuracy`` and ``loss`` on the test split (``None`` for round 0).
        """
        if server_round == 0:
            return None
        server_round += self.adapter.round_offset
        state_dict = arrays.to_torch_state_dict()  # what the next round starts from
        merged, res, last = self._score(server_round, state_dict)
        record = self._keep_record(server_round, res, last)
        self._save(server_round, merged, state_dict, record)
        self._append_metrics(record)
        self._report(record, merged)
        return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

    def _score(self, server_round: int, state_dict: dict[str, torch.Tensor]):
        """Evaluate the round's model; return the merge to save, its scores, the last merge's.

        With SWA from this round on, the average of the merged models is what is scored and
        saved, and the last merged model's own scores come third (``None`` otherwise).
        """
        merged = self.adapter.last_merged
        last = None
        if merged is not None and merged.is_ensemble:
            scored = self.prepared.spec.build_ensemble(merged.members, merged.member_weights)
        else:
            self.model.load_state_dict(state_dict)
            scored = self.model
            if self.swa is not None and server_round >= self.config.merge.swa_start:
                last = self._evaluate(scored, server_round)
                averaged = self.swa.add(state_dict)
                self.model.load_state_dict(averaged)
                merged = dataclasses.replace(merged, state_dict=averaged, info={
                    **merged.info, "swa": {"start": self.config.merge.swa_start,
                                           "models": self.swa.count}})
        return merged, self._evaluate(scored, server_round), last

    def _keep_record(self, server_round: int, res: dict, last: dict | None) -> RoundRecord:
        """Add the round's record to the run state; mark the start-up timeline."""
        record = self._record(server_round, res)
        if last is not None:
            record.merged_accuracy, record.merged_loss = last["accuracy"], last["loss"]
        self.state.rounds.append(record)
        now = time.monotonic()  # the first round this process ran: start-up ends there
        if "round1_end" not in self.state.marks:
            self.state.marks.update(round1_start=now - record.wall_s, round1_end=now)
        self.state.marks["last_round_end"] = now
        return record

    def _save(self, server_round: int, merged, state_dict: dict[str, torch.Tensor],
              record: RoundRecord) -> None:
        """Save the merged model, then the checkpoint a resume goes on from."""
        if self.stale_summary:  # the model and rounds move past what it describes
            (self.output / "summary.json").unlink(missing_ok=True)
            self.stale_summary = False
        dp = self.adapter.dp
        checkpoint.save_merged(self.output, merged, {
            **self.prepared.meta, "rounds": server_round,
            "metrics": {"accuracy": record.accuracy, "loss": record.loss},
            **({"privacy": dp.describe()} if dp is not None else {})})
        resume.save(self.output, resume.capture(
            server_round, state_dict, self.config, self.prepared.strategy,
            [r.as_dict() for r in self.state.rounds], self.state.failures, self._node_states(),
            swa=self.swa))
        if self.stale_nodes and server_round == self.config.merge.rounds:
            self.drop_stale_node_models(server_round)

    def _append_metrics(self, record: RoundRecord) -> None:
        """Write the round's line of ``metrics.jsonl`` (all the rounds on a resume's first)."""
        if self.stale_metrics:  # a resume's first round: its rounds, then this one
            resume.write_metrics(self.metrics_path, [r.as_dict() for r in self.state.rounds])
            self.stale_metrics = False
        else:
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(record.as_dict()) + "\n")

    def _report(self, record: RoundRecord, merged) -> None:
        """Show the round's progress line, and a merge's note (a distillation that did nothing)."""
        self.progress.on_round(record)
        if merged is not None and merged.info.get("note"):
            self.progress.on_note(merged.info["note"])

    def _node_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """By partition, what the nodes keep between rounds (simulation only).

        The method's node state and ``--compress``'s error-feedback leftover.
        """
        strategy = self.prepared.strategy
        feedback = self.config.train.compress != "none" and self.config.train.error_feedback
        if self.node_contexts is None or (strategy.node_rule is None and not feedback):
            return {}  # nothing kept: no pass over every node's context (10,000 nodes)
        method = strategy.name if strategy.node_rule is not None else ""
        return self.node_contexts.states(lambda records: saved_node_state(records, method))

    def _record(self, server_round: int, res: dict) -> RoundRecord:
        info = self.adapter.last_train
        return RoundRecord(
            round=server_round,
            accuracy=res["accuracy"],
            loss=res["loss"],
            train_loss=info.get("train_loss"),
            num_nodes=int(info.get("num_nodes", 0)),
            num_failed=int(info.get("num_failed", 0)),
            wall_s=round(time.monotonic() - self.adapter.round_started, 3),
            train_s=None if info.get("train_s") is None else round(info["train_s"], 3),
            bytes_to_nodes=int(info.get("bytes_to_nodes", 0)),
            bytes_from_nodes=int(info.get("bytes_from_nodes", 0)),
            epsilon=info.get("epsilon"),
            dp_steps=info.get("dp_steps"),
            resumed=self.resume_from is not None and "round1_end" not in self.state.marks,
        )


def exact_lora(model: torch.nn.Module) -> dict[str, float] | None:
    """Return the layers whose LoRA updates the merge folds in (``--lora-merge exact``)."""
    spec = getattr(model, "spec", None)
    if spec is None or getattr(spec, "merge", None) != "exact":
        return None
    return model.adapted_layers()


def make_server_app(config: RunConfig, prepared: Prepared, output: Path, state: RunState,
                    progress: Progress | None = None, deployment: Deployment | None = None,
                    resume_from: resume.Checkpoint | None = None,
                    node_contexts=None) -> ServerApp:
    """Build the coordinator ServerApp for one run (see :class:`ServerRun`).

    An exception in the run is kept in ``state.error`` (engines may wrap it) and re-raised;
    with a ``deployment``, the connected nodes are first told that the run failed and why.
    """
    app = ServerApp()
    run = ServerRun(config, prepared, output, state, progress, deployment, resume_from,
                    node_contexts)

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run(grid)
        except BaseException as exc:
            state.error = exc
            if deployment is not None and isinstance(exc, Exception):
                # tell the nodes why, before the SuperLink goes
                announce_end(grid, failure=failure_reason(exc))
            raise

    return app
