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

from fedavg.config.settings import LocalTraining
from fedavg.node import keys


def _kebab(name: str) -> str:
    return name.replace("_", "-")



@dataclass(frozen=True)
class TrainSettings:
    """What a node needs to train one round: the round's ConfigRecord, typed.

    On the wire each field is a ConfigRecord entry named by its kebab-case name (the names
    in :mod:`fedavg.node.keys`); ``model``, ``input`` and ``classes`` travel as JSON text,
    and ``local`` as one entry per node training option (``local-epochs``, ``lr`` ...), as
    declared by :class:`~fedavg.config.settings.LocalTraining`. An option the coordinator
    did not send takes its declared default.

    Attributes
    ----------
    model : dict
        ``fedavg.models.registry.ModelSpec.as_dict()`` of the model to train.
    input : dict
        Input normalisation (``model.json``'s ``input``).
    classes : list of str
        Class names, in label order.
    seed : int
        Run seed (each node and round derives its own batch order from it).
    local : LocalTraining
        How the node trains (epochs, batch size, optimizer, recipe).
    proximal_mu : float
        FedProx's proximal coefficient (0: none).
    method : str
        The strategy whose node rule local training runs (:mod:`strategies.local`; empty:
        none), with ``method_options`` (a dict, as JSON).
    dp_noise : float
        With ``local.dp_sgd``: DP-SGD's noise multiplier (the run's ``--dp-noise``); else 0.
    dp_clip : float
        With node-level DP clipped on the nodes (``--dp-clip-on node``): the L2 norm the
        node clips its update to before it sends it, reporting 1 sample; else 0.
    server_round : int
        Set by Flower's strategy on the way out (``keys.SERVER_ROUND``).
    """

    model: dict
    input: dict
    classes: list
    seed: int
    local: LocalTraining = dataclasses.field(default_factory=LocalTraining)
    proximal_mu: float = 0.0
    method: str = ""
    method_options: dict = dataclasses.field(default_factory=dict)
    dp_noise: float = 0.0
    dp_clip: float = 0.0
    server_round: int = 0

    _JSON = ("model", "input", "classes", "method_options")

    @classmethod
    def for_run(cls, config, meta: dict[str, Any], strategy) -> TrainSettings:
        """Return the settings of ``config``'s rounds, plus what ``strategy`` sends its nodes."""
        return cls(model=meta["model"], input=meta["input"], classes=list(meta["classes"]),
                   seed=config.data.seed, local=config.local_training(),
                   dp_noise=config.merge.dp_noise if config.train.dp_sgd else 0.0,
                   dp_clip=_node_clip(config),
                   **_method(strategy), **strategy.node_config)

    def to_record(self):
        """Return the ``flwr.app.ConfigRecord`` sent with each round's model."""
        from flwr.app import ConfigRecord

        local = self.local.resolved()  # a node setting not given: its declared fallback
        out = {_kebab(f.name): getattr(local, f.name) for f in fields(LocalTraining)}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self._JSON:
                value = json.dumps(value, sort_keys=True)
            if f.name != "local" and _kebab(f.name) != keys.SERVER_ROUND:  # Flower sets it
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
        values = _decoded(cls, record, cls._JSON, skip=("local",))
        local = LocalTraining(**_decoded(LocalTraining, record)).resolved()
        settings = cls(**values, local=local)
        settings.check()
        return settings

    def check(self) -> None:
        """Check the values a node trains with (the local ones by their declared rules).

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
            ("proximal-mu", 0 <= self.proximal_mu < math.inf, "a finite number >= 0"),
            ("method-options", isinstance(self.method_options, dict), "a JSON object"),
            ("dp-clip", 0 <= self.dp_clip < math.inf, "a finite number >= 0"),
            ("dp-noise", 0 <= self.dp_noise <= 1000 and (self.dp_noise > 0
                                                         or not self.local.dp_sgd),
             "in (0, 1000] with dp-sgd, else 0 or more"),
        ]
        for key, ok, need in problems:
            if not ok:
                raise ValueError(f"the round's {key!r} must be {need} (got "
                                 f"{getattr(self, key.replace('-', '_'))!r})")
        if problem := self.local.problem(lambda key: f"the round's {key!r}"):
            raise ValueError(problem)


def _decoded(cls, record, json_fields: tuple[str, ...] = (), skip: tuple[str, ...] = ()
             ) -> dict[str, Any]:
    """Return the typed values of ``cls``'s fields found in ``record`` (defaults elsewhere).

    Raises
    ------
    ValueError
        A field without a default that ``record`` lacks, or a value of the wrong type.
    """
    hints = _field_types(cls)
    values = {}
    for f in fields(cls):
        key = _kebab(f.name)
        if f.name in skip:
            continue
        if key not in record:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"the round's config has no {key!r}")
            continue
        values[f.name] = _decode(key, record[key], hints[f.name], f.name in json_fields)
    return values


def _node_clip(config) -> float:
    """Return the clip a node applies to its update (``--dp-clip-on node``), else 0."""
    m = config.merge
    node_level = m.dp_noise > 0 and not config.train.dp_sgd and m.dp_clip is not None
    return float(m.dp_clip) if node_level and m.dp_clip_on == "node" else 0.0


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
    optional = [a for a in typing.get_args(kind) if a is not type(None)]
    kind = optional[0] if len(optional) == 1 else kind  # `float | None`: a float on the wire
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
