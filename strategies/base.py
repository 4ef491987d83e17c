"""Shared types and the registry of merge strategies.

A strategy folds node models in one at a time (``begin`` / ``add`` / ``result``), so that a
coordinator never needs to hold every node's copy at once: peak memory is a small multiple of
one state dict, whatever the number of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from strategies.options import Option, UnknownOptionError  # noqa: F401  (re-exported)
from strategies.tensors import (  # noqa: F401  (re-exported: the strategies' toolkit)
    MergeError,
    StateDict,
    check_compatible,
    first_non_finite,
    is_float,
    merge_integer,
    signature,
    update_norm,
)


class UnknownStrategyError(KeyError):
    """No strategy registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class Merged:
    """Result of a merge.

    Attributes
    ----------
    state_dict : dict of str to torch.Tensor
        The single merged model (each tensor in its original dtype). For an ensemble, the
        weighted parameter average of its members (what the next round would start from).
    num_models : int
        How many node models went in.
    total_weight : float
        Sum of the weights (e.g. samples) of those models.
    members : list of dict, optional
        Set for output ensembles: the member state dicts, kept as they are.
    member_weights : list of float, optional
        Ensemble weights of ``members`` (non-negative, summing to 1).
    info : dict
        Method-specific facts for the run's metadata (e.g. the members a soup kept).
    """

    state_dict: dict[str, torch.Tensor]
    num_models: int
    total_weight: float
    members: list[dict[str, torch.Tensor]] | None = None
    member_weights: list[float] | None = None
    info: dict = field(default_factory=dict)

    @property
    def is_ensemble(self) -> bool:
        """Whether the result is an output ensemble rather than one network."""
        return self.members is not None


