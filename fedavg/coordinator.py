"""Flower ServerApp: run the rounds, merge node models with a ``strategies`` method, checkpoint.

Flower's own strategy class samples nodes and sends messages; :class:`FlowerAdapter` only
replaces its aggregation with our registered, Flower-free merge (by parameter name, dtypes
kept, integer buffers not averaged). A round-end hook (Flower's ``evaluate_fn``) evaluates the
merged model on the test split, writes ``model.safetensors`` + ``model.json`` and appends to
``metrics.jsonl``, so an interrupted run keeps every finished round.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

import strategies
from fedavg import checkpoint, keys
from fedavg.config import RunConfig
from fedavg.data import Split
from fedavg.errors import RunError
from fedavg.models import build_model
from fedavg.train import evaluate

log = logging.getLogger("fedavg")


@dataclass
class RoundRecord:
    """What one round produced (one line of ``metrics.jsonl``)."""

    round: int
    accuracy: float
    loss: float
    train_loss: float | None
    num_nodes: int
    num_failed: int
    wall_s: float
    #: the slowest node's training time (seconds); wall_s minus this is the overhead
    train_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return dict(self.__dict__)


@dataclass
class RunState:
    """Shared between the ServerApp thread and the caller: progress and results."""

    rounds: list[RoundRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    error: BaseException | None = None


class StreamingGrid:
    """A Flower ``Grid`` whose ``send_and_receive`` yields each reply as it arrives.

    Flower's own ``send_and_receive`` returns the list of all replies of a round, so the
    coordinator would hold every node's model at once. With this wrapper (public
    ``push_messages`` / ``pull_messages`` only) the strategy's ``aggregate_train`` folds each
    model in and drops it before the next one is pulled: memory O(model), not
    O(nodes x model). Everything else is delegated to the wrapped grid.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The run's grid.
    poll_s : float
        Seconds between polls while no reply is waiting.
    """

    def __init__(self, grid: Grid, poll_s: float = 0.05,
                 on_lost: Callable[[int], None] | None = None,
                 node_check_s: float = 1.0) -> None:
        self._grid = grid
        self.poll_s = poll_s
        self.on_lost = on_lost
        self.node_check_s = node_check_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push now; return a generator of the replies, pulled while it is consumed."""
        messages = list(messages)
        ids = list(self._grid.push_messages(messages))
        destination = {mid: msg.metadata.dst_node_id for mid, msg in zip(ids, messages)}
        del messages
        deadline = None if timeout is None else time.monotonic() + timeout
        return _Replies(self._replies(set(ids), destination, deadline), destination)

    def _replies(self, pending: set[str], destination: dict[str, int],
                 deadline: float | None) -> Iterable[Message]:
        checked = time.monotonic()
        while pending and (deadline is None or time.monotonic() < deadline):
            got = list(self._grid.pull_messages(pending))
            for msg in got:
                pending.discard(msg.metadata.reply_to_message_id)
            while got:
                yield got.pop(0)  # hand over one at a time, keeping no reference
            if pending and self.on_lost is not None \
                    and time.monotonic() - checked >= self.node_check_s:
                checked = time.monotonic()
                online = set(self._grid.get_node_ids())
                for mid in [m for m in pending if destination.get(m) not in online]:
                    pending.discard(mid)  # the node left: stop waiting for it
                    self.on_lost(destination[mid])
            if pending:
                time.sleep(self.poll_s)


class _Replies:
    """The replies of a round (consumed once) and which node each message went to."""

    def __init__(self, replies: Iterable[Message], destination: dict[str, int]) -> None:
        self._replies = replies
        self.destination = destination

    def __iter__(self):
        return iter(self._replies)


