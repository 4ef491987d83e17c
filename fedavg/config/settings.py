"""One typed, validated configuration for a run, fed by the CLI and by Flower's run config.

The tree is ``RunConfig(data=DataConfig, train=TrainConfig, merge=MergeConfig)``. Python uses
snake_case field names; Flower's ``run_config`` (and TOML) use the same names in kebab-case,
flattened (``local-epochs``, ``alpha``, ...). Each field declares its command-line help next
to it (:func:`setting`), and each strategy declares its own options
(:class:`strategies.Option`); the CLI is generated from both. :meth:`RunConfig.validate`
runs once and raises :class:`~fedavg.util.errors.UserError` with a message that says what to change.

What the coordinator sends a node each round is :class:`fedavg.node.wire.TrainSettings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from fedavg.config.checks import CHECKS, check_strategy
from fedavg.config.rules import (
    Rule,
    at_least,
    first_problem,
    fraction,
    non_negative,
    one_of,
    positive,
)
from fedavg.config.values import (
    MODEL_ARGS,
    convert,
    convert_option,
    model_args_value,
    unknown_setting,
)
from fedavg.util.errors import UserError

#: Node optimizers (:func:`fedavg.node.train.train`).
OPTIMIZERS = ("sgd", "adam", "adamw")
#: Learning-rate schedules over a node's local epochs (:func:`fedavg.node.recipe.make_scheduler`).
LR_SCHEDULES = ("constant", "cosine", "step")
#: How a node encodes its update (:mod:`fedavg.node.compression`).
CODECS = ("none", "int8", "int4", "topk")
#: How the coordinator encodes the round's weights for the nodes (``--compress-down``).
DOWN_CODECS = ("none", "int8")
#: ``--lora-merge``: ``exact`` merges the nodes' products ``B_k A_k`` (:mod:`strategies.lora`),
#: ``average`` averages ``A`` and ``B`` separately (:class:`fedavg.models.lora.LoraModel`).
LORA_MERGES = ("exact", "average")
#: Where node-level DP clips each node's update (``--dp-clip-on``).
DP_CLIP_PLACES = ("coordinator", "node")
#: Seeds are below 2**31: nodes derive their own seeds from the run's without overflow.
MAX_SEED = 2**31


def setting(default: Any, help: str, *, cli: bool = True, rule: Rule | None = None,
            resumable: bool = False) -> Any:
    """Return a config field with its command-line help and the values it accepts.

    ``cli=False``: a setting of the config and TOML only; ``rule``: checked by the run
    (and, for :class:`LocalTraining`, by each node); ``resumable``: a run continued with
    ``--resume`` may change it (:func:`resumable_settings`).
    """
    return field(default=default, metadata={"help": help, "cli": cli, "rule": rule,
                                            "resumable": resumable})


def node_setting(fallback: Any, help: str, *, rule: Rule) -> Any:
    """Return a node training field that a strategy may default.

    The field's value is ``None`` until given: a run then trains with the strategy's own
    value (:attr:`strategies.Strategy.node_defaults`), else with ``fallback``
    (:meth:`LocalTraining.resolved`). ``rule`` checks a given value.
    """
    shown = f"{fallback:g}" if isinstance(fallback, float) else str(fallback)
    return field(default=None, metadata={
        "help": f"{help} (default {shown}, or the strategy's own: see `fedavg strategies`)",
        "cli": True, "rule": rule, "resumable": False, "fallback": fallback})


def strategy_node_defaults(strategy: str) -> dict[str, Any]:
    """Return the node training settings strategy ``strategy`` declares (``{}``: unknown)."""
    import strategies  # lazy: loads torch, which only this path needs

    try:
        return dict(strategies.strategy_class(strategy).node_defaults)
    except strategies.UnknownStrategyError:  # refused by the run's checks, in one line
        return {}


def node_settings_filled(given: Mapping[str, Any], strategy: str) -> dict[str, Any]:
    """Return the value of each node setting a strategy may default, for a recorded run.

    ``given`` maps snake-case setting names to values (``None`` or absent: not given); each
    takes strategy ``strategy``'s node default, else its fallback, as the run did.
    """
    defaults = strategy_node_defaults(strategy)
    return {f.name: defaults.get(f.name, f.metadata["fallback"])
            if given.get(f.name) is None else given[f.name]
            for f in fields(LocalTraining) if "fallback" in f.metadata}


@dataclass(frozen=True)
class DataConfig:
    """Which data, and how it is split across nodes.

    Attributes
    ----------
    dataset : str
        ``digits`` (built in), a local path (Parquet/CSV/Arrow files, a ``save_to_disk``
        folder, an image folder with one subfolder per class) or a Hugging Face hub id.
    image_column, label_column : str or None
        Override the detected input and label columns.
    partitioner : str
        A registered partitioner (:func:`fedavg.data.partition.partitioner_names`).
    alpha : float
        Dirichlet concentration; smaller is more skewed. Must be > 0.
    classes_per_node : int
        Labels per node for the pathological partitioner.
    partition_by : str or None
        Column holding a natural node id (writer, user, site) for ``natural``.
    seed : int
        Seed for partitioning, the test hold-out, model initialisation and node sampling.
    test_fraction : float
        Share of train held out as test when the dataset has no test split.
    text_column : str or None
        Override the detected text column.
    tokenizer : str
        ``hashed`` (word and bigram ids hashed into ``hash_buckets``, no vocabulary), a
        Hugging Face ``tokenizers`` JSON file or a local ``transformers`` tokenizer folder
        (:func:`fedavg.data.text.make_tokenizer`).
    max_tokens : int
        Tokens per text; longer texts are cut.
    hash_buckets : int
        Ids of the hashed tokenizer (the text model's embedding rows).
    """

    dataset: str = setting("digits", "digits (built in), a local path, or a hub id")
    image_column: str | None = setting(None, "Input column (default: detected)")
    label_column: str | None = setting(None, "Label column (default: detected)")
    partitioner: str = setting("iid", "iid | dirichlet | pathological | natural")
    alpha: float = setting(0.5, "Dirichlet alpha (> 0; smaller = more skew)")
    classes_per_node: int = setting(2, "Labels per node (pathological)")
    partition_by: str | None = setting(None, "Column of natural node ids (natural)")
    seed: int = setting(0, "Seed of partitioning, hold-out, init and sampling",
                        rule=Rule(lambda v: 0 <= v < MAX_SEED, f">= 0 and < {MAX_SEED}"))
    test_fraction: float = setting(0.2, "Share of train held out as test", cli=False)
    text_column: str | None = setting(None, "Text input column (default: detected)")
    tokenizer: str = setting("hashed", "Text: hashed (no vocabulary), a tokenizer.json or a "
                             "transformers tokenizer folder")
    max_tokens: int = setting(256, "Text: tokens per text (longer texts are cut)")
    hash_buckets: int = setting(131072, "Text: ids of the hashed tokenizer", cli=False)


@dataclass(frozen=True)
class LocalTraining:
    """How a node trains in each round: the one declaration of every node training option.

    Each field is declared here once, with its default, help and rule; from this
    declaration come the command-line option (``--local-epochs``), the run's check
    (:func:`fedavg.config.checks.check_train`), the entry of each round's message to the
    nodes and the node's check of it (:class:`fedavg.node.wire.TrainSettings`), and what
    :func:`fedavg.node.train.train` reads. Adding an option here, and its use in ``train``,
    is all a new node option takes.

    Attributes
    ----------
    local_epochs : int
        Passes over the node's partition per round.
    batch_size : int
        Samples per SGD step.
    lr : float or None
        Learning rate of the optimizer; ``None``: not given, the strategy's own or 0.05.
    momentum : float or None
        SGD momentum, in [0, 1) (unused by Adam); ``None``: not given, the strategy's own
        or 0.9 (:func:`node_setting`).
    weight_decay : float
        L2 penalty.
    local_steps : int
        Optimizer steps per round (0: ``local_epochs`` passes instead); a strategy may
        default it (DiLoCo's inner steps).
    optimizer : str
        ``sgd``, ``adam`` or ``adamw`` (:data:`OPTIMIZERS`), fresh each round on each node.
    lr_schedule : str
        ``constant``, ``cosine`` or ``step`` over a node's local epochs of a round
        (:mod:`fedavg.node.recipe`).
    lr_decay : float
        In (0, 1]: round ``r`` trains from ``lr * lr_decay ** (r - 1)`` (1: every round
        from ``lr``; :func:`fedavg.node.recipe.round_lr`).
    augment : bool
        Augment the nodes' training batches (random crop, and flip for colour images;
        nothing for text or tabular data); never the evaluation.
    sam_rho : float
        FedSAM's radius on the nodes, >= 0 (0: off;
        :func:`fedavg.node.train.sharpness_aware_gradient`).
    logit_adjust : float
        ``tau`` of the nodes' logit-adjusted loss, >= 0 (0: off;
        :class:`fedavg.node.recipe.LogitAdjustment`).
    clip_grad_norm : float
        Largest L2 norm of a step's gradient over all parameters, >= 0: a larger one is
        scaled down to it (Pascanu et al. 2013, arXiv:1211.5063; 0: off).
    compress : str
        How a node sends its update (:data:`CODECS`, :mod:`fedavg.node.compression`).
    topk_fraction : float
        Share of an update's entries ``topk`` sends, in ``(0, 1]``.
    error_feedback : bool
        Keep what compression left out on the node and add it to its next update.
    dp_sgd : bool
        Record-level differential privacy: the nodes train by DP-SGD (Opacus,
        :mod:`fedavg.node.dp_sgd`), with the run's ``dp_noise`` as the noise multiplier.
    dp_max_grad_norm : float
        DP-SGD: the L2 norm each sample's gradient is clipped to, > 0.
    """

    local_epochs: int = setting(1, "Local epochs per round", rule=at_least(1))
    local_steps: int | None = node_setting(0, "Optimizer steps per round instead of "
                                           "--local-epochs, cycling over the node's data; 0: "
                                           "--local-epochs passes", rule=at_least(0))
    batch_size: int = setting(32, "Samples per SGD step", rule=at_least(1))
    lr: float | None = node_setting(0.05, "Learning rate (of --optimizer)", rule=positive())
    momentum: float | None = node_setting(0.9, "SGD momentum",
                                          rule=fraction(closed_low=True, closed_high=False))
    weight_decay: float = setting(0.0, "L2 penalty", rule=non_negative())
    optimizer: str | None = node_setting("sgd", "Node optimizer: sgd (with --momentum), adam "
                                         "or adamw (decoupled --weight-decay)",
                                         rule=one_of(OPTIMIZERS))
    lr_schedule: str = setting("constant", "Learning rate over a node's local epochs: "
                               "constant, cosine (to 0) or step (x0.1 at 1/2 and 3/4)",
                               rule=one_of(LR_SCHEDULES))
    lr_decay: float = setting(1.0, "Learning-rate decay per round: round r starts from "
                              "--lr x lr-decay^(r-1)",
                              rule=fraction(closed_low=False, closed_high=True))
    augment: bool = setting(False, "Augment node batches: random crop (+ flip for colour "
                            "images); never at evaluation")
    sam_rho: float = setting(0.0, "Sharpness-aware minimisation on the nodes (FedSAM): "
                             "neighbourhood radius rho, e.g. 0.05; twice a step's cost; 0: off",
                             rule=non_negative())
    logit_adjust: float = setting(0.0, "Logit-adjusted node loss against label skew: logits + "
                                  "TAU x log(the node's label frequencies), e.g. 1; 0: off",
                                  rule=non_negative())
    clip_grad_norm: float = setting(0.0, "Clip each node step's gradient to this L2 norm over "
                                    "all parameters, e.g. 1.0; 0: off", rule=non_negative())
    compress: str = setting("none", "Node updates as sent: none, int8 or int4 (per block of "
                            "1024 with its scale) or topk (the largest --topk-fraction, with "
                            "their indices)", rule=one_of(CODECS))
    topk_fraction: float = setting(0.01, "Share of an update's entries --compress topk sends",
                                   rule=fraction(closed_low=False, closed_high=True))
    error_feedback: bool = setting(True, "Keep what --compress left out on the node and add "
                                   "it to its next update (--no-error-feedback: drop it)")
    dp_sgd: bool = setting(False, "Record-level DP: nodes train by DP-SGD (Opacus): Poisson "
                           "batches, each sample's gradient clipped to --dp-max-grad-norm, "
                           "noise of --dp-noise x that norm")
    dp_max_grad_norm: float = setting(1.0, "DP-SGD: clip each sample's gradient to this L2 "
                                      "norm", rule=positive())

    @classmethod
    def of(cls, train: LocalTraining, defaults: Mapping[str, Any] | None = None
           ) -> LocalTraining:
        """Return the node training options of ``train`` (a :class:`TrainConfig`) alone.

        Settings not given take ``defaults`` (a strategy's
        :attr:`~strategies.Strategy.node_defaults`), else their fallback
        (:meth:`resolved`).
        """
        return cls(**{f.name: getattr(train, f.name) for f in fields(cls)}).resolved(defaults)

    def resolved(self, defaults: Mapping[str, Any] | None = None) -> LocalTraining:
        """Return a copy whose settings not given (``None``) take ``defaults``, else fallbacks.

        ``defaults`` are a strategy's node defaults; a setting declared with
        :func:`node_setting` falls back to its declared value. What a node trains with.
        """
        filled = {f.name: (defaults or {}).get(f.name, f.metadata["fallback"])
                  for f in fields(self)
                  if getattr(self, f.name) is None and "fallback" in f.metadata}
        return dataclasses.replace(self, **filled) if filled else self

    def problem(self, name: Callable[[str], str] = lambda key: f"--{key}") -> str | None:
        """Return the first value a field's rule refuses, said with ``name(kebab-key)``.

        ``None`` when every value is accepted. The run says ``--lr must be ...``; a node
        checking its round says ``the round's 'lr' must be ...``.
        """
        return first_problem(LocalTraining.of(self), name)


@dataclass(frozen=True)
class ModelChoice:
    """Which model every node trains.

    Attributes
    ----------
    model : str
        Registered model name (see ``fedavg models``), ``auto``, ``torchvision:NAME``,
        ``hf:PATH``, ``module:function`` or ``file.py:function``.
    model_args : mapping
        Arguments of the model's builder (``--model-arg KEY=VALUE``); in Flower's run config
        one key, ``model-args``, holding them as JSON text.
    pretrained : str or None
        Start a torchvision model from pretrained weights: ``default`` (torchvision's
        ``DEFAULT`` weights, downloaded once) or the path of a local weights file
        (safetensors, or a state dict read with ``torch.load(weights_only=True)``); ``None``:
        random weights. ``True`` / ``False`` (older configs) mean ``default`` / ``None``.
    lora_rank : int
        Rank ``r`` of the LoRA adapters nodes train on the frozen pretrained model
        (:mod:`fedavg.models.lora`); 0: off, every weight is trained and sent.
    lora_alpha : float
        LoRA scaling numerator: the update is ``alpha / r * B @ A``.
    lora_dropout : float
        Dropout on the adapters' input, in [0, 1).
    lora_targets : str or None
        Comma-separated names of the modules to adapt; default by architecture
        (:func:`fedavg.models.lora.default_targets`).
    lora_merge : str
        ``exact`` or ``average`` (:data:`LORA_MERGES`).
    group_norm : bool
        Replace the model's BatchNorm layers by GroupNorm (``min(32, C)`` groups, Opacus's
        replacement): a model DP-SGD (``--dp-sgd``) can train, as BatchNorm has no
        per-sample gradient.
    """

    model: str = setting("auto", "Model (see `fedavg models`): a name, torchvision:NAME, "
                         "hf:PATH, module:function or file.py:function")
    model_args: Mapping[str, Any] = field(default_factory=dict, metadata={"cli": False})
    pretrained: str | None = setting(None, "torchvision models: start from pretrained weights, "
                                     "default (torchvision's, downloaded) or PATH (a local "
                                     ".safetensors or state-dict file)")
    lora_rank: int = setting(0, "LoRA adapters' rank r: nodes train and send only adapters "
                             "and the head of a pretrained model (0: off)",
                             rule=Rule(lambda v: 0 <= v <= 4096, "from 0 (off) to 4096"))
    lora_alpha: float = setting(16.0, "LoRA scaling: the update is alpha / r * B A",
                                rule=positive())
    lora_dropout: float = setting(0.0, "Dropout on the LoRA adapters' input",
                                  rule=fraction(closed_low=True, closed_high=False))
    lora_targets: str | None = setting(None, "Modules to adapt, comma-separated (default: "
                                       "attention query,value; else by architecture)")
    lora_merge: str = setting("exact", "exact (average of the nodes' B A products) | average "
                              "(A and B averaged apart)", rule=one_of(LORA_MERGES))
    group_norm: bool = setting(False, "Replace the model's BatchNorm layers by GroupNorm "
                               "(min(32, channels) groups), e.g. for --dp-sgd")

    def __post_init__(self) -> None:
        old = str(self.pretrained).lower()  # the flag of older configs and scripts
        if old in ("true", "false"):
            object.__setattr__(self, "pretrained", "default" if old == "true" else None)
        elif self.pretrained not in (None, "default") and str(self.pretrained).strip():
            # a weights file, absolute: a resumed run or a sweep point elsewhere finds it
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # checked later
                object.__setattr__(self, "pretrained",
                                   str(Path(self.pretrained).expanduser().absolute()))

    def lora(self) -> dict[str, Any] | None:
        """Return the LoRA settings of the model spec (``None``: ``--lora-rank 0``)."""
        if not self.lora_rank:
            return None
        targets = tuple(t.strip() for t in (self.lora_targets or "").split(",") if t.strip())
        return {"rank": self.lora_rank, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "targets": list(targets), "merge": self.lora_merge}


@dataclass(frozen=True)
class TrainConfig(LocalTraining, ModelChoice):
    """What each node trains (:class:`ModelChoice`), how (:class:`LocalTraining`) and where.

    Its fields are the model's, then the node training options, then ``device``.

    Attributes
    ----------
    device : str
        ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``.
    """

    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N",
                          resumable=True)


@dataclass(frozen=True)
class MergeConfig:
    """How the coordinator runs rounds and merges node models.

    Attributes
    ----------
    strategy : str
        Registered strategy name (see ``fedavg strategies``).
    rounds : int
        Number of rounds.
    num_nodes : int
        Number of nodes (= partitions).
    fraction : float
        Participation fraction: share of nodes sampled per round, in (0, 1].
    round_timeout : float
        Seconds to wait for node replies in one round.
    validation : str or None
        Held-out set for greedy soup, fitted/accuracy weights and distillation: a dataset
        (its train split); default a seeded ``validation_fraction`` slice of train, kept
        from the nodes. Never the test split.
    validation_fraction : float
        Share of train held out for validation when ``validation`` is not given.
    distill_data : str or None
        Unlabeled inputs for distillation (a dataset; labels ignored); default a seeded
        ``distill_fraction`` slice of train with labels removed.
    distill_fraction : float
        Share of train held out as unlabeled distillation data by default.
    save_node_models : bool
        Also save every node's final local model under ``nodes/<partition-id>/``.
    max_update_norm : float or None
        Reject a node's model whose L2 distance from the round's starting model is larger
        (:func:`strategies.tensors.update_norm`); ``None`` accepts any finite update.
    compress_down : str
        How the round's weights travel to the nodes (:data:`DOWN_CODECS`): ``int8`` sends
        every floating tensor of at least 1,024 entries quantised per block of 1,024 with its
        scale (:mod:`fedavg.node.compression`); the coordinator keeps the exact weights and
        rebuilds each node's model as its training from the quantised weights, moved onto
        the exact ones (nothing accumulates over rounds).
    dp_noise : float
        Differential privacy's noise multiplier ``z`` (:mod:`fedavg.run.privacy`); 0: off.
        Node level (DP-FedAvg): the noise on the sum of clipped node updates has standard
        deviation ``z * dp_clip``. With ``TrainConfig.dp_sgd``, record level: the noise on
        each DP-SGD step's sum of clipped per-sample gradients has standard deviation
        ``z * dp_max_grad_norm``.
    dp_clip : float or None
        The L2 norm each node's update is clipped to (``C``); needed with ``dp_noise``.
    dp_clip_on : str
        Where node-level DP clips each update (:data:`DP_CLIP_PLACES`): on the
        ``coordinator``, or on each ``node`` before it sends its model (the coordinator then
        never holds a raw update; with secure aggregation, only the sum of clipped ones).
    dp_delta : float or None
        The delta epsilon is reported at; ``None``: ``min(1e-5, N^-1.1)`` for N nodes.
    dp_epsilon : float or None
        A privacy budget: the run trains only the rounds whose epsilon stays within it.
    secure_aggregation : bool
        Sum the node updates with Flower's SecAgg+ (:mod:`fedavg.run.secure`): the
        coordinator learns only their sample-weighted mean; for strategies that need no more
        (``fedavg strategies``).
    secagg_num_shares, secagg_reconstruction_threshold : float
        SecAgg+'s shares of each node's secret (a count above 1, else a share of the
        round's nodes) and the shares that rebuild one (a count, else a share of the shares):
        more shares tolerate more dropouts, a higher threshold resists more colluders.
    secagg_max_weight, secagg_clipping_range : float
        Flower's quantisation: a node's samples at most ``max_weight``; its update entries
        times ``samples / max_weight`` within ``[-clipping_range, clipping_range]``.
    secagg_quantization_range, secagg_modulus_range : int
        Integers an entry is quantised to, and the modulus masks are drawn in (a power of 2
        above the quantization range).
    swa_start : int or None
        Server-side stochastic weight averaging (:mod:`strategies.swa`): from this round on,
        the run evaluates and saves the mean of the rounds' merged models (rounds
        ``swa_start`` to the current one) while nodes go on from the last merged model;
        ``None``: off.
    options : mapping
        The strategy's options given explicitly (``mu``, ``server_lr`` ...); each strategy
        declares its own (``strategies.Option``) and defaults the rest.
    """

    strategy: str = setting("fedavg", "Merge strategy (see `fedavg strategies`)")
    rounds: int = setting(10, "Number of rounds", resumable=True)
    num_nodes: int = setting(5, "Number of nodes (= partitions)")
    fraction: float = setting(1.0, "Participation fraction: share of nodes per round")
    round_timeout: float = setting(600.0, "Seconds to wait for nodes in a round",
                                   resumable=True)
    validation: str | None = setting(None, "Held-out dataset for greedy-soup, fitted "
                                     "weights, distill (default: a slice of train)")
    validation_fraction: float = setting(0.1, "Share of train held out for validation",
                                         cli=False)
    distill_data: str | None = setting(None, "Dataset for distill, its labels dropped (default: a "
                                       "slice of train, labels removed)")
    distill_fraction: float = setting(0.1, "Share of train held out for distillation",
                                      cli=False)
    save_node_models: bool = setting(False, "Also save each node's final model in "
                                     "OUTPUT/nodes/")
    max_update_norm: float | None = setting(None, "Reject node updates whose L2 distance "
                                            "from the round's model exceeds this (default: "
                                            "off)", resumable=True)
    compress_down: str = setting("none", "Round weights as sent to the nodes: none or int8 (per "
                                 "block of 1024 with its scale; the coordinator keeps them "
                                 "exact)", rule=one_of(DOWN_CODECS))
    dp_noise: float = setting(0.0, "DP noise multiplier z. Node level (DP-FedAvg): the sum of "
                              "clipped node updates gets Gaussian noise of std z x --dp-clip; "
                              "with --dp-sgd, record level: each step's sum of clipped "
                              "per-sample gradients, z x --dp-max-grad-norm; 0: off",
                              rule=non_negative())
    dp_clip: float | None = setting(None, "Node-level DP: clip each node's update to this L2 "
                                    "norm (needed with --dp-noise)")
    dp_clip_on: str = setting("coordinator", "Node-level DP: clip each update on the "
                              "coordinator or on each node before it sends (the coordinator "
                              "never holds a raw update; needed with --secure-aggregation)",
                              rule=one_of(DP_CLIP_PLACES))
    dp_delta: float | None = setting(None, "DP: the delta epsilon is reported at "
                                     "(default: 1e-5, or 1/N^1.1 for N nodes when smaller)")
    dp_epsilon: float | None = setting(None, "DP budget: train only the rounds "
                                       "whose epsilon stays within it (default: no budget)")
    secure_aggregation: bool = setting(False, "Merge only the sum of the node updates, with "
                                       "Flower's SecAgg+: the coordinator never sees one "
                                       "node's update")
    secagg_num_shares: float = setting(3.0, "SecAgg+: shares of each node's secret, a count "
                                       "(> 2) or a share of the round's nodes (<= 1)",
                                       rule=positive())
    secagg_reconstruction_threshold: float = setting(
        2.0, "SecAgg+: shares that rebuild a secret, a count or a share of --secagg-num-shares "
        "(<= 1); lower tolerates more dropouts", rule=positive())
    secagg_max_weight: float = setting(1000.0, "SecAgg+: the most samples one node may weigh",
                                       rule=positive())
    secagg_clipping_range: float = setting(8.0, "SecAgg+: update entries times samples / "
                                           "--secagg-max-weight are clipped to +-this",
                                           rule=positive())
    secagg_quantization_range: int = setting(4194304, "SecAgg+: integers an update entry is "
                                             "quantised to", rule=positive())
    secagg_modulus_range: int = setting(4294967296, "SecAgg+: modulus of the masks, a power "
                                        "of 2 above --secagg-quantization-range",
                                        rule=positive())
    swa_start: int | None = setting(None, "Average the merged models from this round on "
                                    "(server-side SWA); the average is evaluated and saved "
                                    "(default: off)")
    options: Mapping[str, Any] = field(default_factory=dict, metadata={"cli": False})


SECTIONS = {"data": DataConfig, "train": TrainConfig, "merge": MergeConfig}
#: The flat key of ``TrainConfig.model_args`` (JSON text in Flower's run config).
#: Mapping fields, not flattened one key per field.
_NOT_FLAT = ("options", "model_args")


@functools.cache
def _typed_fields(klass) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """Return the fields of a config section with their resolved types (resolved once)."""
    hints = typing.get_type_hints(klass)
    return tuple((f, hints[f.name]) for f in fields(klass))


def resumable_settings() -> frozenset[str]:
    """Return the kebab-case settings a run continued with ``--resume`` may change.

    Those declared ``resumable``: how many rounds (to train longer), how long to wait for
    nodes and where to train, which do not change what is computed, and the bound on node
    updates (to go on after a round that refused every update).
    """
    return frozenset(_kebab(f.name) for klass in SECTIONS.values() for f in fields(klass)
                     if f.metadata.get("resumable"))


def resume_help(*extra: str) -> str:
    """Return ``--resume``'s help: which settings (and ``extra`` flags) may change."""
    flags = sorted([f"--{k}" for k in resumable_settings()] + list(extra))
    return (f"Go on with the interrupted run in this folder (only {', '.join(flags)} may "
            "change)")


