"""The round's train settings on the wire: one schema, both directions."""

from dataclasses import fields

import pytest
from flwr.app import ConfigRecord

from fedavg.config.settings import LocalTraining, RunConfig
from fedavg.node import keys
from fedavg.node.wire import TrainSettings


def _settings(**change):
    values = dict(model={"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10,
                         "args": {}},
                  input={"kind": "image", "shape": [1, 8, 8]}, classes=["a", "b"], seed=7,
                  local=LocalTraining(local_epochs=3, batch_size=16, lr=0.1, momentum=0.5,
                                      weight_decay=1e-4))
    values.update(change)
    values["local"] = values["local"].resolved()  # as a run sends it: every setting filled
    return TrainSettings(**values)


def test_record_round_trip_with_kebab_keys():
    sent = _settings(proximal_mu=0.25)
    record = sent.to_record()
    assert record["local-epochs"] == 3 and record["proximal-mu"] == 0.25
    assert record["classes"] == '["a", "b"]'  # JSON text on the wire
    assert keys.SERVER_ROUND not in record  # Flower's strategy adds the round
    record[keys.SERVER_ROUND] = 4
    got = TrainSettings.from_record(record)
    assert got == _settings(proximal_mu=0.25, server_round=4)
    assert isinstance(got.local.local_epochs, int) and isinstance(got.local.lr, float)
    # every node training option travels, as LocalTraining declares it
    assert {f.name.replace("_", "-") for f in fields(LocalTraining)} <= set(record.keys())


def test_missing_entry_is_named_and_a_missing_node_option_takes_its_declared_default():
    record = _settings().to_record()
    del record["classes"]
    with pytest.raises(ValueError, match="'classes'"):
        TrainSettings.from_record(record)
    record = _settings().to_record()
    del record["batch-size"]  # a coordinator that does not know the option: its default
    assert TrainSettings.from_record(record).local.batch_size == LocalTraining().batch_size
    optional = ConfigRecord({k: v for k, v in _settings().to_record().items()
                             if k != "proximal-mu"})
    assert TrainSettings.from_record(optional).proximal_mu == 0.0


def test_for_run_takes_the_strategy_node_settings():
    import strategies

    config = RunConfig().replace(strategy="fedprox", mu=0.3, lr=0.02, local_epochs=2, seed=5)
    meta = {"model": {"name": "mlp"}, "input": {}, "classes": ["x"]}
    got = TrainSettings.for_run(config, meta, config.build_strategy())
    assert (got.proximal_mu, got.local.lr, got.local.local_epochs, got.seed) == (0.3, 0.02, 2, 5)
    plain = TrainSettings.for_run(RunConfig(), meta, strategies.get("fedavg"))
    assert plain.proximal_mu == 0.0


@pytest.mark.parametrize("key, value, message", [
    ("local-epochs", 0, "'local-epochs' must be >= 1"),
    ("batch-size", -5, "'batch-size' must be >= 1"),
    ("lr", float("inf"), "'lr' must be > 0 and finite"),
    ("momentum", 5.0, "'momentum' must be in [0, 1)"),
    ("optimizer", "lbfgs", "'optimizer' must be one of sgd, adam"),
    ("lr-schedule", "cyclic", "'lr-schedule' must be one of constant, cosine, step"),
    ("local-epochs", 1.7, "'local-epochs' is not int"),
    ("lr", "fast", "'lr' is not float"),
    ("model", "{bad json", "'model' is not JSON"),
    ("classes", "5", "'classes' must be a list of class names"),
])
def test_a_malformed_round_config_is_refused_naming_the_entry(key, value, message):
    record = _settings().to_record()
    record[key] = value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        TrainSettings.from_record(record)


def test_the_round_carries_the_strategys_node_defaults_and_the_users_own_values():
    import strategies

    meta = {"model": {"name": "mlp"}, "input": {}, "classes": ["a", "b"]}
    run = RunConfig().replace(strategy="feddyn")
    strategy = strategies.get("feddyn")
    sent = TrainSettings.from_record(TrainSettings.for_run(run, meta, strategy).to_record())
    assert sent.local.momentum == 0.0 and sent.local.lr == run.local_training().lr
    mine = RunConfig().replace(strategy="feddyn", momentum=0.5)
    sent = TrainSettings.from_record(TrainSettings.for_run(mine, meta, strategy).to_record())
    assert sent.local.momentum == 0.5
