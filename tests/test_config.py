"""Config: defaults, flat kebab-case round trip, validation messages."""

import pytest

from fedavg.config import RunConfig
from fedavg.errors import UserError


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
    with pytest.raises(UserError, match="expects int"):
        RunConfig.from_flat({"rounds": "many"})