def cli_fields() -> list[tuple[dataclasses.Field, type]]:
    """Every config field shown on the command line, with its resolved type."""
    return [(f, hint) for klass in SECTIONS.values() for f, hint in _typed_fields(klass)
            if f.metadata.get("cli", True)]


@dataclass(frozen=True)
class RunConfig:
    """The whole configuration of a run."""

    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)

    @property
    def nodes_per_round(self) -> int:
        """Nodes sampled per round: ``ceil(fraction * num_nodes)``, at least 1."""
        return max(1, math.ceil(self.merge.fraction * self.merge.num_nodes - 1e-9))

    def validate(self) -> RunConfig:
        """Check every value, the strategy's options too (:meth:`build_strategy`); return self.

        ``device`` and ``model_args`` are checked where they are used, as the run starts.

        Raises
        ------
        UserError
            On the first invalid value, naming the option and the accepted range.
        """
        for check in CHECKS:
            if problem := check(self):
                raise UserError(problem)
        self.build_strategy()
        return self

    def local_training(self) -> LocalTraining:
        """Return how nodes train: the settings given, else the strategy's, else defaults.

        Settings a strategy declares (:attr:`strategies.Strategy.node_defaults`, e.g.
        FedDyn's plain SGD steps) apply unless the user gives them.
        """
        return LocalTraining.of(self.train, strategy_node_defaults(self.merge.strategy))

    def applied_node_defaults(self) -> dict[str, Any]:
        """Return the strategy's node defaults this run applies (those the user left out)."""
        return {k: v for k, v in strategy_node_defaults(self.merge.strategy).items()
                if getattr(self.train, k, None) is None}

    def data_settings(self) -> dict[str, Any]:
        """Return the settings :func:`fedavg.data.load.load` takes besides the dataset.

        Those of :func:`fedavg.data.load.data_settings`, with the tokenizer that comes with a
        pretrained model (``minilm``'s WordPiece) in place of ``--tokenizer``'s default.

        Raises
        ------
        UserError
            ``--tokenizer`` given for a model that brings its own; the model's package missing.
        """
        # lazy: config stays light for `fedavg --help`; loading data loads these anyway
        from fedavg.data.load import data_settings
        from fedavg.data.text import FileTokenizer
        from fedavg.models.pretrained import own_tokenizer

        settings = data_settings(self.data)
        own = own_tokenizer(self.train.model)
        if own is not None:
            if self.data.tokenizer != "hashed":
                raise UserError(f"--model {self.train.model} brings its own tokenizer: leave "
                                f"--tokenizer {self.data.tokenizer} out")
            settings["tokenizer"] = FileTokenizer(own, self.data.max_tokens,
                                                  source=f"{self.train.model}'s tokenizer")
        return settings

    def build_strategy(self):
        """Build the configured merge strategy (a new ``strategies.Strategy``).

        Raises
        ------
        UserError
            Unknown strategy, an option it does not take or a value it refuses, too few
            nodes per round, a one-shot strategy with more than one round.
        """
        import strategies  # lazy: loads torch, which only this path needs
        if problem := check_strategy(self):
            raise UserError(problem)
        try:  # its option values, then the nodes it merges each round
            strategy = strategies.get(self.merge.strategy, **dict(self.merge.options))
            strategy.check_nodes(self.nodes_per_round)
        except ValueError as exc:
            raise UserError(f"{self.merge.strategy}: {exc}") from None
        return strategy

    def to_flat(self) -> dict[str, Any]:
        """Flatten to Flower ``run_config`` style: kebab-case keys, no ``None`` values."""
        flat: dict[str, Any] = {}
        for section in (self.data, self.train, self.merge):
            for f in fields(section):
                value = getattr(section, f.name)
                if f.name not in _NOT_FLAT and value is not None:
                    flat[_kebab(f.name)] = value
        if self.train.model_args:  # run_config values are scalars: one JSON text
            flat[MODEL_ARGS] = json.dumps(dict(self.train.model_args), sort_keys=True)
        flat.update({_kebab(k): v for k, v in self.merge.options.items() if v is not None})
        return flat

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> RunConfig:
        """Build from a flat kebab- or snake-case mapping (Flower ``run_config``, CLI).

        Keys are config fields or strategy options (``strategies.all_options``); missing
        keys keep their defaults, ``None`` values are left out. Values are converted to
        each field's type.

        Raises
        ------
        UserError
            An unknown key, or a value of the wrong type.
        """
        import strategies  # lazy: loads torch, which only this path needs

        known = {_kebab(f.name): (name, f, hint)
                 for name, klass in SECTIONS.items()
                 for f, hint in _typed_fields(klass) if f.name not in _NOT_FLAT}
        declared = {_kebab(name): decl[0][1] for name, decl in strategies.all_options().items()}
        values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        options: dict[str, Any] = {}
        for raw_key, value in flat.items():
            key = _kebab(raw_key)
            if key == MODEL_ARGS:
                values["train"]["model_args"] = model_args_value(value)
            elif key in declared:
                if value is not None:
                    options[declared[key].name] = convert_option(declared[key], value)
            elif key in known:
                name, f, hint = known[key]
                values[name][f.name] = convert(key, value, f, hint)
            else:  # a typo: say the closest known settings
                raise UserError(unknown_setting(raw_key, [*known, *declared, MODEL_ARGS]))
        values["merge"]["options"] = options
        return cls(**{name: klass(**values[name]) for name, klass in SECTIONS.items()})

    def replace(self, **flat: Any) -> RunConfig:
        """Return a copy with some flat (snake- or kebab-case) settings changed."""
        merged = self.to_flat()
        merged.update({_kebab(k): v for k, v in flat.items() if v is not None})
        return RunConfig.from_flat(merged)

    def as_dict(self) -> dict[str, Any]:
        """Nested plain dict, for JSON artifacts."""
        out = dataclasses.asdict(self)
        out["merge"]["options"] = dict(self.merge.options)
        out["train"]["model_args"] = dict(self.train.model_args)
        return out


def _kebab(name: str) -> str:
    return name.replace("_", "-")
