"""Flower ClientApp: a node receives the global model, trains it on its partition, replies.

Message contract (keys in :mod:`fedavg.node.keys`):

- in: ``arrays`` (ArrayRecord, the global state dict) and ``config`` (ConfigRecord with the
  model spec, the input normalisation and the training settings of the round);
- out: ``arrays`` (the locally trained state dict) and ``metrics`` (``num-examples``,
  ``train-loss``).

A node process keeps its data and model in memory between rounds (one load per process).
"""

from __future__ import annotations

import functools
import json
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import strategies
from fedavg.models.evaluation import resolve_device
from fedavg.models.registry import ModelSpec
from fedavg.node import compression, keys, lora_base
from fedavg.node.train import train
from fedavg.node.wire import TrainSettings


@functools.lru_cache(maxsize=2)
def load_node_data(source) -> dict[str, np.ndarray]:
    """Load a run's node data once per process.

    Parameters
    ----------
    source : str or ray.ObjectRef
        A prepared data file (:func:`fedavg.engines.simulation.simulate.write_node_data`),
        memory-mapped, or the same arrays in the object store of a Ray cluster
        (``--ray-address``), fetched once per machine and read without a copy.

    Returns
    -------
    dict
        ``x`` ``(N, ...)`` inputs, ``y`` ``(N,)`` labels, ``offsets`` ``(P + 1,)`` and
        ``indices`` (concatenated partition index arrays: partition ``i`` is
        ``indices[offsets[i]:offsets[i + 1]]``).
    """
    if not isinstance(source, str):
        import ray

        return ray.get(source)
    from safetensors.numpy import load_file

    return load_file(source)


def partition_arrays(source, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the inputs and labels of one partition of a run's node data (a file or ref)."""
    data = load_node_data(source)
    offsets = data["offsets"]
    if not 0 <= partition_id < len(offsets) - 1:
        raise ValueError(f"partition-id {partition_id} outside 0..{len(offsets) - 2}")
    idx = data["indices"][offsets[partition_id] : offsets[partition_id + 1]]
    return data["x"][idx], data["y"][idx]


@functools.lru_cache(maxsize=4)
def _model_for(spec_json: str) -> torch.nn.Module:
    return ModelSpec.from_dict(json.loads(spec_json)).build()


def reply_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return the state dict a node sends back: all but what only the coordinator changes.

    With ``--lora-merge exact`` the adapted weights ``W`` travel to the nodes, which train
    only the adapters beside them; the coordinator has them already, so they are not sent back.
    """
    state = model.state_dict()
    for key in getattr(model, "downlink_only", lambda: ())():
        state.pop(key, None)
    return state


def run_train(message: Message, x: np.ndarray, y: np.ndarray, device: str,
              partition_id: int, settings: TrainSettings | None = None,
              context: Context | None = None) -> Message:
    """Train the received model on ``(x, y)`` and build the reply message.

    Parameters
    ----------
    message : flwr.app.Message
        The round's ``train`` message: ``arrays`` (the global model) and ``config``
        (:class:`~fedavg.node.wire.TrainSettings`).
    x, y : numpy.ndarray
        ``(N, ...)`` raw inputs and ``(N,)`` int64 labels of this node.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    partition_id : int
        This node's partition (``-1``: its whole dataset); seeds its batch order.
    settings : TrainSettings, optional
        The message's settings when the caller decoded them already.
    context : flwr.app.Context, optional
        The node's Flower context: its ``state`` keeps the method's node state (SCAFFOLD,
        FedDyn, MOON) from one of the node's rounds to the next.

    Returns
    -------
    flwr.app.Message
        ``arrays`` (the trained state dict) and ``metrics`` (``num-examples``,
        ``train-loss``, ``partition-id``, ``train-seconds``), plus the records a method's
        node rule adds (:class:`strategies.NodeUpdate`).

    Raises
    ------
    strategies.MergeError
        The message lacks what the method's node rule needs (Flower replies with it).
    RuntimeError
        The model's code called ``sys.exit`` (Flower replies with it, as with any error of
        that code).
    """
    cfg = settings or TrainSettings.from_record(message.content[keys.CONFIG])
    try:
        model = _model_for(json.dumps(cfg.model, sort_keys=True))
        state, lora_round = lora_base.round_weights(model, message, context)
        # the round's weights quantised (--compress-down): decoded to the model's shapes
        state = compression.decode_weights(state, model.state_dict())
        model.load_state_dict(state, strict=True)
        # the update's base: for the codec, and for the clip of node-level DP on the node
        received = state if cfg.local.compress != "none" or cfg.dp_clip > 0 else None
        del state
        rule, state_round = _begin_rule(cfg, model, message, context)
        started = time.perf_counter()
        try:
            stats, update = _train_with(rule, model, x, y, cfg, device, partition_id)
        finally:
            if rule is not None:
                rule.close()
    except SystemExit as exc:  # in model code: it would end the node's process (a Ray actor)
        raise RuntimeError(f"the model's code called sys.exit({exc.code!r})") from None
    # node-level DP clipped here: every node weighs 1, its sample count stays on the node
    metrics = MetricRecord({keys.NUM_EXAMPLES: 1 if cfg.dp_clip > 0 else stats["num_examples"],
                            keys.TRAIN_LOSS: stats["train_loss"],
                            keys.PARTITION_ID: partition_id,
                            keys.TRAIN_SECONDS: time.perf_counter() - started,
                            **_dp_sgd_metrics(stats), **update.metrics})
    if rule is not None:
        metrics[keys.STATE_ROUND] = state_round
    if lora_round is not None:  # W unchanged by training: kept for the next round's update
        lora_base.keep(context, model.state_dict(), model, lora_round)
        metrics[keys.LORA_BASE_ROUND] = lora_round
    sent = encoded_reply(clipped_on_node(reply_state(model), received, cfg.dp_clip),
                         received if cfg.local.compress != "none" else None, cfg, context)
    reply = RecordDict({keys.ARRAYS: ArrayRecord(sent), keys.METRICS: metrics})
    for key, arrays in update.arrays.items():
        reply[key] = ArrayRecord(arrays)
    if update.state is not None and context is not None:
        keep_node_state(context, cfg.method, update.state, cfg.server_round)
    return Message(reply, reply_to=message)


def clipped_on_node(state: dict[str, torch.Tensor], received: dict[str, torch.Tensor] | None,
                    clip: float) -> dict[str, torch.Tensor]:
    """Return ``state`` with its update clipped to L2 ``clip`` (``--dp-clip-on node``).

    ``clip`` 0: ``state`` as it is. The update is ``state`` minus the weights the node
    received, over every floating tensor it sends (:func:`strategies.tensors.clip_update`).
    """
    if not clip > 0 or received is None:
        return state
    return strategies.clip_update(state, received, clip)[0]


def _dp_sgd_metrics(stats: dict) -> dict:
    """Return the reply's DP-SGD figures the coordinator accounts (none without DP-SGD)."""
    if "dp_sample_rate" not in stats:
        return {}
    return {keys.DP_SAMPLE_RATE: float(stats["dp_sample_rate"]),
            keys.DP_STEPS: int(stats["steps"])}


