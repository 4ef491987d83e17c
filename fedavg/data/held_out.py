"""The data of data-driven merges: held-out samples and unlabeled inputs.

Soups and fitted ensemble weights choose on held-out samples; distillation trains on
unlabeled inputs. ``fedavg simulate`` keeps them from its train split before partitioning
(:func:`run_merge_data`); ``fedavg merge`` of saved models takes them from the datasets it is
given (:func:`saved_merge_samples`), never from the samples the models' nodes trained on.
"""

from __future__ import annotations

from typing import Any

from fedavg.data.load import LoadedData, Split, check_kind, conform, holdout, load
from fedavg.data.sources import same_source, saved_load_args
from fedavg.util.errors import NoLabelColumn, UserError


def unused_data(config, strategy) -> list[tuple[str, str]]:
    """Return ``(flag, dataset)`` of each of ``--validation``, ``--distill-data`` given unused.

    ``strategy`` (``needs_validation``, ``needs_unlabeled``) is ``config``'s.
    """
    m = config.merge
    return [(flag, given) for flag, given, used in (
        ("--validation", m.validation, strategy.needs_validation),
        ("--distill-data", m.distill_data, strategy.needs_unlabeled)) if given and not used]


def run_merge_data(config, strategy, data: LoadedData):
    """Return the validation split and unlabeled inputs the strategy needs.

    They are kept out of ``data.train`` (so from the nodes) unless given as other datasets:
    ``--validation`` or ``--distill-data`` naming the run's own dataset also means a slice
    kept from the nodes, since its train split is the nodes' data. A given dataset that the
    strategy does not use is noted in ``data.notes``.

    Parameters
    ----------
    config : fedavg.config.settings.RunConfig
    strategy : strategies.Strategy
        The run's strategy (``needs_validation``, ``needs_unlabeled``).
    data : fedavg.data.load.LoadedData
        The run's data; its train split loses the slices kept.

    Returns
    -------
    tuple
        ``(validation, distill_x)``: a ``Split`` or ``None``, ``(M, ...)`` raw inputs or
        ``None``.

    Raises
    ------
    UserError
        A given dataset that cannot be loaded or does not fit the run's inputs and classes.
    """
    d, m = config.data, config.merge
    validation, distill_x = None, None
    data.notes.extend(f"{flag} {given} does nothing with --strategy {m.strategy}"
                      for flag, given in unused_data(config, strategy))
    own = " (the run's own dataset: its train split is the nodes' data)"
    if strategy.needs_validation:
        if m.validation and not same_source(m.validation, d.dataset):
            validation = _aligned_split(m.validation, data, "--validation")
        else:
            data.splits["train"], validation = holdout(data.train, m.validation_fraction,
                                                       d.seed + 1)
            data.notes.append(f"validation for {m.strategy}: {len(validation)} train samples "
                              f"({m.validation_fraction:.0%}) kept from the nodes"
                              f"{own if m.validation else ''}")
    if strategy.needs_unlabeled:
        if m.distill_data and not same_source(m.distill_data, d.dataset):
            distill_x = _aligned_split(m.distill_data, data, "--distill-data", labels=False).x
        else:
            data.splits["train"], unlabeled = holdout(data.train, m.distill_fraction, d.seed + 2)
            distill_x = unlabeled.x
            data.notes.append(f"distillation data: {len(distill_x)} train samples "
                              f"({m.distill_fraction:.0%}) kept from the nodes, labels removed"
                              f"{own if m.distill_data else ''}")
    return validation, distill_x


def _aligned_split(source: str, data: LoadedData, flag: str, labels: bool = True) -> Split:
    """Return the train split of another dataset, checked against ``data``'s inputs and classes."""
    try:
        other = load(source, tokenizer=data.tokenizer if data.tokenizer else "hashed",
                     labelled=labels)
    except NoLabelColumn:
        if labels:
            raise
        raise _no_label_column(flag, source) from None
    check_kind(data.input_spec(), other, f"{flag} {source}")
    return conform(other.train, f"{flag} {source}", data.input_shape,
                   other.classes if labels else None, data.classes)


def _no_label_column(flag: str, source: str) -> UserError:
    """Return the error for unlabeled data without a label column (the loader needs one)."""
    return UserError(f"{flag} {source}: fedavg reads it as a dataset with a label column, "
                     "whose labels it then drops; add a label column (any values)")


def saved_merge_samples(source: str, meta: dict[str, Any], fraction: float, tokenizer,
                        held_out: bool = False, unlabeled: bool = False,
                        validation_fraction: float = 0.1) -> Split:
    """Return samples of ``source`` for a data-driven merge, shaped like the models' inputs.

    A dataset's ``validation`` split, else a seeded ``fraction`` of its train split. With
    ``held_out`` (``--validation``) and ``source`` the dataset the models' run trained on,
    the samples are the slice that run kept from its nodes (its seed and fraction), so the
    merge never validates on data the nodes trained on. ``unlabeled`` samples
    (``--distill-data``) are a ``fraction`` of the train split outside the slice that
    ``--validation`` of the same dataset takes (``validation_fraction``), so a distilled
    model is never picked on the samples it was distilled on.

    Raises
    ------
    UserError
        ``held_out``, the run's own dataset, no slice kept by the run (its metadata says
        ``validation_samples: 0``) and no ``validation`` split: every train sample trained a
        node.
    """
    ds = meta.get("dataset", {})
    seed = int(ds.get("seed", 0))
    try:
        data = load(source, tokenizer=tokenizer, labelled=not unlabeled,
                    **saved_load_args(meta, source))
    except NoLabelColumn:
        if not unlabeled:
            raise
        raise _no_label_column("--distill-data", source) from None
    check_kind(meta["input"], data, source)
    own = same_source(source, ds.get("source"))
    kept = ds.get("validation_kept")  # kept from the nodes' train split (not --validation B)
    if kept is None:  # a run saved before the key: its --validation tells
        given = meta.get("config", {}).get("merge", {}).get("validation")
        kept = 0 if given and not same_source(given, ds.get("source")) \
            else ds.get("validation_samples")
    if own and kept:  # the slice `fedavg simulate` kept from the nodes: its own fraction
        validation_fraction = float(meta.get("config", {}).get("merge", {}).get(
            "validation_fraction", validation_fraction))
    if unlabeled:
        rest = data.train
        if (own and kept) or "validation" not in data.splits:
            rest, _ = holdout(data.train, validation_fraction, seed + 1)
        _, split = holdout(rest, fraction, seed + 2)
    elif held_out and own and kept:
        _, split = holdout(data.train, validation_fraction, seed + 1)
    elif "validation" in data.splits:
        split = data.splits["validation"]
    elif held_out and own and kept == 0:
        raise UserError(f"--validation {source}: the nodes of these models trained on all of "
                        "its train split (their run kept no validation slice); pass data they "
                        "did not train on, or train with a strategy that keeps a slice "
                        "(e.g. --ensemble-weights fitted)")
    else:
        _, split = holdout(data.train, fraction, seed + 1)
    return conform(split, source, meta["input"]["shape"],  # unlabeled: its labels are dropped
                   None if unlabeled else data.classes, meta["classes"])
