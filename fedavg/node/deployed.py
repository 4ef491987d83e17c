"""The ClientApp that ``fedavg node`` runs on Flower's deployment engine.

It is also the ``clientapp`` component of the FAB that ``fedavg coordinator`` submits, so a
plain ``flower-supernode`` (default isolation) can run it too, one process per message.

Node config (``flower-supernode --node-config`` or ``fedavg node`` options):

- ``dataset``: where the node's data is (``digits``, a local path, a hub id);
- ``partition-id`` and ``num-partitions`` (optional): train on that partition of the dataset,
  split exactly as ``fedavg simulate`` would with the run's partitioner and seed; without
  them the node trains on the whole train split of its own data;
- ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``;
- ``model`` (optional): the model code this node may run (``fedavg node --model SPEC``).
  A node never imports code named over the network: a run whose model is user code
  (``module:function``, ``file.py:function``) fails on a node started without the same
  ``--model``; ``torchvision:``, ``hf:`` and registered models need no such opt-in.

Everything else (model, strategy, local epochs, partitioner ...) comes from the coordinator,
in the run config and in each round's message.
"""

from __future__ import annotations

import functools
import json

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedavg.config.settings import RunConfig
from fedavg.data.load import Split, check_kind, conform, load
from fedavg.data.shares import share_out
from fedavg.node import keys
from fedavg.node.secure import node_mod
from fedavg.node.wire import TrainSettings
from fedavg.util.errors import UserError

#: Run ids the coordinator has announced as finished (``fedavg node --once`` exits on one).
FINISHED_RUNS: set[int] = set()
#: Run ids the coordinator has announced as failed, with the one-line reason.
FAILED_RUNS: dict[int, str] = {}

#: With Flower's ``secaggplus_mod`` for SecAgg+ rounds (:mod:`fedavg.node.secure`).
client_app = ClientApp(mods=[node_mod()])


def _node_setting(context: Context, key: str, default=None):
    value = context.node_config.get(key, default)
    return default if value in (None, "") else value


@functools.lru_cache(maxsize=2)
def node_arrays(dataset: str, partition_id: int, num_partitions: int,
                run_config_json: str) -> tuple[np.ndarray, np.ndarray, list[str], object]:
    """Load a node's training data once per process and run.

    Parameters
    ----------
    dataset : str
        The node's data.
    partition_id, num_partitions : int
        ``-1, 0`` for the whole train split; else partition ``partition_id`` of
        ``num_partitions``, made as ``fedavg simulate`` does with the run's settings.
    run_config_json : str
        The run's flat config (JSON), for the partitioner, seed and columns.

    Returns
    -------
    tuple
        ``x`` ``(N, ...)``, ``y`` ``(N,)`` int64 labels, the class names ``y`` indexes,
        and the :class:`~fedavg.data.load.LoadedData` they come from (its kind and tokenizer).

    Raises
    ------
    UserError
        Bad dataset, columns, or a partition id outside ``0..num_partitions-1``.
    """
    flat = json.loads(run_config_json)
    config = RunConfig.from_flat(flat).replace(dataset=dataset)
    d = config.data
    if partition_id >= 0:
        if not 0 <= partition_id < num_partitions:
            raise UserError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
        config = config.replace(num_nodes=num_partitions)
        try:  # split exactly as the coordinator's run does
            data = load(d.dataset, **config.data_settings())
            parts, _, _ = share_out(config, config.build_strategy(), data)
        except UserError as exc:  # say it in the node's terms
            raise UserError(str(exc).replace("--num-nodes", "--num-partitions")) from None
        idx = parts[partition_id]
        return data.train.x[idx], data.train.y[idx].astype(np.int64), list(data.classes), data
    data = load(dataset, **{**config.data_settings(), "partition_by": None})
    return data.train.x, data.train.y.astype(np.int64), list(data.classes), data


@functools.lru_cache(maxsize=2)
def _conformed(dataset: str, partition_id: int, num_partitions: int, run_config_json: str,
               input_json: str, classes: tuple[str, ...]):
    """Return the node's data, checked against the model's inputs and relabelled.

    Labels follow the run's ``classes``; done once per run, not every round.
    """
    x, y, own_classes, data = node_arrays(dataset, partition_id, num_partitions,
                                          run_config_json)
    spec = json.loads(input_json)
    check_kind(spec, data, f"node data {dataset}")
    return conform(Split(x, y), f"node data {dataset}", spec["shape"], own_classes,
                   list(classes))


@client_app.train()
def _train(message: Message, context: Context) -> Message:
    from fedavg.node.clientapp import run_train  # lazy: loads torch, which only this path needs

    dataset = str(_node_setting(context, "dataset", "digits"))
    pid = int(_node_setting(context, keys.PARTITION_ID, -1))
    nparts = int(_node_setting(context, keys.NUM_PARTITIONS, 0))
    device = str(_node_setting(context, "device", "auto"))
    run_cfg = json.dumps(dict(context.run_config), sort_keys=True)
    settings = TrainSettings.from_record(message.content[keys.CONFIG])
    settings = _own_model(settings, _node_setting(context, "model"))
    split = _conformed(dataset, pid, nparts, run_cfg, json.dumps(settings.input, sort_keys=True),
                       tuple(settings.classes))
    return run_train(message, split.x, split.y, device, pid, settings, context)


def _own_model(settings, allowed):
    """Return ``settings`` naming the model code this node runs (its operator's own copy).

    Raises
    ------
    UserError
        The run's model is user code this node was not started with (``--model``).
    """
    import dataclasses

    # lazy: loads torch, which only this path needs
    from fedavg.models.sources import node_model_name

    name = node_model_name(str(settings.model["name"]), None if allowed is None else str(allowed))
    if name == settings.model["name"]:
        return settings
    return dataclasses.replace(settings, model={**settings.model, "name": name})


@client_app.query()
def _query(message: Message, context: Context) -> Message:
    cfg = message.content.config_records.get(keys.CONFIG, ConfigRecord())
    if cfg.get(keys.RUN_FAILED):
        FAILED_RUNS[message.metadata.run_id] = str(cfg[keys.RUN_FAILED])
    elif cfg.get(keys.RUN_FINISHED):
        FINISHED_RUNS.add(message.metadata.run_id)
    return Message(RecordDict(), reply_to=message)


def _not_here(*_args, **_kwargs) -> None:
    raise RuntimeError("this run's ServerApp runs inside `fedavg coordinator`; "
                       "start runs with that command")


#: The FAB's ``serverapp`` component. ``fedavg coordinator`` runs the ServerApp itself.
server_app = _not_here