def encoded_reply(state: dict[str, torch.Tensor], received: dict[str, torch.Tensor] | None,
                  cfg: TrainSettings, context: Context | None) -> dict[str, torch.Tensor]:
    """Return the arrays a node sends: its weights, or with ``--compress`` its update encoded.

    With error feedback the node's ``Context.state`` keeps what the codec left out
    (:data:`~fedavg.node.keys.COMPRESS_RESIDUAL`) and adds it to the next round's update.
    """
    if received is None:
        return state
    local = cfg.local
    feedback = local.error_feedback and context is not None
    residual = None
    if feedback and keys.COMPRESS_RESIDUAL in context.state.array_records:
        residual = context.state.array_records[keys.COMPRESS_RESIDUAL].to_torch_state_dict()
    sent, left = compression.compress_update(state, received, local.compress,
                                             local.topk_fraction, residual)
    if feedback:
        context.state[keys.COMPRESS_RESIDUAL] = ArrayRecord(left)
    return sent


def _begin_rule(cfg: TrainSettings, model: torch.nn.Module, message: Message,
                context: Context | None):
    """Return the round's node rule, begun, and the round of the node state it got.

    ``(None, 0)`` for methods without a rule; the round is 0 when the node has no state yet.
    """
    if not cfg.method:
        return None, 0

    rule = strategies.node_rule(cfg.method, cfg.method_options, cfg.local.momentum)
    if rule is None:
        return None, 0
    received = {k: rec.to_torch_state_dict() for k, rec in
                message.content.array_records.items() if k != keys.ARRAYS}
    records = None if context is None else context.state
    state = node_state(records, cfg.method)
    rule.begin(model, received, state)
    return rule, 0 if state is None else int(records.config_records[keys.NODE_STATE_INFO]["round"])