class FlowerAdapter(FlowerFedAvg):
    """Flower's FedAvg for sampling and messaging, with aggregation by a ``strategies`` method.

    Replies with an error, or whose content is malformed (missing arrays or ``num-examples``,
    mismatched keys, shapes or dtypes, NaN), are reported through ``on_failure`` with the
    node id and left out of the merge; the others are merged.

    Raises
    ------
    fedavg.errors.RunError
        From ``aggregate_train`` when no reply of a round is usable.
    """

    def __init__(self, merge: strategies.Strategy, reference: dict[str, torch.Tensor],
                 on_failure: Callable[[int, int, str], None], *,
                 buffers: frozenset[str] = frozenset(),
                 context: strategies.MergeContext | None = None,
                 on_node_model: Callable[[int, dict, dict], None] | None = None,
                 min_replies: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_replies = min_replies
        self.before_round: Callable[[int], None] | None = None
        self.current_round = 0
        self.merge = merge
        self.reference = reference
        self.buffers = buffers
        self.context = context
        self.on_failure = on_failure
        self.on_node_model = on_node_model
        self.last_train: dict[str, float] = {}
        self.last_merged: strategies.Merged | None = None
        self.round_started = time.monotonic()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample nodes and build their messages; start the round's clock."""
        if self.before_round is not None:
            self.before_round(server_round)
        self.current_round = server_round
        self.round_started = time.monotonic()
        self.reference = arrays.to_torch_state_dict()  # the round's starting point
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Merge usable replies one at a time; report the others."""
        self.merge.begin(self.reference, self.buffers, self.context)
        used, failed, loss_sum, weight_sum = 0, 0, 0.0, 0.0
        train_s = None
        reasons = []
        sent_to = getattr(replies, "destination", None) or {}
        for msg in replies:
            # an error reply made by the SuperLink (node gone) names the SuperLink as source
            node = sent_to.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            try:
                if msg.has_error():
                    raise RunError(error_summary(msg.error.reason))
                content = msg.content
                if keys.ARRAYS not in content.array_records:
                    raise RunError(f"reply has no {keys.ARRAYS!r} record")
                metrics = content.metric_records.get(keys.METRICS)
                if metrics is None or keys.NUM_EXAMPLES not in metrics:
                    raise RunError(f"reply has no {keys.NUM_EXAMPLES!r} metric")
                weight = metrics[keys.NUM_EXAMPLES]
                state = content.array_records[keys.ARRAYS].to_torch_state_dict(
                    keep_input=False
                )
                self.merge.add(state, weight, node=str(node))
                if self.on_node_model is not None:
                    self.on_node_model(server_round, state, {
                        "node_id": node, "num_examples": weight,
                        "partition_id": int(metrics.get(keys.PARTITION_ID, -1)),
                        "train_loss": float(metrics.get(keys.TRAIN_LOSS, float("nan")))})
                del state
            except (RunError, strategies.MergeError, ValueError, TypeError) as exc:
                failed += 1
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                reasons.append(f"node {node}: {reason}")
                self.on_failure(server_round, node, reason)
                continue
            used += 1
            weight_sum += float(weight)
            if keys.TRAIN_LOSS in metrics:
                loss_sum += float(metrics[keys.TRAIN_LOSS]) * float(weight)
            if keys.TRAIN_SECONDS in metrics:
                train_s = max(train_s or 0.0, float(metrics[keys.TRAIN_SECONDS]))
        if not used:
            detail = "; ".join(reasons[:3]) or "no replies before --round-timeout"
            raise RunError(f"round {server_round}: no usable model from any node ({detail})")
        if used < self.min_replies:
            raise RunError(f"round {server_round}: only {used} usable model(s), fewer than "
                           f"--min-nodes-per-round {self.min_replies}")
        try:
            merged = self.merge.result()
        except strategies.MergeError as exc:
            raise RunError(f"round {server_round}: {exc}") from None
        self.last_merged = merged
        self.last_train = {
            "train_loss": loss_sum / weight_sum if weight_sum else float("nan"),
            "num_nodes": used,
            "num_failed": failed,
            "train_s": train_s,
        }
        metrics_out = MetricRecord({"train-loss": self.last_train["train_loss"],
                                    "num-nodes": used})
        return ArrayRecord(merged.state_dict), metrics_out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOWER_REASON = re.compile(r"^<class '([\w.]+)'>:<'(.*)'>$", re.S)
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (\S.*)$")


def _announce_end(grid: Grid, wait_s: float = 5.0) -> None:
    """Tell every connected node the run is over (a ``query`` message; nodes started with
    ``--once`` exit on it). Waits at most ``wait_s`` seconds for the acknowledgements."""
    import threading

    from flwr.app import RecordDict

    def tell() -> None:
        try:
            messages = [Message(RecordDict({keys.CONFIG: ConfigRecord({"run-finished": True})}),
                                dst_node_id=node, message_type="query")
                        for node in grid.get_node_ids()]
            pending = set(grid.push_messages(messages))
            deadline = time.monotonic() + wait_s
            while pending and time.monotonic() < deadline:
                for msg in grid.pull_messages(pending):
                    pending.discard(msg.metadata.reply_to_message_id)
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - the model is saved; this is a courtesy
            log.debug("could not tell the nodes the run ended: %s", exc)

    # A node that exits while its acknowledgement is in flight must not hold up the run.
    thread = threading.Thread(target=tell, daemon=True)
    thread.start()
    thread.join(wait_s)


def error_summary(reason: str) -> str:
    """One line from a node's error report: the original exception type and message.

    Flower wraps a node's exception (in simulation, inside Ray's) with tracebacks; this keeps
    the innermost ``SomeError: message`` line, e.g. ``FloatingPointError: training diverged``.
    """
    text = _ANSI.sub("", reason or "")
    flower = _FLOWER_REASON.match(text.strip())  # a ClientApp's exception, as Flower wraps it
    if flower:
        return f"{flower.group(1).rsplit('.', 1)[-1]}: {' '.join(flower.group(2).split())}"[:300]
    for line in text.splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and not m.group(1).startswith(("flwr.", "ray.")):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"[:300]
    if "Message:" in text:
        return text.rsplit("Message:", 1)[1].strip().strip("'>").strip()[:300]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")
    return first[:300]


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


@dataclass
class ModelSpec:
    """How to rebuild the model: registry name, builder args, input shape, classes."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    args: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON and the wire."""
        return {"name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "args": dict(self.args)}

    def build(self) -> torch.nn.Module:
        """A fresh instance."""
        return build_model(self.name, self.input_shape, self.num_classes, **self.args)

    def build_ensemble(self, members: list[dict[str, torch.Tensor]],
                       weights: list[float]) -> torch.nn.Module:
        """An :class:`~fedavg.models.EnsembleModel` of instances loaded with ``members``."""
        from fedavg.models import EnsembleModel

        nets = []
        for state in members:
            net = self.build()
            net.load_state_dict(state)
            nets.append(net)
        return EnsembleModel(nets, weights)


def merge_context(spec: ModelSpec, input_spec: dict[str, Any], seed: int,
                  validation: Split | None = None, distill_x=None,
                  device: str = "auto") -> strategies.MergeContext:
    """What data-driven merges may use: the model builder, normalisation and held-out data."""
    from fedavg.data import normalize
    from fedavg.train import resolve_device

    return strategies.MergeContext(
        build_model=spec.build,
        normalize=lambda x: normalize(x, input_spec),
        val_x=None if validation is None else torch.as_tensor(validation.x),
        val_y=None if validation is None else torch.as_tensor(validation.y, dtype=torch.long),
        distill_x=None if distill_x is None else torch.as_tensor(distill_x),
        device=resolve_device(device),
        seed=seed,
    )


def save_merged(output: Path, merged: strategies.Merged, meta: dict[str, Any]) -> None:
    """Write a merge result as the run's model artifact (single network or ensemble)."""
    meta = {**meta, "merge_info": _jsonable(merged.info)} if merged.info else meta
    if merged.is_ensemble:
        checkpoint.save_ensemble(output, merged.members, merged.member_weights, meta)
    else:
        checkpoint.save(output, merged.state_dict, meta)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def make_server_app(
    config: RunConfig,
    spec: ModelSpec,
    test: Split,
    meta: dict[str, Any],
    output: Path,
    state: RunState,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_failure: Callable[[int, int, str], None] | None = None,
    validation: Split | None = None,
    distill_x=None,
    deployment: Deployment | None = None,
) -> ServerApp:
    """Build the coordinator ServerApp for one run.

    Parameters
    ----------
    config : RunConfig
        Validated run settings.
    spec : ModelSpec
        The model every node trains.
    test : Split
        Held-out data for centralised evaluation after every round.
    meta : dict
        Base of ``model.json`` (classes, input normalisation, dataset, ...).
    output : pathlib.Path
        Run folder for ``model.safetensors``, ``model.json``, ``metrics.jsonl``.
    state : RunState
        Filled with one :class:`RoundRecord` per round.
    on_round, on_failure : callable, optional
        Progress hooks: after each round; on each failed node reply ``(round, node, reason)``.
    validation : Split, optional
        Held-out set for data-driven merges (greedy soup, fitted weights, distillation).
    distill_x : array, optional
        Unlabeled inputs for distillation.
    deployment : Deployment, optional
        For runs across machines: wait for nodes, stop waiting for nodes that left, and
        tell the nodes when the run is over. ``None`` in simulation.
    """
    app = ServerApp()
    metrics_path = output / "metrics.jsonl"

    def report_failure(server_round: int, node: int, reason: str) -> None:
        state.failures.append(f"round {server_round}, node {node}: {reason}")
        log.warning("round %d: node %d left out: %s", server_round, node, reason)
        if on_failure:
            on_failure(server_round, node, reason)

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            _run(grid)
        except BaseException as exc:
            state.error = exc
            raise

    def _run(grid: Grid) -> None:
        random.seed(config.data.seed)  # Flower samples nodes with the random module
        torch.manual_seed(config.data.seed)
        model = spec.build()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        merge = config.strategy()
        n = config.merge.num_nodes
        rounds = config.merge.rounds

        def save_node_model(server_round: int, sd: dict, info: dict) -> None:
            if config.merge.save_node_models and server_round == rounds:
                pid = info["partition_id"]
                checkpoint.save(output / "nodes" / f"node-{pid if pid >= 0 else info['node_id']}",
                                sd, {**meta, "rounds": server_round, "node": info})

        if deployment is not None:
            deployment.wait_for_nodes(grid, deployment.min_nodes, "before round 1")
            per_round = deployment.min_nodes_per_round
        else:
            per_round = config.nodes_per_round
        adapter = FlowerAdapter(
            merge,
            initial,
            report_failure,
            buffers=frozenset(name for name, _ in model.named_buffers()),
            context=merge_context(spec, meta["input"], config.data.seed, validation, distill_x,
                                  config.train.device),
            on_node_model=save_node_model,
            fraction_train=config.merge.fraction,
            fraction_evaluate=0.0,
            min_train_nodes=per_round,
            min_evaluate_nodes=0,
            min_available_nodes=n if deployment is None else per_round,
            min_replies=1 if deployment is None else per_round,
        )
        if deployment is not None:
            adapter.before_round = lambda r: deployment.wait_for_nodes(
                grid, per_round, f"for round {r}")
        train_config = ConfigRecord(
            {
                "model": json.dumps(spec.as_dict(), sort_keys=True),
                "input": json.dumps(meta["input"]),
                "local-epochs": config.train.local_epochs,
                "batch-size": config.train.batch_size,
                "lr": config.train.lr,
                "momentum": config.train.momentum,
                "weight-decay": config.train.weight_decay,
                "seed": config.data.seed,
                "classes": json.dumps(meta["classes"]),
                **merge.node_config,
            }
        )
        metrics_path.unlink(missing_ok=True)

        def round_end(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0:
                return None
            merged = adapter.last_merged
            if merged is not None and merged.is_ensemble:
                scored = spec.build_ensemble(merged.members, merged.member_weights)
            else:
                model.load_state_dict(arrays.to_torch_state_dict())
                scored = model
            res = evaluate(scored, test.x, test.y, meta["input"])
            info = adapter.last_train
            record = RoundRecord(
                round=server_round,
                accuracy=res["accuracy"],
                loss=res["loss"],
                train_loss=info.get("train_loss"),
                num_nodes=int(info.get("num_nodes", 0)),
                num_failed=int(info.get("num_failed", 0)),
                wall_s=round(time.monotonic() - adapter.round_started, 3),
                train_s=None if info.get("train_s") is None else round(info["train_s"], 3),
            )
            state.rounds.append(record)
            save_merged(output, merged, {**meta, "rounds": server_round,
                                         "metrics": {"accuracy": record.accuracy,
                                                     "loss": record.loss}})
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(record.as_dict()) + "\n")
            if on_round:
                on_round(record)
            return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

        def lost(node: int) -> None:
            report_failure(adapter.current_round, node, "node disconnected during the round")

        adapter.start(
            grid=StreamingGrid(grid, on_lost=lost if deployment is not None else None),
            initial_arrays=ArrayRecord(initial),
            num_rounds=config.merge.rounds,
            timeout=config.merge.round_timeout,
            train_config=train_config,
            evaluate_fn=round_end,
        )
        if deployment is not None:
            _announce_end(grid)

    return app
