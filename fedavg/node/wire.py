"""What goes over the wire each round: the train settings a node receives, typed.

:class:`TrainSettings` is the schema of the ``config`` record of a round's ``train``
message: the coordinator builds it from the run config (:meth:`TrainSettings.for_run`) and
sends :meth:`TrainSettings.to_record`; a node decodes it with
:meth:`TrainSettings.from_record`. Record keys are in :mod:`fedavg.node.keys`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, fields
from typing import Any

from fedavg.node import keys


def _kebab(name: str) -> str:
    return name.replace("_", "-")



@dataclass(frozen=True)
class TrainSettings:
    """What a node needs to train one round: the round's ConfigRecord, typed.

    On the wire each field is a ConfigRecord entry named by its kebab-case name (the names
    in :mod:`fedavg.node.keys`); ``model``, ``input`` and ``classes`` travel as JSON text.

    Attributes
    ----------
    model : dict
        ``fedavg.models.registry.ModelSpec.as_dict()`` of the model to train.
    input : dict
        Input normalisation (``model.json``'s ``input``).
    classes : list of str
        Class names, in label order.
    local_epochs, batch_size : int
        Passes over the partition, samples per step.
    lr, momentum, weight_decay : float
        Optimizer settings.
    optimizer : str
        ``sgd`` or ``adam``.
    lr_schedule : str
        ``constant``, ``cosine`` or ``step`` (:mod:`fedavg.node.recipe`).
    lr_decay : float
        Per-round decay of ``lr``, in (0, 1] (:func:`fedavg.node.recipe.round_lr`).
    augment : bool
        Augment the training batches.
    sam_rho : float
        SAM's neighbourhood radius, >= 0 (0: plain steps; :func:`fedavg.node.train.train`).
    logit_adjust : float
        ``tau`` of the logit-adjusted loss, >= 0 (0: plain cross-entropy).
    seed : int
        Run seed (each node and round derives its own batch order from it).
    proximal_mu : float
        FedProx's proximal coefficient (0: none).
    method : str
        The strategy whose node rule local training runs (:mod:`strategies.local`; empty:
        none), with ``method_options`` (a dict, as JSON).
    server_round : int
        Set by Flower's strategy on the way out (``keys.SERVER_ROUND``).
    """

    model: dict
    input: dict
    classes: list
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    proximal_mu: float = 0.0
    optimizer: str = "sgd"
    lr_schedule: str = "constant"
    lr_decay: float = 1.0
    augment: bool = False
    sam_rho: float = 0.0
    logit_adjust: float = 0.0
    method: str = ""
    method_options: dict = dataclasses.field(default_factory=dict)
    server_round: int = 0

    _JSON = ("model", "input", "classes", "method_options")

    @classmethod
    def for_run(cls, config, meta: dict[str, Any], strategy) -> TrainSettings:
        """Return the settings of ``config``'s rounds, plus what ``strategy`` sends its nodes."""
        t = config.train
        return cls(model=meta["model"], input=meta["input"], classes=list(meta["classes"]),
                   local_epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
                   momentum=t.momentum, weight_decay=t.weight_decay, seed=config.data.seed,
                   optimizer=t.optimizer, lr_schedule=t.lr_schedule, lr_decay=t.lr_decay,
                   augment=t.augment, sam_rho=t.sam_rho, logit_adjust=t.logit_adjust,
                   **_method(strategy), **strategy.node_config)

    def to_record(self):
        """Return the ``flwr.app.ConfigRecord`` sent with each round's model."""
        from flwr.app import ConfigRecord

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self._JSON:
                value = json.dumps(value, sort_keys=True)
            if _kebab(f.name) != keys.SERVER_ROUND:  # Flower's strategy sets the round
                out[_kebab(f.name)] = value
        return ConfigRecord(out)

    @classmethod
    def from_record(cls, record) -> TrainSettings:
        """Decode and check a round's ConfigRecord.

        Raises
        ------
        ValueError
            A missing entry, one of the wrong type or bad JSON, or a value out of range,
            naming the entry (the node replies with this error; nothing is trained).
        """
        hints = _field_types(cls)
        values = {}
        for f in fields(cls):
            key = _kebab(f.name)
            if key not in record:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"the round's config has no {key!r}")
                continue
            values[f.name] = _decode(key, record[key], hints[f.name], f.name in cls._JSON)
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Check the values a node trains with.

        Raises
        ------
        ValueError
            The first value out of range, naming its entry.
        """
        problems = [
            ("model", isinstance(self.model, dict) and "name" in self.model, "a model spec"),
            ("input", isinstance(self.input, dict), "an input spec"),
            ("classes", isinstance(self.classes, list) and bool(self.classes),
             "a list of class names"),
            ("local-epochs", self.local_epochs >= 1, ">= 1"),
            ("batch-size", self.batch_size >= 1, ">= 1"),
            ("lr", 0 < self.lr < math.inf, "a finite number > 0"),
            ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
            ("weight-decay", 0 <= self.weight_decay < math.inf, "a finite number >= 0"),
            ("proximal-mu", 0 <= self.proximal_mu < math.inf, "a finite number >= 0"),
            ("optimizer", self.optimizer in ("sgd", "adam"), "sgd or adam"),
            ("lr-schedule", self.lr_schedule in ("constant", "cosine", "step"),
             "constant, cosine or step"),
            ("lr-decay", 0 < self.lr_decay <= 1, "in (0, 1]"),
            ("sam-rho", 0 <= self.sam_rho < math.inf, ">= 0 and finite"),
            ("logit-adjust", 0 <= self.logit_adjust < math.inf, ">= 0 and finite"),
            ("method-options", isinstance(self.method_options, dict), "a JSON object"),
        ]
        for key, ok, need in problems:
            if not ok:
                raise ValueError(f"the round's {key!r} must be {need} (got "
                                 f"{getattr(self, key.replace('-', '_'))!r})")


def _method(strategy) -> dict[str, Any]:
    """Return the ``method`` fields of a strategy with a node rule (none for the others)."""
    if strategy.node_rule is None:
        return {}
    return {"method": strategy.name, "method_options": strategy.node_options()}


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    """Return the resolved field types of ``cls`` (resolved once, not every round)."""
    return typing.get_type_hints(cls)


def _decode(key: str, raw: Any, kind: Any, is_json: bool) -> Any:
    try:
        if is_json:
            return json.loads(str(raw))
        if kind is bool:
            if not isinstance(raw, bool):
                raise ValueError(raw)
            return raw
        if isinstance(raw, bool) or (kind is int and isinstance(raw, float)
                                     and not raw.is_integer()):
            raise ValueError(raw)
        return kind(raw)
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        what = "JSON" if is_json else kind.__name__
        raise ValueError(f"the round's {key!r} is not {what}: {str(raw)[:60]!r}") from None
