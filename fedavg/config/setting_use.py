"""Which settings shape a run: a partition setting only with a partitioner that takes it.

``--alpha`` means something only with ``--partitioner dirichlet``; a run notes such settings
when they are given and not used (:func:`unused_setting_notes`), ``fedavg report`` leaves
them out of its shared settings (:func:`setting_applies`), and ``fedavg sweep`` names the
points that would train exactly as another one (:func:`fedavg.sweeps.grid.repeated_runs`).
"""

from __future__ import annotations

import dataclasses

from fedavg.config.checks import node_value
from fedavg.data.partition import get_partitioner, partitioner_names

#: Config settings that feed a partitioner parameter (``partition_by`` gives ``groups``).
SETTING_PARAMS = {"alpha": "alpha", "classes_per_node": "classes_per_node",
                  "partition_by": "groups"}


def setting_applies(setting: str, partitioner: str | None) -> bool:
    """Whether config ``setting`` (snake case) shapes ``partitioner``'s partitions.

    Only the settings of :data:`SETTING_PARAMS` depend on the partitioner; any other
    setting, or an unknown partitioner, gives ``True``.
    """
    param = SETTING_PARAMS.get(setting)
    if param is None or partitioner not in partitioner_names():
        return True
    return param in get_partitioner(partitioner).params


def unused_setting_notes(data_config) -> list[str]:
    """Say which partition settings, given other than their default, the partitioner ignores.

    ``data_config`` is a :class:`fedavg.config.settings.DataConfig`.
    """
    notes, default = [], type(data_config)()
    for setting, param in SETTING_PARAMS.items():
        value = getattr(data_config, setting)
        if value != getattr(default, setting) and \
                not setting_applies(setting, data_config.partitioner):
            users = [n for n in partitioner_names() if param in get_partitioner(n).params]
            notes.append(f"--{setting.replace('_', '-')} {value} does nothing with "
                         f"--partitioner {data_config.partitioner} (it is for --partitioner "
                         f"{' or '.join(users)})")
    return notes


#: Model and node settings that only act with another: ``(applies(train), what it needs)``.
NEEDS = {
    "lora_alpha": (lambda t: t.lora_rank > 0, "--lora-rank R (LoRA adapters)"),
    "lora_dropout": (lambda t: t.lora_rank > 0, "--lora-rank R (LoRA adapters)"),
    "lora_targets": (lambda t: t.lora_rank > 0, "--lora-rank R (LoRA adapters)"),
    "lora_merge": (lambda t: t.lora_rank > 0, "--lora-rank R (LoRA adapters)"),
    "momentum": (lambda t: t.optimizer == "sgd", "--optimizer sgd"),
    "local_epochs": (lambda t: not t.local_steps, "--local-steps 0 (its default)"),
    "topk_fraction": (lambda t: t.compress == "topk", "--compress topk"),
    "error_feedback": (lambda t: t.compress != "none", "--compress int8, int4 or topk"),
    "dp_max_grad_norm": (lambda t: t.dp_sgd, "--dp-sgd (DP-SGD on the nodes)"),
}


def unused_train_notes(train_config, node_defaults=None) -> list[str]:
    """Say which model and node settings, given, do nothing with the run's other settings.

    ``train_config`` is a :class:`fedavg.config.settings.TrainConfig`; a setting counts as
    given when it differs from its default (``None``: not given, for those a strategy may
    default, with ``node_defaults``, the strategy's). One rule (:data:`NEEDS`), noted once
    per run, not refused: a sweep may vary it over points where it acts and points where it
    does not.
    """
    default = type(train_config)()
    acting = dataclasses.replace(train_config, **{  # as the nodes train
        f.name: node_value(train_config, f.name, node_defaults or {})
        for f in dataclasses.fields(train_config) if "fallback" in f.metadata})
    notes = []
    for setting, (applies, needs) in NEEDS.items():
        value = getattr(train_config, setting)
        if value is not None and value != getattr(default, setting) and \
                not applies(acting):
            notes.append(f"--{setting.replace('_', '-')} {value} does nothing without "
                         f"{needs}")
    return notes


def unused_merge_notes(merge_config) -> list[str]:
    """Say which round settings, given, do nothing with the others (noted, not refused).

    ``merge_config`` is a :class:`fedavg.config.settings.MergeConfig`: ``--dp-clip`` acts only
    with ``--dp-noise`` (node-level DP clips and adds noise together), SecAgg+'s values
    (``--secagg-*``) only with ``--secure-aggregation``. A sweep may vary ``dp-noise`` over 0
    with one ``dp-clip``, or secure aggregation on and off with one set of values.
    """
    notes = []
    if merge_config.dp_clip is not None and not merge_config.dp_noise > 0:
        notes.append(f"--dp-clip {merge_config.dp_clip:g} does nothing without --dp-noise z "
                     "(node-level DP clips the updates and adds noise together)")
    if not merge_config.secure_aggregation:
        default = type(merge_config)()
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(merge_config)
                 if f.name.startswith("secagg_")
                 and getattr(merge_config, f.name) != getattr(default, f.name)]
        if given:
            notes.append(f"{', '.join(given)} do(es) nothing without --secure-aggregation")
    return notes
