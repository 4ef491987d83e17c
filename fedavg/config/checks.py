"""The checks of a run's settings (:class:`~fedavg.config.settings.RunConfig`), in order.

:meth:`RunConfig.validate <fedavg.config.settings.RunConfig.validate>` runs them in order
(:data:`CHECKS`) and raises the first problem as a :class:`~fedavg.util.errors.UserError`; the
messages name the command-line flags.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from fedavg.config.rules import first_problem

if TYPE_CHECKING:
    from fedavg.config.settings import RunConfig


def check_data(c: RunConfig) -> str | None:
    """Check the data settings: partitioner, alpha, seed, text limits, column choices."""
    # lazy: this module stays light: `fedavg --help` reads it
    from fedavg.data.partition import partitioner_names

    d = c.data
    if d.partitioner not in partitioner_names():
        return (f"unknown partitioner {d.partitioner!r}; choose one of "
                f"{', '.join(partitioner_names())}")
    if not d.alpha > 0:
        return f"--alpha must be > 0 (got {d.alpha}); try 0.5 for label skew"
    if not math.isfinite(d.alpha):
        return f"--alpha must be finite (got {d.alpha}); try 0.5 for label skew"
    if d.classes_per_node < 1:
        return f"--classes-per-node must be >= 1 (got {d.classes_per_node})"
    if d.partitioner == "natural" and not d.partition_by:
        return "--partitioner natural needs --partition-by COLUMN"
    if problem := first_problem(d):  # the rules declared with the fields (--seed)
        return problem
    if not 0 < d.test_fraction < 1:
        return f"test fraction must be in (0, 1) (got {d.test_fraction})"
    if not 1 <= d.max_tokens <= 8192:
        return f"--max-tokens must be in 1..8192 (got {d.max_tokens})"
    if d.hash_buckets < 2:
        return f"hash-buckets must be >= 2 (got {d.hash_buckets})"
    if d.image_column and d.text_column:
        return "pass --image-column or --text-column, not both"
    return None


def check_train(c: RunConfig) -> str | None:
    """Check the node training settings: each by its declared rule, then the model's."""
    t = c.train
    bad = next((k for k in t.model_args if not (isinstance(k, str) and k.isidentifier())), None)
    if bad is not None:
        return f"--model-arg {bad!r}: argument names must be Python names (hidden=64)"
    if t.pretrained and not t.model.startswith("torchvision:"):
        return ("--pretrained takes a torchvision:NAME model (an hf: folder and minilm, "
                "efficientnet-lite0 start from their own weights; your own builder can take a "
                "--model-arg for it)")
    if t.pretrained not in (None, "default"):
        from pathlib import Path  # lazy: this module stays light

        try:
            path = Path(t.pretrained).expanduser()
        except RuntimeError:  # ~NAME of an unknown user
            return f"--pretrained {t.pretrained}: no such user's folder; give the file's path"
        if not path.is_file():
            what = "not a file" if path.exists() else "no such file"
            return (f"--pretrained {t.pretrained}: {what}; give default (torchvision's "
                    "weights) or a local .safetensors or state-dict file")
    if t.lora_targets is not None and not any(n.strip() for n in t.lora_targets.split(",")):
        return ("--lora-targets needs module names, comma-separated (e.g. query,value); "
                "leave it out for the architecture's default")
    return t.problem() or first_problem(t)  # node options, then the model's (--lora-*)


def check_merge(c: RunConfig) -> str | None:
    """Check the round settings: rounds, nodes, fraction, timeout, SWA, held-out shares."""
    m = c.merge
    if problem := first_problem(m):  # the rules declared with the fields (--compress-down)
        return problem
    if m.compress_down != "none" and c.train.lora_rank:
        return ("--compress-down: a LoRA run already sends the adapted weights down as "
                "low-rank factors and the adapters whole; leave --compress-down out")
    if m.rounds < 1:
        return f"--rounds must be >= 1 (got {m.rounds})"
    if problem := check_privacy(m, c.train.dp_sgd):
        return problem
    if m.num_nodes < 1:
        return f"--num-nodes must be >= 1 (got {m.num_nodes})"
    if not 0 < m.fraction <= 1:
        return f"--fraction must be in (0, 1] (got {m.fraction})"
    if not m.round_timeout > 0:
        return f"--round-timeout must be > 0 seconds (got {m.round_timeout})"
    if m.max_update_norm is not None and not 0 < m.max_update_norm < math.inf:
        return f"--max-update-norm must be > 0 and finite (got {m.max_update_norm})"
    if m.swa_start is not None and not 1 <= m.swa_start <= m.rounds:
        return (f"--swa-start must be a round from 1 to --rounds {m.rounds} "
                f"(got {m.swa_start}); try 3/4 of the rounds")
    for name in ("validation_fraction", "distill_fraction"):
        if not 0 < getattr(m, name) < 0.5:
            return f"--{name.replace('_', '-')} must be in (0, 0.5)"
    return None


