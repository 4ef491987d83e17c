"""The thin adapter between Flower's strategy loop and our Flower-free merges.

Flower's own FedAvg samples nodes and sends messages; :class:`FlowerAdapter` replaces only
its aggregation: each reply is checked, turned into ``(state_dict, num_examples)`` and folded
into a registered ``strategies`` merge, one at a time. A round whose node models together
take at most :data:`ORDERED_FOLD_BYTES` is held and folded in partition order, so that a
seeded run saves the same bytes whichever node answers first (floating-point sums depend on
their order). A larger round is folded as its replies arrive (:class:`StreamingGrid` hands
them over one by one), so the coordinator holds one node model at a time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

import strategies
from fedavg.flower_compat import error_summary
from fedavg.node import compression, keys
from fedavg.run import privacy
from fedavg.run.secure import SecureRound
from fedavg.util.errors import RunError
from strategies import lora as lora_math

#: The most bytes of node models a round holds to fold them in partition order (1 GiB);
#: above it replies are folded as they arrive, in O(model) memory.
ORDERED_FOLD_BYTES = 1 << 30


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
    on_lost : callable, optional
        Called with a node id when a node that owes a reply is no longer connected; the
        round stops waiting for it. ``None``: wait until the round's timeout.
    node_check_s : float
        Seconds between checks of the connected nodes.
    stop : threading.Event, optional
        Set when the engine is gone (Ctrl-C in the Python API): waiting for replies then
        ends with a :class:`~fedavg.util.errors.RunError`, so that the ServerApp's thread ends.
    """

    def __init__(self, grid: Grid, poll_s: float = 0.05,
                 on_lost: Callable[[int], None] | None = None,
                 node_check_s: float = 1.0, stop: threading.Event | None = None) -> None:
        self._grid = grid
        self.stop = stop
        self.poll_s = poll_s
        self.on_lost = on_lost
        self.node_check_s = node_check_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def get_node_ids(self) -> list[int]:
        """Return the connected node ids, sorted (Flower's grids return a set)."""
        return sorted(self._grid.get_node_ids())

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push now; return a generator of the replies, pulled while it is consumed."""
        messages = list(messages)
        ids = list(self._grid.push_messages(messages))
        destination = {mid: msg.metadata.dst_node_id for mid, msg in zip(ids, messages)}
        del messages
        deadline = None if timeout is None else time.monotonic() + timeout
        lost: set[str] = set()
        return _Replies(self._replies(set(ids), destination, deadline, lost), destination,
                        lost, timeout)

    def _replies(self, pending: set[str], destination: dict[str, int],
                 deadline: float | None, lost: set[str]) -> Iterable[Message]:
        checked = time.monotonic()
        while pending and (deadline is None or time.monotonic() < deadline):
            if self.stop is not None and self.stop.is_set():
                raise RunError("the run was stopped: no more replies are awaited")
            got = list(self._grid.pull_messages(pending))
            for msg in got:
                pending.discard(msg.metadata.reply_to_message_id)
            while got:
                yield got.pop(0)  # hand over one at a time, keeping no reference
            if pending and self.on_lost is not None \
                    and time.monotonic() - checked >= self.node_check_s:
                checked = time.monotonic()
                self._drop_lost(pending, destination, lost)
            if pending:
                time.sleep(self.poll_s)

    def _drop_lost(self, pending: set[str], destination: dict[str, int],
                   lost: set[str]) -> None:
        online = set(self._grid.get_node_ids())
        for mid in [m for m in pending if destination.get(m) not in online]:
            pending.discard(mid)  # the node left: stop waiting for it
            lost.add(mid)
            self.on_lost(destination[mid])


class _Replies:
    """The replies of a round (consumed once) and what the merge needs to know about them.

    ``destination`` maps each message id to its node, ``lost`` holds the messages whose node
    left (already reported) and ``timeout`` is the round's limit in seconds.
    """

    def __init__(self, replies: Iterable[Message], destination: dict[str, int],
                 lost: set[str] | None = None, timeout: float | None = None) -> None:
        self._replies = replies
        self.destination = destination
        self.lost = set() if lost is None else lost
        self.timeout = timeout

    def __iter__(self):
        return iter(self._replies)


def parse_reply(msg: Message) -> tuple[dict[str, torch.Tensor], float, MetricRecord]:
    """Return a node's train reply as ``(state_dict, num_examples, metrics)``.

    Raises
    ------
    fedavg.util.errors.RunError
        The reply is an error, or lacks its ``arrays`` record or ``num-examples`` metric.
    ValueError, TypeError
        Arrays that do not convert to tensors.
    """
    if msg.has_error():
        raise RunError(error_summary(msg.error.reason))
    content = msg.content
    if keys.ARRAYS not in content.array_records:
        raise RunError(f"reply has no {keys.ARRAYS!r} record")
    metrics = content.metric_records.get(keys.METRICS)
    if metrics is None or keys.NUM_EXAMPLES not in metrics:
        raise RunError(f"reply has no {keys.NUM_EXAMPLES!r} metric")
    state = content.array_records[keys.ARRAYS].to_torch_state_dict(keep_input=False)
    return state, metrics[keys.NUM_EXAMPLES], metrics


def record_bytes(records: Iterable[ArrayRecord]) -> int:
    """Return the bytes of the serialised arrays in ``records``.

    Each :class:`flwr.app.Array` holds its tensor serialised (the NumPy ``.npy`` format:
    a header of about 128 bytes, then the values); this is the sum of their lengths.
    """
    return sum(len(array.data) for record in records for array in record.values())


def message_bytes(msg: Message) -> int:
    """Return the bytes of the serialised arrays ``msg`` carries (0 for an error reply)."""
    return 0 if msg.has_error() else record_bytes(msg.content.array_records.values())


class _OverNorm(RunError):
    """A node's update farther from the round's model than ``--max-update-norm``."""


class _RoundTally:
    """Counts, losses and timings of the replies folded into one round."""

    def __init__(self) -> None:
        self.used = self.failed = 0
        self.loss_sum = self.weight_sum = 0.0
        self.train_s: float | None = None
        self.reasons: list[tuple[int, str]] = []  # (node, why it was left out)
        self.over_norm = 0  # replies refused by --max-update-norm
        self.bytes_to_nodes = self.bytes_from_nodes = 0  # serialised arrays, both ways
        self.epsilon: float | None = None  # DP: the run's epsilon after the round
        self.dp_steps: dict[str, list] | None = None  # DP-SGD: each node's [q, steps]

    def detail(self, most: int = 3) -> str:
        """Return the failures in one line; nodes with the same reason share it."""
        nodes: dict[str, list[int]] = {}
        for node, reason in self.reasons:
            nodes.setdefault(reason, []).append(node)
        groups = list(nodes.items())
        parts = [f"node {ids[0]}: {why}" if len(ids) == 1 else f"{len(ids)} nodes: {why}"
                 for why, ids in groups[:most]]
        if rest := sum(len(ids) for _, ids in groups[most:]):
            parts.append(f"and {rest} more node{'s' if rest > 1 else ''}")
        return "; ".join(parts) or "no replies before --round-timeout"

    def add(self, weight: float, metrics: MetricRecord) -> None:
        self.used += 1
        self.weight_sum += float(weight)
        if keys.TRAIN_LOSS in metrics:
            self.loss_sum += float(metrics[keys.TRAIN_LOSS]) * float(weight)
        if keys.TRAIN_SECONDS in metrics:
            self.train_s = max(self.train_s or 0.0, float(metrics[keys.TRAIN_SECONDS]))

    def summary(self) -> dict[str, Any]:
        loss = self.loss_sum / self.weight_sum if self.weight_sum else float("nan")
        return {"train_loss": loss, "num_nodes": self.used, "num_failed": self.failed,
                "train_s": self.train_s, "bytes_to_nodes": self.bytes_to_nodes,
                "bytes_from_nodes": self.bytes_from_nodes, "epsilon": self.epsilon,
                "dp_steps": self.dp_steps}


def _fold_order(msg: Message) -> tuple[int, int]:
    """Sort key of a reply: its partition id (error replies last), then its node id."""
    partition = -1
    if not msg.has_error():
        metrics = msg.content.metric_records.get(keys.METRICS)
        value = None if metrics is None else metrics.get(keys.PARTITION_ID)
        partition = value if isinstance(value, int) and not isinstance(value, bool) else -1
    return (partition if partition >= 0 else 1 << 62, int(msg.metadata.src_node_id))


class FlowerAdapter(FlowerFedAvg):
    """Flower's FedAvg for sampling and messaging, with aggregation by a ``strategies`` method.

    Replies with an error, or whose content is malformed (missing arrays or ``num-examples``,
    mismatched keys, shapes or dtypes, NaN), are reported through ``on_failure`` with the
    node id and left out of the merge; the others are merged.

    Parameters
    ----------
    merge : strategies.Strategy
        The run's merge.
    reference : dict of str to torch.Tensor
        The initial global model.
    on_failure : callable
        ``(round, node, reason)`` for each reply left out.
    buffers : frozenset of str
        State-dict keys that are buffers (BatchNorm statistics).
    context : strategies.MergeContext, optional
        Data and model access for data-driven merges.
    on_node_model : callable, optional
        ``(round, state_dict, info, extras)`` for each usable node model, before it is
        dropped; ``extras`` are the reply records the strategy merges with
        (``Strategy.saved_extras``).
    before_round : callable, optional
        Called with the round number before its nodes are sampled (e.g. wait for nodes).
    min_replies : int
        Usable replies a round needs.
    max_update_norm : float, optional
        Leave out a reply whose L2 distance from the round's starting model is larger.
    round_offset : int
        Rounds already done (a resumed run): Flower's round ``r`` is the run's round
        ``r + round_offset``, which the nodes are sent and every callback is given.
    exact_lora : mapping of str to float, optional
        LoRA layer prefix -> scaling, for ``--lora-merge exact``: each reply's adapters are
        folded into its adapted weights before the merge and set back to the round's
        (``B = 0``), so every round's adapters start afresh (:mod:`strategies.lora`).
    lora_transport : fedavg.run.lora_transport.LoraTransport, optional
        With ``exact_lora``: sends each node the adapted weights as the low-rank updates it
        lacks instead of whole.
    **kwargs
        Flower ``FedAvg`` arguments (fractions, minimum node counts).

    Raises
    ------
    fedavg.util.errors.RunError
        From ``aggregate_train`` when a round has fewer than ``min_replies`` usable replies.
    """

    def __init__(self, merge: strategies.Strategy, reference: dict[str, torch.Tensor],
                 on_failure: Callable[[int, int, str], None], *,
                 buffers: frozenset[str] = frozenset(),
                 context: strategies.MergeContext | None = None,
                 on_node_model: Callable[[int, dict, dict, dict], None] | None = None,
                 before_round: Callable[[int], None] | None = None,
                 min_replies: int = 1,
                 max_update_norm: float | None = None,
                 round_offset: int = 0,
                 exact_lora: dict[str, float] | None = None,
                 lora_transport=None,
                 compress_down: str = "none",
                 dp=None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.merge, self.reference, self.buffers, self.context = merge, reference, buffers, context
        self.on_failure, self.on_node_model = on_failure, on_node_model
        self.before_round, self.min_replies = before_round, min_replies
        self.max_update_norm, self.round_offset = max_update_norm, round_offset
        self.exact_lora, self.lora_transport = exact_lora, lora_transport
        self.compress_down = compress_down
        self.dp = dp  # fedavg.run.privacy's NodeLevelDP or RecordLevelDP, or None
        self.down_lost: dict[str, torch.Tensor] = {}  # what the round's downlink lost
        self.current_round = 0
        self.last_train: dict[str, Any] = {}
        self.last_merged: strategies.Merged | None = None
        self.round_started = time.monotonic()
        self.bytes_to_nodes = 0  # of the round's messages, counted as they are built

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample nodes and build their messages; start the round's clock."""
        server_round += self.round_offset
        if self.before_round is not None:
            self.before_round(server_round)
        self.current_round = server_round
        self.round_started = time.monotonic()
        self.reference = arrays.to_torch_state_dict()  # the round's starting point
        if self.context is not None:  # all nodes of the run, for SCAFFOLD's and FedDyn's N
            self.context.num_nodes = len(list(grid.get_node_ids()))
        messages = list(super().configure_train(server_round, arrays, config, grid))
        extras = {k: ArrayRecord(v) for k, v in
                  self.merge.to_nodes(self.reference, self.buffers).items()}
        for msg in messages:  # one record object shared by every message of the round
            for key, record in extras.items():
                msg.content[key] = record
        if self.lora_transport is not None:
            self.lora_transport.outgoing(messages, arrays)
        elif self.compress_down != "none":  # the round's weights quantised, one shared record
            sent, self.down_lost = compression.compress_weights(self.reference,
                                                                self.compress_down)
            record = ArrayRecord(sent)
            for msg in messages:
                msg.content[keys.ARRAYS] = record
        self.bytes_to_nodes = sum(message_bytes(msg) for msg in messages)
        if self.dp is not None:
            self.dp.begin_round(len(messages))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Merge usable replies one at a time; report the others."""
        server_round += self.round_offset
        if isinstance(replies, SecureRound):
            return self._aggregate_secure(server_round, replies)
        self.merge.begin(self.reference, self.buffers, self.context)
        tally = _RoundTally()
        tally.bytes_to_nodes = self.bytes_to_nodes
        sent_to = getattr(replies, "destination", None) or {}
        answered: set[str] = set()
        ordered = sorted(replies, key=_fold_order) if self._hold_round(replies) else replies
        for msg in ordered:
            # an error reply made by the SuperLink (node gone) names the SuperLink as source
            answered.add(msg.metadata.reply_to_message_id)
            node = sent_to.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            self._fold(server_round, node, msg, tally)
        self._tally_silent(server_round, replies, answered, tally)
        merged = self._finish_round(server_round, tally)
        self.last_merged = merged
        self.last_train = tally.summary()
        metrics_out = MetricRecord({"train-loss": self.last_train["train_loss"],
                                    "num-nodes": tally.used})
        return ArrayRecord(merged.state_dict), metrics_out

    def _aggregate_secure(self, server_round: int, replies: SecureRound):
        """Merge a SecAgg+ round: its weighted mean update, as one reply of all its samples.

        The nodes in the sum count as the round's nodes; those sampled but not in it (an
        error, or no reply at some stage of the protocol) are reported as left out.
        """
        result = replies.result
        self.merge.begin(self.reference, self.buffers, self.context)
        tally = _RoundTally()
        tally.bytes_to_nodes = self.bytes_to_nodes
        tally.bytes_from_nodes = result.bytes_from_nodes
        summed = {node for node, _, _ in result.nodes}
        for node in result.sampled:
            if node not in summed:
                if node in result.errors:
                    reason = error_summary(result.errors[node])
                elif node in replies.lost:
                    reason = "node disconnected during the round"
                else:
                    reason = "dropped out of secure aggregation (no reply at one of its stages)"
                tally.failed += 1
                tally.reasons.append((node, reason))
                self.on_failure(server_round, node, reason)
        if result.mean is None or not result.nodes:
            raise RunError(f"round {server_round}: secure aggregation halted, too few nodes "
                           f"stayed for its --secagg-reconstruction-threshold "
                           f"({tally.detail()})")
        total = float(sum(weight for _, weight, _ in result.nodes))
        state = replies.merged_state(self.reference)
        if isinstance(self.dp, privacy.NodeLevelDP):  # clipped on the nodes: noise on the mean
            state, total = self.dp.noised_mean(state, len(result.nodes))
            self.dp.folded()
        elif self.dp is not None:  # record level: each node's DP-SGD steps
            self._account_secure(server_round, result.nodes)
        try:
            self.merge.add_reply(state, total, node="secure-aggregate")
        except strategies.MergeError as exc:
            raise RunError(f"round {server_round}: {exc}") from None
        for _, weight, metrics in result.nodes:
            tally.add(weight, metrics)
        merged = dataclasses.replace(self._finish_round(server_round, tally),
                                     num_models=len(result.nodes))
        self.last_merged = merged
        self.last_train = tally.summary()
        return ArrayRecord(merged.state_dict), MetricRecord(
            {"train-loss": self.last_train["train_loss"], "num-nodes": tally.used})

    def _account_secure(self, server_round: int, nodes: list) -> None:
        """Account the DP-SGD steps each node of a secure sum reported beside it (in clear).

        Raises
        ------
        RunError
            A node in the sum reported none: its update cannot be left out of it.
        """
        for node, weight, metrics in nodes:
            partition = metrics.get(keys.PARTITION_ID, -1)
            name = str(partition) if isinstance(partition, int) and partition >= 0 \
                else f"node {node}"
            try:
                self.dp.private({}, {}, weight, name, metrics)
            except ValueError as exc:
                raise RunError(f"round {server_round}: {exc}; its update is in the secure "
                               "sum, so the round cannot be accounted") from None
            self.dp.folded()

    def _hold_round(self, replies: Iterable[Message]) -> bool:
        """Whether to fold this round's replies in partition order (see the module notes)."""
        if getattr(self.merge, "ordered", False) or isinstance(replies, (list, tuple)):
            return True  # SCAFFOLD's variates amplify rounding; a list is held already
        sent = len(getattr(replies, "destination", None) or {})
        model_bytes = sum(t.numel() * t.element_size() for t in self.reference.values())
        return 0 < sent and sent * model_bytes <= ORDERED_FOLD_BYTES

    def _fold(self, server_round: int, node: int, msg: Message, tally: _RoundTally) -> None:
        partition = -1
        tally.bytes_from_nodes += message_bytes(msg)  # received, whether usable or not
        try:
            state, weight, metrics = parse_reply(msg)
            partition = int(metrics.get(keys.PARTITION_ID, -1))
            # trained from the quantised weights (--compress-down): onto the exact ones
            state = compression.rebase(state, self.down_lost)
            # a compressed update (--compress): the round's weights plus it, decoded
            state = compression.decode_reply(state, self.reference)
            if self.exact_lora:  # node k's model is W + s B_k A_k: merges see the products
                state = lora_math.fold_reply(state, self.reference, self.exact_lora)
            self._check_norm(state, node)
            extras = {k: rec.to_torch_state_dict() for k, rec in
                      msg.content.array_records.items() if k != keys.ARRAYS}
            taken, taken_weight = state, weight
            if self.dp is not None:  # node level: clipped, weight 1, the round's noise on
                # the first; record level: the reply's DP-SGD steps read
                strategies.check_compatible(self.reference, state, str(node))
                taken, taken_weight = self.dp.private(
                    state, self.reference, weight,
                    str(partition) if partition >= 0 else f"node {node}", metrics)
            self.merge.add_reply(taken, taken_weight, node=str(node), arrays=extras,
                                 metrics=dict(metrics))
            if self.dp is not None:
                self.dp.folded()
            del taken
            if self.lora_transport is not None:
                self.lora_transport.replied(node, metrics.get(keys.LORA_BASE_ROUND))
            if self.on_node_model is not None:
                self.on_node_model(server_round, state, {
                    "node_id": node, "num_examples": weight,
                    "partition_id": int(metrics.get(keys.PARTITION_ID, -1)),
                    "train_loss": float(metrics.get(keys.TRAIN_LOSS, float("nan"))),
                    **({"state_round": int(metrics[keys.STATE_ROUND])}
                       if keys.STATE_ROUND in metrics else {})},
                    {k: extras[k] for k in self.merge.saved_extras if k in extras})
            del state
        except (RunError, strategies.MergeError, ValueError, TypeError) as exc:
            if self.lora_transport is not None:
                self.lora_transport.replied(node, None)  # its W unknown: whole next time
            tally.failed += 1
            tally.over_norm += isinstance(exc, _OverNorm)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if partition >= 0:  # Flower's node ids mean little to a user; partitions do
                reason = f"(partition {partition}) {reason}"
            tally.reasons.append((node, reason))
            self.on_failure(server_round, node, reason)
            return
        tally.add(weight, metrics)

    def _tally_silent(self, server_round: int, replies: Any, answered: set[str],
                      tally: _RoundTally) -> None:
        """Count the nodes that neither replied nor left before the round's timeout."""
        sent_to = getattr(replies, "destination", None) or {}
        lost = getattr(replies, "lost", set())
        timeout = getattr(replies, "timeout", None)
        limit = f"{timeout:g} s" if timeout is not None else "the round's time"
        for mid, node in sent_to.items():
            if mid in answered or mid in lost:
                continue
            tally.failed += 1
            reason = (f"no reply within --round-timeout {limit}, model left out (raise "
                      "--round-timeout for long local training)")
            tally.reasons.append((node, reason))
            self.on_failure(server_round, node, reason)

    def _check_norm(self, state: dict[str, torch.Tensor], node: int) -> None:
        if self.max_update_norm is None:
            return
        strategies.check_compatible(self.reference, state, str(node))
        norm = strategies.update_norm(self.reference, state)
        if norm > self.max_update_norm:
            raise _OverNorm(f"update norm {norm:.4g} exceeds --max-update-norm "
                            f"{self.max_update_norm:g}")

    def _finish_round(self, server_round: int, tally: _RoundTally) -> strategies.Merged:
        # refused by the norm check, the same models would be refused again on resume
        drop = ("--max-update-norm",) if tally.over_norm else ()
        if not tally.used:
            stepped = server_round > 1 and self.merge.steps_from_start and any(
                "diverged" in reason for _, reason in tally.reasons)
            hint = (f"; the nodes started from the model {self.merge.name} stepped to, so "
                    "lower --server-lr too") if stepped else ""
            if self.dp is not None and server_round > 1 and any(
                    "diverged" in reason for _, reason in tally.reasons):
                hint += (f"; with node-level DP the noise on the merged model has std "
                         f"{self.dp.noise_std(self.dp.round_sample):.3g} per entry (--dp-noise "
                         "x --dp-clip / nodes per round): lower --dp-clip, or use more nodes")
            raise RunError(f"round {server_round}: no usable model from any node "
                           f"({tally.detail()}){hint}", resume_without=drop)
        if tally.used < self.min_replies:
            raise RunError(f"round {server_round}: only {tally.used} usable model(s), fewer "
                           f"than --min-nodes-per-round {self.min_replies}",
                           resume_without=drop)
        if self.dp is not None:  # the sampled nodes that sent nothing count as zero updates
            self.dp.fill(self.merge, self.reference, tally.used)
        try:
            merged = self.merge.result()
        except strategies.MergeError as exc:
            raise RunError(f"round {server_round}: {exc}") from None
        if self.dp is not None:
            tally.epsilon = self.dp.release()
            tally.dp_steps = self.dp.round_steps
        if self.lora_transport is not None and not merged.is_ensemble:
            merged = dataclasses.replace(merged, state_dict=self.lora_transport.merged(
                merged.state_dict, self.reference, tally.used))
        for member in merged.members if merged.is_ensemble else [merged.state_dict]:
            bad = strategies.first_non_finite(member)
            if bad is not None:
                own = [o.flag for o in self.merge.options if o.type is float]
                check = f" or check {', '.join(own)}" if own else ""
                raise RunError(f"round {server_round}: the merged model's {bad!r} has NaN or "
                               f"infinite values ({self.merge.name}); lower --lr{check}, or "
                               "set --max-update-norm")
        return merged