@dataclass
class MergeContext:
    """What data-driven merges (soups, fitted ensembles, distillation) may use.

    Everything here is plain PyTorch; ``strategies`` never sees Flower.

    Attributes
    ----------
    build_model : callable
        ``() -> torch.nn.Module``, a fresh instance of the architecture being merged.
    normalize : callable
        ``(x) -> float tensor``: raw ``(N, ...)`` inputs to model inputs.
    val_x, val_y : torch.Tensor, optional
        Held-out validation set (never the test split): ``(N, ...)`` raw inputs and
        ``(N,)`` int64 labels.
    distill_x : torch.Tensor, optional
        ``(M, ...)`` raw unlabeled inputs for distillation.
    device : torch.device
        Where to run models.
    seed : int
        Seed of any random choice.
    """

    build_model: Callable[[], torch.nn.Module]
    normalize: Callable[[torch.Tensor], torch.Tensor]
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None
    distill_x: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    num_nodes: int | None = None
    """All nodes of the run (sampled or not), for methods that scale by it (SCAFFOLD)."""
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Raw ``(B, ...)`` batch to an augmented raw batch of the same shape (the data kind's
    default, :func:`fedavg.node.recipe.augmenter`; torch's global generator); ``None``: none."""

    @torch.no_grad()
    def probabilities(self, state_dict: StateDict, x: torch.Tensor,
                      batch_size: int = 1024) -> torch.Tensor:
        """``(N, K)`` softmax outputs of the model with ``state_dict`` on raw inputs ``x``."""
        model = self.build_model()
        model.load_state_dict(state_dict)
        model.to(self.device).eval()
        out = [torch.softmax(model(self.normalize(x[i:i + batch_size].to(self.device))).float(),
                             dim=1).cpu() for i in range(0, len(x), batch_size)]
        return torch.cat(out)

    def accuracy(self, probs: torch.Tensor) -> float:
        """Return the validation accuracy of ``(N, K)`` probabilities."""
        if self.val_y is None:
            raise MergeError("this merge needs a validation set")
        return float((probs.argmax(1) == self.val_y).float().mean())


class Strategy:
    """A merge method: fold node models in with ``add``, read the result with ``result``.

    Subclasses set ``name``, ``description`` and ``paper`` (citation with arXiv id) and
    implement ``begin``, ``add`` and ``result``.
    """

    name: str = ""
    description: str = ""
    paper: str = ""
    one_shot: bool = False
    #: The result keeps the node models as they came (an output ensemble), merging no
    #: parameters.
    keeps_members: bool = False
    """True for "train many, then merge" methods, applied once after local training."""
    needs_validation: bool = False
    """True when the merge uses ``MergeContext.val_x`` / ``val_y``."""
    needs_unlabeled: bool = False
    """True when the merge uses ``MergeContext.distill_x`` (unlabeled inputs)."""
    node_config: dict = {}
    """Extra local-training settings sent to nodes: ``fedavg.node.wire.TrainSettings`` field
    names and values (e.g. FedProx's ``proximal_mu``)."""
    options: tuple[Option, ...] = ()
    """The settings this strategy takes (see :class:`Option`); each becomes an attribute."""
    skew_note: str = ""
    """What the method does on label-skewed partitions, when that is not what it is for: the
    run notes it for any partitioner but ``iid`` (empty: nothing to say)."""
    rounds_note: str = ""
    """What the method does over several rounds, when it is made for one merge: the run notes
    it when ``--rounds`` is above 1 (empty: nothing to say)."""
    node_defaults: Mapping[str, Any] = {}
    """Node training settings the method's paper or measurements call for, by setting name
    (``{"momentum": 0.0}``): a run applies them unless the user gives the setting
    (:meth:`fedavg.config.settings.RunConfig.local_training`); ``fedavg strategies`` lists
    them."""
    ordered: bool = False
    """Always fold a round's replies in partition order rather than as they arrive, so that
    a run does not depend on which node answered first, even when the round's models exceed
    ``fedavg.run.flower_adapter.ORDERED_FOLD_BYTES`` (the coordinator then holds them all). For
    methods that amplify rounding differences (SCAFFOLD)."""
    node_rule: type | None = None
    """A :class:`strategies.local.NodeRule` subclass when the method changes local
    training (SCAFFOLD, FedNova, MOON, FedDyn); nodes run it with :meth:`node_options`."""
    trains_nodes: bool = False
    """True when the method changes how nodes train (a ``node_rule``, FedProx's proximal
    term): it has no meaning for a merge of saved models (``fedavg merge``)."""
    needs_start: bool = False
    """True when the merge works on task vectors, each model minus the model every node
    started from (``begin``'s ``reference``): ``fedavg merge`` then needs that start model."""
    steps_from_start: bool = False
    """True when the merge steps away from the round's starting model (server optimisers):
    saved models have no such model, so it has no meaning for ``fedavg merge`` either."""

    dp_mean: bool = False
    """True when the merge is a function of the nodes' mean model alone (a weighted mean,
    then perhaps a server step): node-level DP (``--dp-noise``) clips each update, weighs
    every node 1 and adds noise to their sum, and DP-FedAvg's analysis holds for what the
    method does with that mean (post-processing). Methods that weigh nodes by what they
    report (FedNova's local steps), send other node data (SCAFFOLD's control variates) or
    pick among models (median, Krum, TIES) keep False."""

    secure_sum: bool = False
    """True when the merge is a function of the nodes' **sample-weighted** mean model alone
    (perhaps then a server step), with no other reply record: secure aggregation
    (``--secure-aggregation``, Flower's SecAgg+) reveals only that mean, and the merge gets it
    as one model weighing all the round's samples. Unweighted means (uniform soup) keep False."""

    saved_extras: tuple[str, ...] = ()
    """The reply records the merge needs beside each model (Fisher's ``fisher``):
    ``--save-node-models`` keeps each as ``<name>.safetensors`` in the node's model folder,
    and ``fedavg merge`` hands them back to :meth:`add_reply`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.node_rule is not None and "trains_nodes" not in cls.__dict__:
            cls.trains_nodes = True  # unless the class says its node rule only measures

    @classmethod
    def takes_dp_sgd(cls) -> bool:
        """Whether record-level DP (``--dp-sgd``) holds: nodes train and send as DP-SGD has it.

        A method that changes local training (a node rule, FedProx's proximal term) or sends
        more of a node's data than its model (SCAFFOLD's control variates, Fisher estimates)
        would train or report outside DP-SGD's clipped and noised gradients.
        """
        return cls.node_rule is None and not cls.trains_nodes

    @classmethod
    def merges_saved_models(cls) -> bool:
        """Whether ``fedavg merge`` can use it: it neither trains nodes nor steps from a start."""
        return not (cls.trains_nodes or cls.steps_from_start)

    def __init__(self, **options: Any) -> None:
        problem = self.unknown_options(options)
        if problem:
            raise UnknownOptionError(problem)
        for o in self.options:
            value = options.get(o.name)
            setattr(self, o.name, o.default if value is None else o.convert(value))
        self.check()

    @classmethod
    def unknown_options(cls, names: Iterable[str]) -> str | None:
        """Say which of ``names`` this strategy does not declare, or return ``None``."""
        unknown = sorted(set(names) - {o.name for o in cls.options})
        if not unknown:
            return None
        flags = ", ".join("--" + n.replace("_", "-") for n in unknown)
        takes = ", ".join(o.flag for o in cls.options) or "no options"
        return f"strategy {cls.name} does not take {flags} (it takes {takes})"

    def check(self) -> None:
        """Check the option values (after :meth:`__init__` set them).

        Raises
        ------
        ValueError
            A value outside the method's range, naming the option.
        """

    def check_nodes(self, n: int) -> None:
        """Check that the method works with ``n`` node models per merge.

        Raises
        ------
        ValueError
            Too few models for the option values, naming the options.
        """

    def nodes_note(self, n: int) -> str | None:
        """Say what the method does with ``n`` models per merge, if not what it is for.

        For instance a trimmed mean that trims nothing; ``None`` otherwise.
        """
        return None

    def check_setup(self, model: torch.nn.Module, train: Mapping[str, Any]) -> list[str]:
        """Check the run's model and node training settings before anything trains.

        Parameters
        ----------
        model : torch.nn.Module
            A fresh instance of the run's model.
        train : mapping
            Node training settings by name (``momentum``, ``optimizer``, ``lr`` ...).

        Returns
        -------
        list of str
            Notes for the user (settings that work, but not as the method intends).

        Raises
        ------
        MergeError
            A model the method cannot use, saying why.
        """
        return []

    def begin(self, reference: StateDict, buffers: frozenset[str] = frozenset(),
              context: "MergeContext | None" = None) -> None:
        """Start a merge whose models must match ``reference``'s keys, shapes and dtypes.

        Parameters
        ----------
        reference : mapping of str to torch.Tensor
            The current global model (the round's starting point).
        buffers : frozenset of str
            Keys that are buffers (BatchNorm statistics), not trained parameters: server
            optimisers average them instead of stepping them.
        context : MergeContext, optional
            Data and model access for data-driven merges.
        """
        raise NotImplementedError

    def add(self, state_dict: StateDict, weight: float, node: str = "?") -> None:
        """Fold in one node's model with ``weight`` (e.g. its number of samples)."""
        raise NotImplementedError

    def add_reply(self, state_dict: StateDict, weight: float, node: str = "?", *,
                  arrays: Mapping[str, StateDict] | None = None,
                  metrics: Mapping[str, float] | None = None) -> None:
        """Fold in a node's whole reply: its model plus what its node rule added.

        ``arrays`` and ``metrics`` are the reply's extra records
        (:class:`strategies.local.NodeUpdate`). The default ignores them and calls
        :meth:`add`.

        Raises
        ------
        MergeError
            As :meth:`add`, or an extra the method needs is missing or malformed.
        """
        self.add(state_dict, weight, node)

    def to_nodes(self, reference: StateDict,
                 buffers: frozenset[str] = frozenset()) -> dict[str, StateDict]:
        """Return extra array records sent to every node with the round's model.

        Called before each round with its starting model ``reference`` (e.g. SCAFFOLD's
        server control variate, zero before the first round); the default sends nothing.
        """
        return {}

    def node_options(self) -> dict[str, Any]:
        """Return the option values the node rule needs (default: all of them)."""
        return {o.name: getattr(self, o.name) for o in self.options}

    def result(self) -> Merged:
        """Return the merged model of everything added since ``begin``."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Return what the method carries from one round to the next (default: nothing).

        A flat mapping of names to tensors or JSON values, written into the run's checkpoint
        after every round and handed back to :meth:`load_state` on ``--resume``.
        """
        return {}

    def load_state(self, state: Mapping[str, Any], reference: StateDict | None = None) -> None:
        """Continue from a :meth:`state` saved by a run of the same strategy.

        ``reference`` is the run's model, to check tensors kept per parameter against.

        Raises
        ------
        MergeError
            Entries this method does not keep (the checkpoint is of another strategy), or
            that do not fit ``reference``.
        """
        if state:
            raise MergeError(f"strategy {self.name} keeps no state between rounds; the "
                             f"checkpoint holds {sorted(state)[:3]}")

    def merge(
        self, state_dicts: Iterable[StateDict], weights: Iterable[float],
        nodes: Iterable[str] | None = None, *, reference: StateDict | None = None,
        buffers: frozenset[str] = frozenset(), context: "MergeContext | None" = None,
        arrays: Iterable[Mapping[str, StateDict]] | None = None,
    ) -> Merged:
        """Merge a sequence of models in one call (``begin`` + ``add`` each + ``result``).

        ``arrays``: each model's extra reply records (Fisher's ``fisher``), in the same
        order; given, the models go in through ``add_reply``.

        Raises
        ------
        MergeError
            No models, or models that do not match the first one.
        """
        sds, ws = list(state_dicts), list(weights)
        names = list(nodes) if nodes is not None else [str(i) for i in range(len(sds))]
        if not sds:
            raise MergeError("nothing to merge: no node models")
        if len(ws) != len(sds):
            raise MergeError(f"{len(sds)} models but {len(ws)} weights")
        self.begin(sds[0] if reference is None else reference, buffers, context)
        if arrays is None:  # models alone (methods with node records refuse them in add)
            for sd, w, n in zip(sds, ws, names):
                self.add(sd, w, n)
        else:
            for sd, w, n, extra in zip(sds, ws, names, arrays):
                self.add_reply(sd, w, n, arrays=extra)
        return self.result()


_REGISTRY: dict[str, Callable[[], Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: register a :class:`Strategy` subclass under ``cls.name``.

    Raises
    ------
    ValueError
        No name, or an option whose type differs from the same option of another strategy.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    for opt in cls.options:
        for other in _REGISTRY.values():
            for theirs in other.options:
                if theirs.name == opt.name and theirs.type is not opt.type:
                    raise ValueError(f"{cls.name}'s option {opt.flag} is {opt.type.__name__}; "
                                     f"{other.name} declares it {theirs.type.__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> dict[str, type[Strategy]]:
    """List the registered strategies by name, sorted."""
    return dict(sorted(_REGISTRY.items()))


def strategy_class(name: str) -> type[Strategy]:
    """Return the class registered as ``name``.

    Raises
    ------
    UnknownStrategyError
        With the list of known names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}"
        ) from None


def option_defaults(name: Any) -> dict[str, Any]:
    """Return the options of the strategy registered as ``name`` at their defaults.

    Snake-case option names; ``{}`` for a name no strategy is registered as (the caller's
    own check names it).
    """
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    return {o.name: o.default for o in cls.options} if cls is not None else {}


def get(name: str, **options: Any) -> Strategy:
    """Return a new instance of the strategy registered as ``name``, with ``options`` set.

    Raises
    ------
    UnknownStrategyError
        With the list of known names.
    UnknownOptionError
        An option the strategy does not declare (a ``ValueError``), naming what it takes.
    ValueError
        An option value the strategy refuses (e.g. ``beta`` outside [0, 0.5)).
    """
    return strategy_class(name)(**options)


def load_plugins(group: str) -> list[str]:
    """Import the strategy modules other installed packages declare as entry points.

    A package adds strategies with, in its ``pyproject.toml``::

        [project.entry-points."fedavg.strategies"]
        scaled = "my_package.scaled"      # a module whose @register classes are added

    Returns
    -------
    list of str
        The entry points loaded.

    Raises
    ------
    ImportError
        An entry point's module cannot be imported, naming the entry point.
    """
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=group):
        try:
            ep.load()
        except Exception as exc:
            raise ImportError(f"strategy plugin {ep.name!r} ({ep.value}) failed to load: "
                              f"{exc}") from exc
        loaded.append(ep.name)
    return loaded


def all_options(merge: bool = False) -> dict[str, list[tuple[str, Option]]]:
    """Return every declared option by name, with the strategies declaring it.

    The mapping is ``name -> [(strategy, Option)]``. An option declared by several
    strategies has one type everywhere. With ``merge``, only the strategies that can merge
    saved models (:meth:`Strategy.merges_saved_models`) count, less their node-side options.
    """
    out: dict[str, list[tuple[str, Option]]] = {}
    for sname, cls in available().items():
        for opt in () if merge and not cls.merges_saved_models() else cls.options:
            if not (merge and opt.node_side):
                out.setdefault(opt.name, []).append((sname, opt))
    return dict(sorted(out.items()))
