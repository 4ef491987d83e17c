"""Config: defaults, flat kebab-case round trip, validation messages."""

import re

import pytest

from fedavg.config.settings import RunConfig
from fedavg.util.errors import UserError


def test_flat_round_trip_and_types():
    cfg = RunConfig().replace(num_nodes="7", alpha="0.25", local_epochs=3, dataset="x")
    assert cfg.merge.num_nodes == 7 and cfg.data.alpha == 0.25 and cfg.train.local_epochs == 3
    flat = cfg.to_flat()
    assert flat["num-nodes"] == 7 and flat["local-epochs"] == 3 and "image-column" not in flat
    assert RunConfig.from_flat(flat) == cfg


def test_nodes_per_round_from_fraction():
    assert RunConfig().replace(num_nodes=10, fraction=0.25).nodes_per_round == 3
    assert RunConfig().replace(num_nodes=10, fraction=0.3).nodes_per_round == 3
    assert RunConfig().replace(num_nodes=1, fraction=0.1).nodes_per_round == 1


@pytest.mark.parametrize(
    "change, option",
    [
        ({"alpha": 0}, "--alpha"),
        ({"alpha": -1.0}, "--alpha"),
        ({"num_nodes": 0}, "--num-nodes"),
        ({"rounds": 0}, "--rounds"),
        ({"fraction": 0}, "--fraction"),
        ({"fraction": 1.5}, "--fraction"),
        ({"lr": 0}, "--lr"),
        ({"momentum": 1.0}, "--momentum"),
        ({"optimizer": "lbfgs"}, "--optimizer"),
        ({"local_epochs": 0}, "--local-epochs"),
        ({"partitioner": "random"}, "partitioner"),
        ({"partitioner": "natural"}, "--partition-by"),
    ],
)
def test_validation_names_the_option(change, option):
    with pytest.raises(UserError, match=option):
        RunConfig().replace(**change).validate()


def test_unknown_and_mistyped_settings():
    with pytest.raises(UserError, match="unknown setting"):
        RunConfig.from_flat({"rounds-per-node": 3})
    with pytest.raises(UserError, match=r"^unknown setting 'round' \(did you mean 'rounds'\?\); "
                                        r"known: alpha, "):
        RunConfig.from_flat({"round": 3})
    with pytest.raises(UserError,
                       match=r"'lokal_epochs' \(did you mean 'local-epochs' or 'local-steps'\?\)"):
        RunConfig.from_flat({"lokal_epochs": 3})
    with pytest.raises(UserError, match=r"^unknown setting 'zzz'; known: "):  # nothing close
        RunConfig.from_flat({"zzz": 3})
    with pytest.raises(UserError, match="expects int"):
        RunConfig.from_flat({"rounds": "many"})


def test_strategy_options_round_trip_through_the_flat_config():
    cfg = RunConfig().replace(strategy="fedadam", server_lr="0.2", tau=0.01)
    assert dict(cfg.merge.options) == {"server_lr": 0.2, "tau": 0.01}
    flat = cfg.to_flat()
    assert flat["server-lr"] == 0.2 and "mu" not in flat  # only options given are kept
    assert RunConfig.from_flat(flat) == cfg
    built = cfg.validate().build_strategy()
    assert (built.server_lr, built.tau) == (0.2, 0.01)
    assert RunConfig().replace(strategy="fedadam").build_strategy().server_lr == 0.15


