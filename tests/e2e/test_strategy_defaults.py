"""Every multi-round strategy trains well with its own defaults: no option but --strategy.

The setting is label-skewed digits: 5 nodes, Dirichlet(0.5), 5 rounds, seed 1. A strategy
whose method calls for other node settings declares them (``Strategy.node_defaults``), and
the run applies them unless the user gives the setting.
"""

import json

import pytest
from helpers.cli import run_cli

import strategies
from fedavg.config.values import format_value

pytestmark = pytest.mark.e2e

SETTING = ("--num-nodes", "5", "--partitioner", "dirichlet", "--alpha", "0.5", "--rounds", "5",
           "--seed", "1")
#: Krum keeps one node's model a round (Blanchard et al. 2017 assume alike data on every
#: node): on this skewed split it ends where one node's data leads (0.41). Its run says so.
ONE_NODES_MODEL = {"krum"}
#: FedAdam's default step (server_lr 0.15, tau 0.03) is chosen on MNIST Dirichlet(0.5), 10
#: nodes, 10 rounds: 0.983, where (0.1, 0.01) ends at 0.971 and (0.1, 1e-3), (0.3, 0.01)
#: diverge. Its server momentum starts slowly: on these 5 rounds of digits it is at 0.78 and
#: still rising (0.88 with (0.1, 0.01)).
#: TIES and DARE-TIES are one-shot merges of fine-tuned models; per round, TIES keeps 20 % of
#: each update and DARE-TIES drops half of it before the sign election: 0.79 and 0.65 here
#: (task arithmetic 0.89, DARE 0.90). DARE-TIES swings from round to round (0.72, 0.66,
#: 0.53, 0.65 in rounds 2-5; it ended at 0.70 under the library versions of an earlier install).
LOWER_BAR = {"fedadam": 0.75, "ties": 0.75, "dare-ties": 0.6}
MULTI_ROUND = [name for name, cls in strategies.available().items()
               if not cls.one_shot and name not in ONE_NODES_MODEL]


@pytest.mark.parametrize("name", MULTI_ROUND)
def test_the_strategys_defaults_train_skewed_digits(tmp_path, name, no_leaks):
    out = tmp_path / name
    proc = run_cli("simulate", "--strategy", name, *SETTING, "--output", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] >= LOWER_BAR.get(name, 0.80), (name, summary["accuracy"])
    cls = strategies.strategy_class(name)
    if cls.rounds_note:  # a merge made for one shot says so when it runs per round
        assert f"{name}: {cls.rounds_note}" in " ".join(proc.stdout.split())
    meta = json.loads((out / "model.json").read_text())
    defaults = strategies.strategy_class(name).node_defaults
    for key, value in defaults.items():  # applied, recorded and shown
        assert meta["local_training"][key] == value
        assert f"--{key.replace('_', '-')} {format_value(value)}" in proc.stdout


def test_krum_on_skewed_partitions_says_it_keeps_one_nodes_model(tmp_path, no_leaks):
    proc = run_cli("simulate", "--strategy", "krum", *SETTING, "--rounds", "1",
                   "--output", tmp_path / "krum")
    assert "multi-krum" in proc.stdout and "one node" in proc.stdout