def check_privacy(m, dp_sgd: bool = False) -> str | None:
    """Check the DP settings: noise with a clip (node level) or DP-SGD, delta < 1, budget > 0.

    ``m``: the run's ``MergeConfig``; ``dp_sgd``: ``--dp-sgd`` (record level) is on.
    """
    finite = lambda v: v is not None and 0 < v < math.inf  # noqa: E731
    if m.dp_clip is not None and not finite(m.dp_clip):
        return f"--dp-clip must be > 0 and finite (got {m.dp_clip})"
    if not m.dp_noise <= 1000:  # the accountant overflows far beyond; nan too
        return f"--dp-noise must be at most 1000 (got {m.dp_noise})"
    if m.dp_clip is not None and m.dp_clip > 1e6:  # noise of z x C must stay finite
        return f"--dp-clip must be at most 1e6 (got {m.dp_clip})"
    if dp_sgd and m.dp_clip is not None:
        return ("--dp-clip is node-level DP's; with --dp-sgd each sample's gradient is "
                "clipped to --dp-max-grad-norm: leave --dp-clip out (one level of DP a run)")
    if m.dp_clip_on == "node" and (dp_sgd or m.dp_clip is None or not m.dp_noise > 0):
        return ("--dp-clip-on node has the nodes clip node-level DP's updates: give --dp-noise "
                "z and --dp-clip C (and not --dp-sgd)")
    if dp_sgd and not m.dp_noise > 0:
        return ("--dp-sgd needs --dp-noise z, the noise multiplier of each step's clipped "
                "gradients, e.g. --dp-noise 1.1")
    if m.dp_noise > 0 and m.dp_clip is None and not dp_sgd:
        return ("--dp-noise needs --dp-clip C (node level: the L2 norm each node's update is "
                "clipped to, e.g. --dp-clip 1) or --dp-sgd (record level, DP-SGD on the "
                "nodes)")
    if m.dp_delta is not None and not 0 < m.dp_delta < 1:
        return f"--dp-delta must be in (0, 1), e.g. 1e-5 (got {m.dp_delta})"
    if m.dp_epsilon is not None and not finite(m.dp_epsilon):
        return f"--dp-epsilon must be > 0 and finite (got {m.dp_epsilon})"
    if (m.dp_delta is not None or m.dp_epsilon is not None) and not m.dp_noise > 0:
        given = "--dp-epsilon" if m.dp_epsilon is not None else "--dp-delta"
        return (f"{given} needs DP: give --dp-noise z (e.g. 1) with --dp-clip C (node level) "
                "or --dp-sgd (record level); without noise there is no epsilon to account")
    return None


def check_strategy(c: RunConfig) -> str | None:
    """Check the strategy: known, its options, one-shot rules, its node optimizer."""
    import strategies  # lazy: loads torch, which only this path needs

    m = c.merge
    try:
        cls = strategies.strategy_class(m.strategy)
    except strategies.UnknownStrategyError as exc:
        return str(exc)
    unknown = cls.unknown_options(m.options)
    if unknown:
        return unknown
    if cls.one_shot and m.rounds != 1:
        return (f"{m.strategy} is a one-shot merge of fully trained node models: "
                "use --rounds 1 (and --local-epochs to train longer)")
    if cls.one_shot and m.swa_start is not None:
        return (f"--swa-start averages the models of several rounds; {m.strategy} is a "
                "one-shot merge of one round: leave --swa-start out")
    if c.train.dp_sgd:
        if problem := check_dp_sgd(c, cls):
            return problem
    elif m.dp_noise > 0 and not cls.dp_mean:
        usable = ", ".join(n for n, k in strategies.available().items() if k.dp_mean)
        return (f"--dp-noise: {m.strategy}'s merge is not a mean of the node updates, which "
                f"DP-FedAvg's analysis needs; use one of {usable}")
    if m.dp_clip_on == "node" and c.train.lora_rank:
        return ("--dp-clip-on node with --lora-rank: a node's adapters A and B do not bound "
                "the update B A it makes; clip on the coordinator (leave --dp-clip-on out)")
    if m.secure_aggregation and (problem := check_secure_aggregation(c, cls)):
        return problem
    if cls.node_rule is not None and \
            node_value(c.train, "optimizer", cls.node_defaults) not in cls.node_rule.optimizers:
        return (f"{m.strategy}'s update rule assumes {' or '.join(cls.node_rule.optimizers)} "
                f"local steps; use --optimizer {cls.node_rule.optimizers[0]}")
    return None


def check_dp_sgd(c: RunConfig, cls) -> str | None:
    """Check what DP-SGD on the nodes cannot take (:meth:`strategies.Strategy.takes_dp_sgd`).

    ``cls``: the run's strategy class. SAM's second gradient, the logit-adjusted loss's
    label counts and a second gradient clip are refused too.
    """
    import strategies  # lazy: loads torch, which only this path needs

    if not cls.takes_dp_sgd():
        usable = ", ".join(n for n, k in strategies.available().items() if k.takes_dp_sgd())
        return (f"--dp-sgd: {c.merge.strategy} changes how nodes train or sends more of "
                f"their data than their model, outside DP-SGD's noise; use one of {usable}")
    t = c.train
    for name, given, why in (
            ("--sam-rho", t.sam_rho > 0, "takes a second, unclipped gradient"),
            ("--logit-adjust", t.logit_adjust > 0, "uses each node's label counts"),
            ("--clip-grad-norm", t.clip_grad_norm > 0,
             "is replaced by --dp-max-grad-norm, each sample's clip")):
        if given:
            return f"--dp-sgd: {name} {why}; leave it out"
    return None


