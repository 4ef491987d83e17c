"""One typed, validated configuration for a run, fed by the CLI and by Flower's run config.

The tree is ``RunConfig(data=DataConfig, train=TrainConfig, merge=MergeConfig)``. Python uses
snake_case field names; Flower's ``run_config`` (and TOML) use the same names in kebab-case,
flattened (``local-epochs``, ``alpha``, ...). :meth:`RunConfig.validate` runs once and raises
:class:`~fedavg.errors.UserError` with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from fedavg.errors import UserError

PARTITIONERS = ("iid", "dirichlet", "pathological", "natural")


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
        ``iid``, ``dirichlet`` (label skew, ``alpha``), ``pathological`` (``classes_per_node``
        labels per node) or ``natural`` (one node per value of ``partition_by``).
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
    """

    dataset: str = "digits"
    image_column: str | None = None
    label_column: str | None = None
    partitioner: str = "iid"
    alpha: float = 0.5
    classes_per_node: int = 2
    partition_by: str | None = None
    seed: int = 0
    test_fraction: float = 0.2


@dataclass(frozen=True)
class TrainConfig:
    """How each node trains its copy of the model.

    Attributes
    ----------
    model : str
        Registered model name (``fedavg strategies``' sibling ``fedavg models``), or ``auto``.
    local_epochs : int
        Passes over the node's partition per round.
    batch_size : int
        Samples per SGD step.
    lr : float
        SGD learning rate.
    momentum : float
        SGD momentum, in [0, 1).
    weight_decay : float
        L2 penalty.
    device : str
        ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``.
    """

    model: str = "auto"
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str = "auto"


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
    mu : float
        FedProx proximal coefficient.
    server_lr, server_momentum, tau : float
        Server optimiser settings (FedAvgM, FedAdam, FedYogi, FedAdagrad); ``None`` keeps
        each method's default.
    beta : float
        Trimmed-mean fraction cut at each end.
    num_malicious : int
        Krum's ``f``.
    ensemble_weights : str
        ``num-examples``, ``uniform``, ``accuracy`` or ``fitted``.
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
    distill_steps : int
        Adam steps of distillation.
    save_node_models : bool
        Also save every node's final local model under ``nodes/<partition-id>/``.
    """

    strategy: str = "fedavg"
    rounds: int = 10
    num_nodes: int = 5
    fraction: float = 1.0
    round_timeout: float = 600.0
    mu: float = 0.01
    server_lr: float | None = None
    server_momentum: float = 0.9
    tau: float | None = None
    beta: float = 0.1
    num_malicious: int = 0
    ensemble_weights: str = "num-examples"
    validation: str | None = None
    validation_fraction: float = 0.1
    distill_data: str | None = None
    distill_fraction: float = 0.1
    distill_steps: int = 1000
    save_node_models: bool = False

    def strategy_options(self) -> dict[str, Any]:
        """Options handed to ``strategies.get`` (each strategy takes the ones it knows)."""
        return {"mu": self.mu, "server_lr": self.server_lr,
                "server_momentum": self.server_momentum, "tau": self.tau, "beta": self.beta,
                "num_malicious": self.num_malicious, "ensemble_weights": self.ensemble_weights,
                "distill_steps": self.distill_steps}


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

    def validate(self) -> "RunConfig":
        """Check every value; return ``self``.

        Raises
        ------
        UserError
            On the first invalid value, naming the option and the accepted range.
        """
        d, t, m = self.data, self.train, self.merge
        if d.partitioner not in PARTITIONERS:
            raise UserError(
                f"unknown partitioner {d.partitioner!r}; choose one of {', '.join(PARTITIONERS)}"
            )
        if not d.alpha > 0:
            raise UserError(f"--alpha must be > 0 (got {d.alpha}); try 0.5 for label skew")
        if d.classes_per_node < 1:
            raise UserError(f"--classes-per-node must be >= 1 (got {d.classes_per_node})")
        if d.partitioner == "natural" and not d.partition_by:
            raise UserError("--partitioner natural needs --partition-by COLUMN")
        if d.seed < 0:
            raise UserError(f"--seed must be >= 0 (got {d.seed})")
        if not 0 < d.test_fraction < 1:
            raise UserError(f"test fraction must be in (0, 1) (got {d.test_fraction})")
        if t.local_epochs < 1:
            raise UserError(f"--local-epochs must be >= 1 (got {t.local_epochs})")
        if t.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1 (got {t.batch_size})")
        if not t.lr > 0:
            raise UserError(f"--lr must be > 0 (got {t.lr})")
        if not 0 <= t.momentum < 1:
            raise UserError(f"--momentum must be in [0, 1) (got {t.momentum})")
        if t.weight_decay < 0:
            raise UserError(f"--weight-decay must be >= 0 (got {t.weight_decay})")
        if m.rounds < 1:
            raise UserError(f"--rounds must be >= 1 (got {m.rounds})")
        if m.num_nodes < 1:
            raise UserError(f"--num-nodes must be >= 1 (got {m.num_nodes})")
        if not 0 < m.fraction <= 1:
            raise UserError(f"--fraction must be in (0, 1] (got {m.fraction})")
        if not m.round_timeout > 0:
            raise UserError(f"--round-timeout must be > 0 seconds (got {m.round_timeout})")
        for name in ("validation_fraction", "distill_fraction"):
            if not 0 < getattr(m, name) < 0.5:
                raise UserError(f"--{name.replace('_', '-')} must be in (0, 0.5)")
        return self.check_strategy()

    def strategy(self):
        """The configured merge strategy (a new ``strategies.Strategy``).

        Raises
        ------
        UserError
            Unknown strategy or an option value it refuses.
        """
        import strategies

        try:
            return strategies.get(self.merge.strategy, **self.merge.strategy_options())
        except strategies.UnknownStrategyError as exc:
            raise UserError(str(exc)) from None
        except ValueError as exc:
            raise UserError(f"{self.merge.strategy}: {exc}") from None

    def check_strategy(self) -> "RunConfig":
        """Check the strategy exists, takes its options, and fits the number of rounds."""
        strategy = self.strategy()
        if strategy.one_shot and self.merge.rounds != 1:
            raise UserError(
                f"{self.merge.strategy} is a one-shot merge of fully trained node models: "
                f"use --rounds 1 (and --local-epochs to train longer)"
            )
        return self

    def to_flat(self) -> dict[str, Any]:
        """Flatten to Flower ``run_config`` style: kebab-case keys, no ``None`` values."""
        flat: dict[str, Any] = {}
        for section in (self.data, self.train, self.merge):
            for f in fields(section):
                value = getattr(section, f.name)
                if value is not None:
                    flat[f.name.replace("_", "-")] = value
        return flat

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> "RunConfig":
        """Build from a flat kebab-case mapping (Flower ``run_config``, CLI overrides).

        Unknown keys raise :class:`UserError`; missing keys keep their defaults. Values are
        converted to each field's type.
        """
        sections = {"data": DataConfig, "train": TrainConfig, "merge": MergeConfig}
        known = {
            f.name.replace("_", "-"): (name, f)
            for name, klass in sections.items()
            for f in fields(klass)
        }
        values: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in flat.items():
            if key not in known:
                raise UserError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
            name, f = known[key]
            values[name][f.name] = _convert(key, value, f)
        return cls(**{name: klass(**values[name]) for name, klass in sections.items()})

    def replace(self, **flat: Any) -> "RunConfig":
        """Return a copy with some flat (snake- or kebab-case) settings changed."""
        merged = self.to_flat()
        merged.update({k.replace("_", "-"): v for k, v in flat.items() if v is not None})
        return RunConfig.from_flat(merged)

    def as_dict(self) -> dict[str, Any]:
        """Nested plain dict, for JSON artifacts."""
        return dataclasses.asdict(self)


def _convert(key: str, value: Any, f: dataclasses.Field) -> Any:
    kind = str(f.type)
    try:
        if value is None or value == "":
            return None if "None" in kind else f.default
        if kind.startswith("bool"):
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise UserError(f"setting {key!r} expects {kind.split(' ')[0]}, got {value!r}") from None