def _train_with(rule, model, x, y, cfg: TrainSettings, device: str, partition_id: int):
    """Train one round; return the stats and the rule's update (empty without a rule)."""
    stats = train(
        model, x, y, cfg.input, cfg.local,
        server_round=cfg.server_round,
        device=resolve_device(device),
        # distinct, reproducible batch order per node and round
        seed=cfg.seed * 1_000_003 + partition_id * 1009 + cfg.server_round,
        proximal_mu=cfg.proximal_mu,
        rule=rule,
        dp_noise=cfg.dp_noise,
    )
    return stats, (strategies.NodeUpdate() if rule is None else rule.finish(model))


def node_state(records: RecordDict | None, method: str) -> dict[str, torch.Tensor] | None:
    """Return the state ``method``'s node rule kept in a node's ``Context.state``.

    ``None`` when there is none yet, or it was kept by another method.
    """
    if records is None:
        return None
    info = records.config_records.get(keys.NODE_STATE_INFO)
    if info is None or info.get("strategy") != method \
            or keys.NODE_STATE not in records.array_records:
        return None
    return records.array_records[keys.NODE_STATE].to_torch_state_dict()


def node_state_records(method: str, state: dict[str, torch.Tensor],
                       server_round: int) -> dict[str, ArrayRecord | ConfigRecord]:
    """Return the ``Context.state`` records that keep a node rule's ``state``."""
    return {keys.NODE_STATE: ArrayRecord(state),
            keys.NODE_STATE_INFO: ConfigRecord({"strategy": method, "round": int(server_round)})}


#: In a saved node state (a checkpoint's ``node.<partition>.*``), the prefix of what
#: ``--compress`` left out (error feedback); the rest is the method's node state.
RESIDUAL = "residual/"


def saved_node_state(records: RecordDict | None, method: str) -> dict[str, torch.Tensor] | None:
    """Return what a node keeps between its rounds as one state dict (``None``: nothing).

    Its method's node state (``method``: empty for none) and, under :data:`RESIDUAL`, its
    error-feedback leftover: what a checkpoint saves per node, so that ``--resume`` goes on
    with both (:func:`node_records` is the inverse).
    """
    out = dict(node_state(records, method) or {}) if method else {}
    if records is not None and keys.COMPRESS_RESIDUAL in records.array_records:
        left = records.array_records[keys.COMPRESS_RESIDUAL].to_torch_state_dict()
        out.update({RESIDUAL + k: v for k, v in left.items()})
    return out or None


def node_records(method: str, saved: dict[str, torch.Tensor], server_round: int
                 ) -> dict[str, ArrayRecord | ConfigRecord]:
    """Return the ``Context.state`` records of a state :func:`saved_node_state` returned."""
    rule = {k: v for k, v in saved.items() if not k.startswith(RESIDUAL)}
    left = {k[len(RESIDUAL):]: v for k, v in saved.items() if k.startswith(RESIDUAL)}
    records = node_state_records(method, rule, server_round) if rule else {}
    if left:
        records[keys.COMPRESS_RESIDUAL] = ArrayRecord(left)
    return records


def keep_node_state(context: Context, method: str, state: dict[str, torch.Tensor],
                    server_round: int) -> None:
    """Keep a node rule's ``state`` in ``context.state`` until the node's next round."""
    for key, record in node_state_records(method, state, server_round).items():
        context.state[key] = record


def warm_up() -> None:
    """Import, in a node process that is starting, what its first round would import.

    Run by each simulated node's actor as it starts
    (:mod:`fedavg.engines.simulation.ray_start`), while the coordinator still sets up: this module
    (torch, unpickling this function imported it) and ``torch._dynamo``, which every optimizer step
    imports (about 2 s of one core).
    """
    import torch._dynamo  # noqa: F401


def make_client_app(data_path, device: str = "auto") -> ClientApp:
    """Build the node ClientApp for a run's node data.

    Parameters
    ----------
    data_path : str or ray.ObjectRef
        File written by :func:`fedavg.engines.simulation.simulate.write_node_data`, or its
        arrays in a Ray cluster's object store (see :func:`load_node_data`); each node trains on the
        partition named by its ``partition-id`` node config.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """
    from fedavg.node.secure import node_mod

    app = ClientApp(mods=[node_mod(require=False)])  # SecAgg+ rounds, when the run asks

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        pid = int(context.node_config[keys.PARTITION_ID])
        x, y = partition_arrays(data_path, pid)
        return run_train(message, x, y, device, pid, context=context)

    return app