#: Settings that need each node's update on the coordinator, refused with secure aggregation.
_NEEDS_EACH_UPDATE = (
    ("dp_noise", "node-level DP clipped on the coordinator needs each node's update, which "
                 "--secure-aggregation hides: give --dp-clip-on node (the nodes clip), or"),
    ("max_update_norm", "it measures each node's update, which --secure-aggregation hides"),
    ("save_node_models", "it saves each node's model, which --secure-aggregation hides"),
    ("compress_down", "SecAgg+ sends the round's weights as they are"),
)


def check_secure_aggregation(c: RunConfig, cls) -> str | None:
    """Check a run with ``--secure-aggregation``: its strategy, what combines, SecAgg+'s values.

    Strategy class ``cls`` must declare ``secure_sum``; settings that need each node's
    update, compressed updates and exact LoRA merges are refused; the protocol's values go
    through Flower's own checks (``SecAggPlusWorkflow``).
    """
    import strategies  # lazy: loads torch, which only this path needs

    m, t = c.merge, c.train
    if not cls.secure_sum:
        usable = ", ".join(n for n, k in strategies.available().items() if k.secure_sum)
        return (f"--secure-aggregation: {m.strategy}'s merge needs more than the nodes' "
                f"sample-weighted mean update, all SecAgg+ reveals; use one of {usable}")
    for name, why in _NEEDS_EACH_UPDATE:
        if name == "dp_noise" and (t.dp_sgd or m.dp_clip_on == "node"):
            continue  # DP-SGD, or node-level DP clipped on the nodes: private before masked
        if getattr(m, name) not in (None, False, 0, 0.0, "none"):
            return (f"--{name.replace('_', '-')} with --secure-aggregation: {why}; leave one "
                    "of them out")
    if t.compress != "none":
        return ("--compress with --secure-aggregation: SecAgg+ quantises and masks the update "
                "itself; leave --compress out")
    if t.lora_rank and t.lora_merge == "exact":
        return ("--lora-merge exact merges the nodes' products B_k A_k, not a sum of what "
                "they send; use --lora-merge average with --secure-aggregation")
    if c.nodes_per_round < 2:
        return (f"--secure-aggregation needs at least 2 nodes per round (got "
                f"{c.nodes_per_round}): raise --num-nodes (fedavg coordinator: --min-nodes) "
                "or --fraction")
    most = m.secagg_modulus_range / m.secagg_quantization_range
    if m.secagg_num_shares > 1 and m.secagg_num_shares > most:  # Flower only warns
        return (f"--secagg-num-shares {m.secagg_num_shares:g} is above --secagg-modulus-range "
                f"/ --secagg-quantization-range ({most:g}): the masked sum could overflow; "
                "give fewer shares (or a share of the nodes, at most 1)")
    try:
        secagg_workflow(m)
    except ValueError as exc:
        text = str(exc)
        for name in ("num_shares", "reconstruction_threshold", "max_weight",
                     "quantization_range", "modulus_range", "clipping_range"):
            text = text.replace(f"`{name}`", f"--secagg-{name.replace('_', '-')}")
        return text
    return None


def secagg_workflow(m, timeout: float | None = None):
    """Return Flower's ``SecAggPlusWorkflow`` with a run's SecAgg+ values (``MergeConfig``).

    Raises
    ------
    ValueError
        Values Flower refuses.
    """
    from fedavg.flower_compat import secagg

    # node-level DP clipped on the nodes: each weighs 1 (the count stays on the node)
    weight_one = m.dp_noise > 0 and m.dp_clip is not None and m.dp_clip_on == "node"
    return secagg.workflow(m.secagg_num_shares, m.secagg_reconstruction_threshold,
                           max_weight=1.0 if weight_one else m.secagg_max_weight,
                           clipping_range=m.secagg_clipping_range,
                           quantization_range=m.secagg_quantization_range,
                           modulus_range=m.secagg_modulus_range, timeout=timeout)


def node_value(train, name: str, node_defaults) -> object:
    """Return node setting ``name`` of ``train`` as the nodes train with it.

    Given, its value; else the strategy's node default, else the setting's declared fallback
    (:func:`fedavg.config.settings.node_setting`).
    """
    value = getattr(train, name)
    if value is not None:
        return value
    if name in node_defaults:
        return node_defaults[name]
    return next(f.metadata["fallback"] for f in dataclasses.fields(train) if f.name == name)


#: The checks in the order :meth:`RunConfig.validate` runs them; :func:`check_strategy` runs
#: last, once, as validate builds the strategy (:meth:`RunConfig.build_strategy`).
CHECKS = (check_data, check_train, check_merge)