@pytest.mark.parametrize("change, message", [
    ({"strategy": "fedavg", "mu": 0.1}, "strategy fedavg does not take --mu"),
    ({"strategy": "krum", "beta": 0.2}, "(it takes --num-malicious)"),
    ({"strategy": "nope"}, "unknown strategy 'nope'"),
    ({"strategy": "average"}, "use --rounds 1"),
])
def test_strategy_mistakes_are_caught_by_validate(change, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig().replace(**change).validate()


def test_strategy_option_values_are_checked_when_built():
    with pytest.raises(UserError, match="expects int"):
        RunConfig().replace(strategy="krum", num_malicious="many")
    cfg = RunConfig().replace(strategy="trimmed-mean", beta=0.7)
    with pytest.raises(UserError, match="--beta must be in"):
        cfg.build_strategy()
    with pytest.raises(UserError, match="--beta must be in"):
        cfg.validate()  # every value, the strategy's too


@pytest.mark.parametrize("flat, message", [
    ({"num-nodes": 1.5}, "expects int"),
    ({"num-nodes": True}, "expects int"),
    ({"lr": True}, "expects float"),
    ({"logit-adjust": 2 ** 1100}, r"expects float, got 1358\d{53}\.\.\.$"),  # beyond a float
    ({"save-node-models": 2}, "expects bool"),
    ({"dataset": ""}, "needs a value"),
    ({"num-malicious": 1.5}, "expects int"),
])
def test_from_flat_never_truncates_or_guesses(flat, message):
    with pytest.raises(UserError, match=message):
        RunConfig.from_flat(flat)
    assert RunConfig.from_flat({"num-nodes": 3.0, "image-column": ""}).merge.num_nodes == 3


@pytest.mark.parametrize("settings, words", [
    ({"strategy": "fedprox", "mu": -1}, "fedprox: --mu must be >= 0"),
    ({"strategy": "fedavgm", "server_momentum": 1}, "--server-momentum must be in [0, 1)"),
    ({"strategy": "trimmed-mean", "beta": 0.5}, "--beta must be in [0, 0.5)"),
    ({"strategy": "distill", "rounds": 1, "distill_steps": 0}, "--distill-steps must be >= 1"),
])
def test_validate_checks_the_strategys_own_options(settings, words):
    """``validate()`` says "every value": a strategy's options too, not only at the run."""
    config = RunConfig().replace(**settings)
    with pytest.raises(UserError, match=re.escape(words)):
        config.validate()


def test_finite_number_takes_only_finite_json_numbers():
    """Model files' and summaries' numbers: one rule for checkpoint and report."""
    from fedavg.config.values import finite_number

    assert all(finite_number(v) for v in (0, -3, 1.5, 1e308))
    assert not any(finite_number(v) for v in (True, False, float("nan"), float("inf"),
                                              -float("inf"), "1", None, [1]))


def test_a_strategys_node_defaults_apply_unless_given():
    import strategies
    from fedavg.config.settings import LocalTraining

    feddyn = dict(strategies.strategy_class("feddyn").node_defaults)
    assert feddyn["momentum"] == 0.0  # the paper's plain SGD steps
    run = RunConfig().replace(strategy="feddyn")
    assert run.local_training().momentum == 0.0 and run.applied_node_defaults() == feddyn
    given = RunConfig().replace(strategy="feddyn", momentum=0.9)
    assert given.local_training().momentum == 0.9  # the user's value wins
    assert "momentum" not in given.applied_node_defaults()
    # the fallback for a strategy without node defaults, also after switching strategy
    back = run.replace(strategy="fedavg")
    assert back.local_training().momentum == 0.9 and back.local_training().lr == 0.05
    assert back.applied_node_defaults() == {}
    # a node receiving no value trains with the declared fallback
    assert LocalTraining().resolved().momentum == 0.9


def test_every_declared_node_default_is_a_node_setting_it_accepts():
    import dataclasses

    import strategies
    from fedavg.config.settings import LocalTraining

    declared = {f.name: f for f in dataclasses.fields(LocalTraining)}
    for name, cls in strategies.available().items():
        for key, value in cls.node_defaults.items():
            f = declared[key]  # a node training setting
            assert "fallback" in f.metadata, f"{name}: --{key} is not a node_setting"
            assert f.metadata["rule"].problem(key, value) is None, (name, key, value)


def test_settings_that_act_only_with_another_are_noted_once():
    from fedavg.config.setting_use import unused_train_notes

    plain = RunConfig().replace(lora_alpha=32.0, lora_merge="average", optimizer="adam",
                                momentum=0.5)
    notes = unused_train_notes(plain.train)
    assert notes == ["--lora-alpha 32.0 does nothing without --lora-rank R (LoRA adapters)",
                     "--lora-merge average does nothing without --lora-rank R (LoRA adapters)",
                     "--momentum 0.5 does nothing without --optimizer sgd"]
    used = RunConfig().replace(lora_rank=8, lora_alpha=32.0, momentum=0.5)
    assert unused_train_notes(used.train) == []
    assert unused_train_notes(RunConfig().replace(optimizer="adam").train) == []


def test_a_weights_file_is_kept_absolute_and_empty_lora_targets_are_refused(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = RunConfig().replace(model="torchvision:resnet18", pretrained="w.safetensors")
    assert config.train.pretrained == str(tmp_path / "w.safetensors")  # resumable elsewhere
    assert RunConfig().replace(pretrained="default").train.pretrained == "default"
    with pytest.raises(UserError, match="--lora-targets needs module names"):
        RunConfig().replace(model="minilm", lora_rank=4, lora_targets=" , ").validate()
