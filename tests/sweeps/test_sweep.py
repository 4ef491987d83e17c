"""Sweeps: config parsing, point names, resume decisions, running, stopping and resuming.

The end-to-end ones (marker ``e2e``) run ``fedavg sweep`` for real.
"""

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import ROOT, assert_one_error_line, engine_processes, run_cli
from helpers.sweeps import fake_run, sweep_record, toml
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.config.settings import RunConfig
from fedavg.sweeps.grid import load_sweep
from fedavg.sweeps.plan import KEEP_FAILED, RERUN, RESUME, RUN, SKIP, plan, select
from fedavg.sweeps.runner import cpu_note, last_error
from fedavg.util.errors import UserError

TINY = ROOT / "experiments" / "configs" / "tiny.toml"


BAD = [
    ("[base]\nfoo = 1\n[grid]\nseed = [0, 1]\n", "[base]: unknown setting 'foo'"),
    ("[[points]]\nfoo = 1\n", "[[points]] 1: unknown setting 'foo'"),
    ("[grid]\nalpha = [0.5, \"x\"]\n", "[grid]: setting 'alpha' expects float, got 'x'"),
    ("[grid]\nseed = [[0, 1]]\n", "[grid] seed holds a list; each value in a grid list is a "
                                 "single value"),
    ("[grid]\noutput = [\"x\"]\n", "[grid] output: the sweep sets --output itself"),
    ("[base]\nrounds = \"ten\"\n[grid]\nseed = [0, 1]\n", "setting 'rounds' expects int"),
    ("[base]\nrounds = 2.5\n[grid]\nseed = [0, 1]\n", "setting 'rounds' expects int"),
    ("[base]\ndataset = 5\n[grid]\nseed = [0, 1]\n", "[base] dataset expects a string"),
    ("[grid]\nseed = []\n", "[grid] seed is an empty list"),
    ("[grid]\nseed = 1\n", "[grid] seed must be a list of values"),
    ("[grid]\nseed = [0, 0]\n", "[grid] seed lists a value twice"),
    ("[base]\nrounds = 2\n", "no points"),
    ("", "no points"),
    ("[sweep]\nx = 1\n", "unknown key 'sweep'"),
    ("points = [1, 2]\n", "points must be tables"),
    ("[base]\nseed = [0, 1]\n", "[base] seed is a list, not a single value"),
    ("[base]\nseed = 0\n[grid]\nseed = [0, 1]\n", "[grid] seed is also set in [base]"),
    ("[base]\nnum-nodes = 2\nnum_nodes = 5\n[grid]\nseed = [0, 1]\n",
     "[base] sets num-nodes twice (num-nodes and num_nodes); keep one"),
    ("[grid]\nlocal_epochs = [1]\nlocal-epochs = [2]\n",
     "[grid] sets local-epochs twice (local_epochs and local-epochs); keep one"),
    ("[[points]]\nseed = 1\n[[points]]\nrounds = 1\nrounds_ = 2\nROUNDS = 3\n",
     "[[points]] 2"),
    ("[base]\noutput = \"x\"\n[grid]\nseed = [0, 1]\n", "[base] output: the sweep sets"),
    ("[base]\ntest-fraction = 0.3\n[grid]\nseed = [0, 1]\n",
     "[base] test-fraction is not an option of `fedavg simulate`"),
    ("[base]\ncpus-per-node = \"two\"\n[grid]\nseed = [0, 1]\n",
     "[base] cpus-per-node expects a number"),
    ("[grid]\nalpha = [0.5, -1.0]\n", "point alpha=-1.0: --alpha must be > 0"),
    ("[base]\nmu = 0.1\n[grid]\nstrategy = [\"fedavg\", \"fedprox\"]\n",
     "point strategy=fedavg: strategy fedavg does not take --mu"),
    ("[base]\nstrategy = \"fedprox\"\n[grid]\nmu = [0.1, -1.0]\n", "point mu=-1.0: fedprox:"),
    ("[grid]\nstrategy = [\"nope\", \"fedavg\"]\n", "point strategy=nope: unknown strategy"),
    ("[grid]\nseed = [0, 1]\n[[points]]\nseed = 1\n", "[[points]] entry 1 (seed=1_"),
    ("[grid]\nseed = [0, 1]\n[[points]]\nseed = 1\n",
     "has the same settings as grid point seed=1_"),
    ("[[points]]\nseed = 1\n[[points]]\nseed = 2\n[[points]]\nseed = 1\n",
     "[[points]] entry 3 (seed=1_"),
    ("[[points]]\nseed = 1\n[[points]]\nseed = 2\n[[points]]\nseed = 1\n",
     "has the same settings as [[points]] entry 1 (seed=1_"),
    # a strategy option spelled out at its default is the run that leaves it out
    ("[base]\nstrategy = \"fedprox\"\n[[points]]\nseed = 0\n[[points]]\nmu = 0.01\n",
     "[[points]] entry 2 (mu=0.01) has the same settings"),
    ("[base]\nstrategy = \"fedprox\"\n[[points]]\nseed = 0\n[[points]]\nmu = 0.01\n",
     "has the same settings as [[points]] entry 1 (base)"),
    ("[grid\nseed = [0]\n", "is not valid TOML"),
    # every invalid point is named, grouped by what is wrong with it
    ("[grid]\nalpha = [0.5, -1.0]\nseed = [0, 1, 2, 3]\n",
     "4 of 8 points are invalid: --alpha must be > 0 (got -1.0); try 0.5 for label skew "
     "(points alpha=-1.0_seed=0, alpha=-1.0_seed=1, alpha=-1.0_seed=2 and 1 more)"),
    ("[grid]\nalpha = [0.5, -1.0, -2.0]\n",
     "2 of 3 points are invalid: --alpha must be > 0 (got -1.0); try 0.5 for label skew "
     "(point alpha=-1.0); --alpha must be > 0 (got -2.0)"),
    ("[grid]\nalpha = [0.5, -1.0]\nstrategy = [\"nope\", \"fedavg\"]\n",
     "3 of 4 points are invalid: unknown strategy"),
]


def test_model_args_is_a_table_of_builder_arguments(tmp_path):
    path = toml(tmp_path, '[base]\nmodel = "mlp"\n[grid]\nmodel-args = [{hidden = 16}, '
                          '{hidden = 32, act = "64"}]\n')
    sweep = load_sweep(path)
    assert [p.name for p in sweep.points] == ["model-args=hidden-16",
                                              "model-args=hidden-32-act-64"]
    assert sweep.points[1].config.train.model_args == {"hidden": 32, "act": "64"}
    args = sweep.points[1].simulate_args()
    assert args[-2:] == ["--model-arg=hidden=32", '--model-arg=act="64"']  # "64" stays text
    from fedavg.models.sources import parse_model_args

    assert parse_model_args([a.split("=", 1)[1] for a in args[-2:]]) == {"hidden": 32,
                                                                         "act": "64"}
    for text, message in (('model-args = "hidden=4"', "is a table of the model builder's "
                           "arguments, e.g. model-args = {hidden = 64}"),
                          ("model-args = {hidden = [1, 2]}", "hidden = [1, 2]; each argument"),
                          ('model-args = {"1x" = 3}', "--model-arg '1x': argument names must "
                           "be Python names")):
        with pytest.raises(UserError, match=re.escape(message)):
            load_sweep(toml(tmp_path, f"[base]\n{text}\n[grid]\nseed = [0, 1]\n", "b.toml"))


@pytest.mark.parametrize("text, message", BAD)
def test_every_bad_config_is_one_line_naming_the_key(tmp_path, text, message):
    path = toml(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_sweep(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_missing_config_is_one_line(tmp_path):
    with pytest.raises(UserError, match="sweep config .*nope.toml not found"):
        load_sweep(tmp_path / "nope.toml")


def test_the_grid_is_the_cartesian_product_named_by_what_varies():
    sweep = load_sweep(TINY)
    assert [p.name for p in sweep.points] == [
        "strategy=fedavg_seed=0", "strategy=fedavg_seed=1",
        "strategy=fedavgm_seed=0", "strategy=fedavgm_seed=1"]
    assert sweep.varying == ("strategy", "seed")
    assert sweep.shared() == {"dataset": "digits", "num-nodes": 3, "rounds": 2}
    point = sweep.points[3]
    assert point.settings == {"dataset": "digits", "num-nodes": 3, "rounds": 2,
                              "strategy": "fedavgm", "seed": 1}
    assert point.config == RunConfig().replace(dataset="digits", num_nodes=3, rounds=2,
                                               strategy="fedavgm", seed=1)
    assert [p.name for p in load_sweep(TINY).points] == [p.name for p in sweep.points]


def test_the_experiment_configs_load():
    configs = ROOT / "experiments" / "configs"
    compare = load_sweep(configs / "compare_strategies.toml")
    assert [p.name for p in compare.points] == [
        "strategy=fedavg", "strategy=fedprox", "strategy=fedadam", "strategy=fedmedian"]
    assert all(p.config.data.partitioner == "dirichlet" and p.config.merge.num_nodes == 10
               for p in compare.points)
    mnist = load_sweep(configs / "mnist_fedavg.toml")
    assert [p.name for p in mnist.points] == ["partitioner=iid", "partitioner=dirichlet"]
    assert mnist.points[1].config.data.alpha == 0.5
    rules = load_sweep(configs / "node_rules.toml")  # what .ci/run sweeps
    assert [p.config.merge.strategy for p in rules.points] == [
        "scaffold", "fednova", "moon", "feddyn"]
    assert {(p.config.data.dataset, p.config.merge.rounds, p.config.merge.num_nodes)
            for p in rules.points} == {("digits", 3, 3)}
    assert sorted(p.name for p in configs.glob("*.toml")) == [
        "compare_strategies.toml", "methods_quick.toml", "mnist_fedavg.toml", "niid.toml",
        "niid_quick.toml", "node_rules.toml", "tiny.toml"]


def test_the_methods_config_is_niid_quick_cifar_dirichlet_for_six_methods_with_and_without_recipe():
    configs = ROOT / "experiments" / "configs"
    methods = [p.config for p in load_sweep(configs / "methods_quick.toml").points]
    quick = [p.config for p in load_sweep(configs / "niid_quick.toml").points
             if p.config.data.dataset.endswith("cifar10")
             and p.config.data.partitioner == "dirichlet" and p.config.merge.strategy == "fedavg"]
    assert len(quick) == 1
    same = lambda c: (c.data.dataset, c.data.partitioner, c.data.alpha, c.merge.num_nodes,  # noqa: E731
                      c.merge.fraction, c.merge.rounds, c.train.local_epochs,
                      c.train.batch_size, c.train.lr, c.train.momentum, c.train.model)
    assert {same(c) for c in methods} == {same(quick[0])}
    names = ["fedavg", "fedprox", "scaffold", "fednova", "moon", "feddyn"]
    assert [(c.merge.strategy, c.train.augment, c.train.lr_schedule) for c in methods] == \
        [(n, False, "constant") for n in names] + [(n, True, "cosine") for n in names]


def test_the_niid_bench_configs_hold_its_settings_and_a_quick_variant():
    configs = ROOT / "experiments" / "configs"
    full, quick = load_sweep(configs / "niid.toml"), load_sweep(configs / "niid_quick.toml")
    assert [p.name for p in full.points] == [p.name for p in quick.points]
    federated = [p.config for p in full.points if p.config.merge.num_nodes == 10]
    assert {(c.data.dataset.rsplit("/", 1)[-1], c.data.partitioner, c.merge.strategy)
            for c in federated} == {(d, part, s) for d in ("mnist", "cifar10")
                                    for part in ("iid", "dirichlet")
                                    for s in ("fedavg", "fedprox")} \
        | {("cifar10", "dirichlet", "scaffold")}
    for c in [p.config for p in full.points]:
        assert (c.merge.rounds, c.train.local_epochs, c.train.batch_size, c.train.lr,
                c.train.momentum, c.train.model, c.merge.fraction) == \
            (50, 10, 64, 0.01, 0.9, "cnn-cifar", 1.0)
        assert c.data.alpha == 0.5 and c.merge.options.get("mu", 0.01) == 0.01
    assert all((p.config.merge.rounds, p.config.train.local_epochs) == (10, 5)
               for p in quick.points)
    centralised = [p for p in full.points if p.config.merge.num_nodes == 1]
    assert len(centralised) == 2 and all(p.cpus_per_node == 2 for p in centralised)


def test_only_keeps_matching_points_by_value_or_name_part():
    spec = load_sweep(ROOT / "experiments" / "configs" / "niid.toml")
    pair = select(spec, ["dataset=cifar10", "partitioner=dirichlet"])
    assert [p.name for p in pair.points] == [
        "num-nodes=10_dataset=cifar10_partitioner=dirichlet_strategy=fedavg",
        "num-nodes=10_dataset=cifar10_partitioner=dirichlet_strategy=fedprox_mu=0.01",
        "num-nodes=10_dataset=cifar10_partitioner=dirichlet_strategy=scaffold"]
    assert len(select(spec, ["dataset=../shared/data/mnist", "num-nodes=1"]).points) == 1
    assert select(spec, []).points == spec.points
    # numbers match as numbers: the config's 2 is the point's 2.0, mu=1e-2 is 0.01
    assert len(select(spec, ["cpus-per-node=2"]).points) == 2
    assert len(select(spec, ["mu=1e-2", "fraction=1"]).points) == 4
    for only, message in ((["strategy"], "write KEY=VALUE"), (["foo=1"], "sets 'foo'"),
                          (["strategy=moon"], "no point")):
        with pytest.raises(UserError, match=message):
            select(spec, only)


def test_only_matches_a_strategy_option_left_at_its_default(tmp_path):
    """A point's value is the one it runs with: fedprox without mu runs with mu 0.01."""
    spec = load_sweep(toml(tmp_path, """
[grid]
strategy = ["fedavg", "fedprox"]
[[points]]
strategy = "fedprox"
mu = 0.1
"""))
    assert [p.name for p in select(spec, ["mu=0.01"]).points] == ["strategy=fedprox"]
    assert [p.name for p in select(spec, ["mu=0.1"]).points] == ["strategy=fedprox_mu=0.1"]


def test_grid_and_points_together_and_only_varying_keys_in_names(tmp_path):
    sweep = load_sweep(toml(tmp_path, """
[base]
rounds = 3
[grid]
strategy = ["fedavg", "fedprox"]
local_epochs = [2]
[[points]]
strategy = "fedadam"
server-lr = 0.1
"""))
    # points sit on [base] only, so local-epochs varies: 2 in the grid, 1 (default) here
    assert [p.name for p in sweep.points] == [
        "strategy=fedavg_local-epochs=2", "strategy=fedprox_local-epochs=2",
        "strategy=fedadam_local-epochs=1_server-lr=0.1"]
    assert dict(sweep.points[2].config.merge.options) == {"server_lr": 0.1}
    assert sweep.shared() == {"rounds": 3}
    one_value = load_sweep(toml(tmp_path, "[grid]\nrounds = [3]\nseed = [0, 1]\n", "b.toml"))
    assert [p.name for p in one_value.points] == ["seed=0", "seed=1"]
    assert all(p.config.merge.rounds == 3 for p in one_value.points)


def test_points_only_and_default_values_do_not_make_a_setting_vary(tmp_path):
    sweep = load_sweep(toml(tmp_path, """
[[points]]
partitioner = "iid"
[[points]]
partitioner = "dirichlet"
alpha = 0.5
"""))
    assert [p.name for p in sweep.points] == ["partitioner=iid", "partitioner=dirichlet"]


def test_names_are_filesystem_safe_and_unique(tmp_path):
    sweep = load_sweep(toml(tmp_path, """
[grid]
dataset = ["data/a/mnist", "data/b/mnist", "../data/cifar 10/", "x:y*z"]
lr = [0.1, 1e-05]
"""))
    names = [p.name for p in sweep.points]
    assert len(set(names)) == len(names) == 8
    assert "dataset=cifar-10_lr=0.1" in names and "dataset=x-y-z_lr=1e-05" in names
    mnist = [n for n in names if n.startswith("dataset=mnist_lr=0.1_")]
    assert len(mnist) == 2  # same last path part: a hash of the settings tells them apart
    for name in names:
        assert all(c.isalnum() or c in "._+-=" for c in name), name
        assert not name.startswith(".")
    assert names == [p.name for p in load_sweep(tmp_path / "sweep.toml").points]


def test_simulate_command_line_of_a_point(tmp_path):
    sweep = load_sweep(toml(tmp_path, """
[base]
save-node-models = true
cpus-per-node = 2
lr = 1
[grid]
seed = [0, 1]
"""))
    assert sweep.points[1].simulate_args() == [
        "--save-node-models", "--cpus-per-node=2.0", "--lr=1.0", "--seed=1"]
    assert sweep.points[1].cpus_per_node == 2.0


def _finish(folder: Path, config: RunConfig, wall_s: float = 5.0) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"accuracy": 0.9, "wall_s": wall_s,
                                                     "config": config.as_dict()}))


def test_plan_skips_finished_reruns_half_finished_keeps_failed(tmp_path):
    sweep = load_sweep(TINY)
    out = tmp_path / "out"
    done, half, failed, fresh = sweep.points
    _finish(out / done.name, done.config)
    (out / half.name).mkdir(parents=True)
    (out / half.name / "metrics.jsonl").write_text("{}\n")
    (out / "sweep.json").write_text(json.dumps({"points": [
        {"name": failed.name, "settings": failed.settings, "status": "failed",
         "exit_code": 2, "error": "error: boom", "wall_s": 3.0},
        {"name": fresh.name, "settings": {**fresh.settings, "rounds": 9}, "status": "failed"},
    ]}))
    actions = [p.action for p in plan(sweep, out)]
    assert actions == [SKIP, RERUN, KEEP_FAILED, RUN]
    assert plan(sweep, out)[2].record == {"exit_code": 2, "error": "error: boom", "wall_s": 3.0}
    assert [p.action for p in plan(sweep, out, retry_failed=True)] == [SKIP, RERUN, RUN, RUN]


ROUND_ONE = {"round": 1, "accuracy": 0.5, "loss": 1.0, "train_loss": 1.2, "num_nodes": 3,
             "num_failed": 0, "wall_s": 1.0, "train_s": 0.2}


def test_plan_resumes_a_stopped_point_with_a_checkpoint_of_its_settings(tmp_path):
    import torch

    import strategies
    from fedavg.run import resume

    sweep = load_sweep(TINY)
    out = tmp_path / "out"
    same, other, broken, more = sweep.points
    for point, config in ((same, same.config), (other, other.config.replace(lr=0.5)),
                          (broken, broken.config), (more, more.config.replace(rounds=9))):
        folder = out / point.name
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("{}\n")
        ckpt = resume.capture(1, {"w": torch.zeros(2)}, config,
                              strategies.get(config.merge.strategy), [ROUND_ONE], [])
        resume.save(folder, ckpt)
    (out / broken.name / resume.CHECKPOINT).write_bytes(b"not a checkpoint")
    # a round of other settings is never thrown away (it was run again with --overwrite)
    with pytest.raises(UserError, match=rf"{other.name} holds a run stopped half-way with "
                                        r"other settings \(lr 0.5 there, 0.05 here\); remove "
                                        r"it or sweep into another --output"):
        plan(sweep, out)
    shutil.rmtree(out / other.name)
    planned = plan(sweep, out)
    # the last one was stopped after round 1 of 9; the config now asks for 2: it goes on
    assert [p.action for p in planned] == [RESUME, RUN, RERUN, RESUME]
    assert planned[0].record == planned[3].record == {"round": 1}
    dry = run_cli("sweep", TINY, "--output", out, "--dry-run")
    assert dry.stdout.count("go on after round 1") == 2
    assert dry.stdout.count("run again from scratch") == 1


def test_a_finished_point_whose_dataset_path_is_written_otherwise_is_skipped(tmp_path,
                                                                            monkeypatch):
    """`./data/d.csv` for `data/d.csv` was a raised `rounds`: the resume failed every time."""
    import torch

    import strategies
    from fedavg.run import resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.csv").write_text("a,label\n1,0\n2,1\n")
    sweeps = []
    for name, path in (("a.toml", "data/d.csv"), ("b.toml", "./data/d.csv")):
        (tmp_path / name).write_text(f'[base]\ndataset = "{path}"\nrounds = 1\n'
                                     '[grid]\nseed = [0]\n')
        sweeps.append(load_sweep(tmp_path / name))
    point = sweeps[0].points[0]
    folder = tmp_path / "out" / point.name
    folder.mkdir(parents=True)
    config = point.config.from_flat(resume.absolute_paths(point.config.to_flat()))
    resume.save(folder, resume.capture(1, {"w": torch.zeros(2)}, config,
                                       strategies.get("fedavg"), [ROUND_ONE], []))
    (folder / "summary.json").write_text(json.dumps({"config": point.config.as_dict()}))
    assert [p.action for p in plan(sweeps[0], tmp_path / "out")] == [SKIP]
    assert [p.action for p in plan(sweeps[1], tmp_path / "out")] == [SKIP]


@pytest.mark.parametrize("record", ['{"points": null}', '{"points": "abc"}',
                                    '{"points": [1, 2]}', '{"points": [{"name": ["x"]}]}'])
def test_a_sweep_record_of_another_shape_is_ignored(tmp_path, record):
    """It was a traceback (TypeError, AttributeError) in every sweep into the folder."""
    (tmp_path / "sweep.json").write_text(record)
    assert [p.action for p in plan(load_sweep(TINY), tmp_path)] == [RUN] * 4


def test_points_left_out_by_only_stay_in_the_record(tmp_path):
    from fedavg.sweeps.runner import Runner

    whole = load_sweep(TINY)
    out = tmp_path / "out"
    chosen = select(whole, ["seed=0"])
    for point in chosen.points:
        _finish(out / point.name, point.config)
    planned = plan(chosen, out)
    names = {p.point.name for p in planned}
    left_out = [p for p in plan(whole, out) if p.point.name not in names]
    assert Runner(chosen, planned, out, 1, left_out=left_out).run() == 0
    record = {r["name"]: r["status"] for r in _record_points(out)}
    assert record == {p.name: ("skipped" if p.name in names else "pending")
                      for p in whole.points}


def _record_points(out: Path) -> list[dict]:
    return json.loads((out / "sweep.json").read_text())["points"]


def test_plan_skips_a_finished_run_made_before_a_setting_existed(tmp_path):
    sweep = load_sweep(TINY)
    point = sweep.points[0]
    config = point.config.as_dict()
    del config["train"]["augment"], config["train"]["lr_schedule"]  # older than the recipe
    (tmp_path / point.name).mkdir()
    (tmp_path / point.name / "summary.json").write_text(json.dumps({"config": config}))
    assert plan(sweep, tmp_path)[0].action == SKIP


def test_plan_skips_a_finished_run_its_privacy_budget_cut_short(tmp_path):
    """A second run of a finished sweep skips a point --dp-epsilon ended early.

    Its summary records the rounds it trained; resuming it would meet a spent budget.
    """
    from fedavg.run import privacy

    path = toml(tmp_path, "[base]\nnum-nodes = 10\nrounds = 8\ndp-clip = 1.0\n"
                          "dp-epsilon = 6.0\n[grid]\ndp-noise = [2.0, 20.0]\n")
    sweep = load_sweep(path)
    out = tmp_path / "out"
    for point in sweep.points:  # as `fedavg simulate` records them
        cut, _ = privacy.within_budget(point.config)
        (out / point.name).mkdir(parents=True)
        (out / point.name / "summary.json").write_text(json.dumps({"config": cut.as_dict()}))
    assert [privacy.within_budget(p.config)[0].merge.rounds for p in sweep.points] == [6, 8]
    assert [p.action for p in plan(sweep, out)] == [SKIP, SKIP]


def _finish_with_checkpoint(folder: Path, config: RunConfig) -> None:
    import torch

    import strategies
    from fedavg.run import resume

    _finish(folder, config)
    rounds = config.merge.rounds
    resume.save(folder, resume.capture(rounds, {"w": torch.zeros(2)}, config,
                                       strategies.get(config.merge.strategy),
                                       [{**ROUND_ONE, "round": r + 1} for r in range(rounds)],
                                       []))


def test_runs_of_points_a_config_edit_renamed_are_found_and_moved(tmp_path):
    """A new varying key renames every point: their runs were trained again.

    The old sweep varied the seed only; the new one the strategy too, at fedavg in every
    old run. A finished run and one stopped half-way are found in their old folders (the
    dry run reads them there) and moved to the new names when the sweep runs.
    """
    old = load_sweep(toml(tmp_path, '[base]\ndataset = "digits"\nnum-nodes = 3\n'
                                    'rounds = 2\n[grid]\nseed = [0, 1]\n', "old.toml"))
    new = load_sweep(TINY)
    out = tmp_path / "out"
    seed0, seed1 = old.points
    assert (seed0.name, seed1.name) == ("seed=0", "seed=1")
    _finish(out / seed0.name, seed0.config)
    half = seed1.config.replace(rounds=2)  # stopped after round 1 of 2
    (out / seed1.name).mkdir()
    import torch

    import strategies
    from fedavg.run import resume

    resume.save(out / seed1.name, resume.capture(
        1, {"w": torch.zeros(2)}, half.from_flat(resume.absolute_paths(half.to_flat())),
        strategies.get("fedavg"), [ROUND_ONE], []))
    (out / "notes").mkdir()  # the user's folder: no run, left alone
    shutil.copytree(out / seed0.name, out / "my_best")  # the user's copy: never taken
    (out / "sweep.json").write_text(json.dumps({"points": [{"name": "seed=0"},
                                                           {"name": "seed=1"}]}))
    dry = {p.point.name: p for p in plan(new, out)}
    assert [n for n, p in dry.items() if "renamed_from" in p.record] == [
        "strategy=fedavg_seed=0", "strategy=fedavg_seed=1"]
    assert dry["strategy=fedavg_seed=0"].action == SKIP
    assert dry["strategy=fedavg_seed=0"].record["renamed_from"] == "seed=0"
    assert (dry["strategy=fedavg_seed=1"].action, dry["strategy=fedavg_seed=1"].record) == (
        RESUME, {"round": 1, "renamed_from": "seed=1"})
    assert {p.action for n, p in dry.items() if "fedavgm" in n} == {RUN}
    assert sorted(f.name for f in out.iterdir()) == [  # a dry run moves nothing
        "my_best", "notes", "seed=0", "seed=1", "sweep.json"]
    # --only: a folder named by a point left out is that point's, never another's
    kept = plan(select(new, ["strategy=fedavg", "seed=0"]), out, names=["seed=0"])
    assert [(p.action, p.record) for p in kept] == [(RUN, {})]
    moved = {p.point.name: p.action for p in plan(new, out, move=True)}
    assert sorted(f.name for f in out.iterdir()) == [
        "my_best", "notes", "strategy=fedavg_seed=0", "strategy=fedavg_seed=1", "sweep.json"]
    assert moved["strategy=fedavg_seed=0"] == SKIP and moved["strategy=fedavg_seed=1"] == RESUME
    assert [p.record for p in plan(new, out)][:2] == [{"wall_s": 5.0}, {"round": 1}]


def test_a_renamed_point_is_found_with_rounds_raised_and_its_default_option_written(tmp_path):
    """Rounds raised and ``mu = 0.01`` written out with the rename: found and trained on.

    It was trained anew; in place, it was refused ("options  there, mu=0.01 here").
    """
    old = load_sweep(toml(tmp_path, '[base]\ndataset = "digits"\nstrategy = "fedprox"\n'
                                    'rounds = 1\n[grid]\nseed = [0, 1]\n', "old.toml"))
    new = load_sweep(toml(tmp_path, '[base]\ndataset = "digits"\nstrategy = "fedprox"\n'
                                    'rounds = 2\nmu = 0.01\n[grid]\nlr = [0.05, 0.1]\n',
                                    "new.toml"))
    out = tmp_path / "out"
    _finish_with_checkpoint(out / "seed=0", old.points[0].config)
    (out / "sweep.json").write_text(json.dumps({"points": [{"name": "seed=0"},
                                                           {"name": "seed=1"}]}))
    assert [(p.point.name, p.action, p.record) for p in plan(new, out)] == [
        ("lr=0.05", RESUME, {"round": 1, "finished": True, "renamed_from": "seed=0"}),
        ("lr=0.1", RUN, {})]
    same = load_sweep(toml(tmp_path, '[base]\ndataset = "digits"\nstrategy = "fedprox"\n'
                                     'rounds = 1\nmu = 0.01\n[grid]\nseed = [0, 1]\n',
                                     "same.toml"))
    assert plan(same, out)[0].action == SKIP  # in place: mu written out is the same run
    (out / "lr=0.1").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"lr=0.1 is a link to nowhere where point lr=0.1's "
                                        r"run folder goes"):
        plan(new, out)


def test_plan_refuses_a_finished_run_with_other_settings(tmp_path):
    sweep = load_sweep(TINY)
    point, other = sweep.points[:2]
    _finish_with_checkpoint(tmp_path / point.name, point.config.replace(rounds=3))
    with pytest.raises(UserError, match=r"holds a finished run with other settings \(rounds 3 "
                                        r"there, 2 here\)"):
        plan(sweep, tmp_path)  # 3 rounds done: more than the 2 asked for
    _finish_with_checkpoint(tmp_path / other.name, other.config.replace(rounds=1, lr=0.5))
    with pytest.raises(UserError, match=r"lr 0.5 there, 0.05 here"):
        plan(select(sweep, [f"seed={other.settings['seed']}",
                            f"strategy={other.settings['strategy']}"]), tmp_path)


def test_plan_refuses_a_file_where_a_point_folder_goes(tmp_path):
    sweep = load_sweep(TINY)
    (tmp_path / sweep.points[1].name).write_text("hi")
    with pytest.raises(UserError, match=rf"{sweep.points[1].name} is a file where point "
                                        rf"{sweep.points[1].name}'s run folder goes: move it "
                                        "away or sweep into another --output"):
        plan(sweep, tmp_path)


def test_plan_trains_a_finished_run_on_when_the_config_raises_its_rounds(tmp_path):
    sweep = load_sweep(TINY)  # 2 rounds
    point = sweep.points[0]
    _finish_with_checkpoint(tmp_path / point.name, point.config.replace(rounds=1))
    planned = plan(sweep, tmp_path)
    assert (planned[0].action, planned[0].record) == (RESUME, {"round": 1, "finished": True})
    (tmp_path / point.name / "checkpoint.safetensors").unlink()  # nothing to go on from
    with pytest.raises(UserError, match=r"\(rounds 1 there, 2 here\)"):
        plan(sweep, tmp_path)


def test_cpu_note_when_parallel_points_want_more_cores():
    points = list(load_sweep(TINY).points)  # 3 nodes x 1 core each
    assert "--parallel 2 x up to 2 cores per point (3 nodes x 1 --cpus-per-node, capped at " \
        "the 2 cores) is more than the 2 cores here" in cpu_note(points, 2, cores=2)
    assert "--parallel 2 x up to 3 cores per point (3 nodes x 1 --cpus-per-node) is more " \
        "than the 4 cores here" in cpu_note(points, 2, cores=4)
    assert cpu_note(points, 2, cores=6) is None
    assert cpu_note(points, 1, cores=1) is None


def test_last_error_line_of_a_log(tmp_path):
    log = tmp_path / "sweep.log"
    log.write_text("# fedavg simulate\nround 1/2\n\x1b[31merror:\x1b[0m no dataset x\nbye\n")
    assert last_error(log) == "error: no dataset x"
    log.write_text("# fedavg simulate\nTraceback\nValueError: boom\n")
    assert last_error(log) == "ValueError: boom"
    # a log keeps every attempt: the error is the last attempt's, never an earlier one's
    log.write_text("# fedavg simulate\nerror: first try\n# fedavg simulate --resume x\n"
                   "round 3/4\nKilled\n")
    assert last_error(log) == "Killed"


def test_dry_run_lists_points_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(_app(), ["sweep", str(TINY), "--output", str(out), "--dry-run"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "shared: dataset=digits num-nodes=3 rounds=2" in res.output
    assert "strategy=fedavgm_seed=1" in res.output and "4 of 4 points would run" in res.output
    assert not out.exists()


def test_points_that_train_exactly_as_another_are_named(tmp_path):
    from fedavg.sweeps.grid import repeated_runs

    config = toml(tmp_path, '[base]\nrounds = 1\n[grid]\npartitioner = ["iid", "dirichlet", '
                            '"pathological"]\nalpha = [0.1, 1.0]\nclasses-per-node = [2, 3]\n')
    sweep = load_sweep(config)
    names = [p.name for p in sweep.points]
    assert len(names) == 12
    iid = [n for n in names if "partitioner=iid" in n]
    patho = [n for n in names if "pathological" in n]
    # iid takes neither alpha nor classes-per-node: 4 points, 1 training; pathological
    # takes classes-per-node only: 2 trainings of 4 points; dirichlet takes alpha only
    assert repeated_runs(sweep.points) == {
        **{n: iid[0] for n in iid[1:]},
        patho[2]: patho[0], patho[3]: patho[1],
        "partitioner=dirichlet_alpha=0.1_classes-per-node=3":
            "partitioner=dirichlet_alpha=0.1_classes-per-node=2",
        "partitioner=dirichlet_alpha=1.0_classes-per-node=3":
            "partitioner=dirichlet_alpha=1.0_classes-per-node=2"}
    assert repeated_runs(load_sweep(TINY).points) == {}
    res = CliRunner().invoke(_app(), ["sweep", str(config), "--output", str(tmp_path / "out"),
                                      "--dry-run", "--only", "partitioner=iid"],
                             env={"COLUMNS": "250"})
    assert f"3 point(s) train exactly as another, differing only in partition settings " \
           f"their partitioner ignores: {iid[1]} repeats {iid[0]}" in " ".join(res.output.split())


def test_dry_run_finds_the_points_that_would_fail_at_their_start(tmp_path, monkeypatch):
    from fedavg.sweeps import plan as planning
    from fedavg.sweeps.plan import check_points

    loads = []
    real_load = planning.load
    monkeypatch.setattr(planning, "load", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    config = toml(tmp_path, '[base]\nrounds = 2\n[grid]\n'
                            'dataset = ["digits", "/nowhere/data.parquet"]\n'
                            'num-nodes = [3, 2000]\n')
    sweep = load_sweep(config)
    problems = check_points(plan(sweep, tmp_path / "out"))
    assert problems == {
        "dataset=digits_num-nodes=2000": "2000 nodes but only 1438 training samples: use "
                                         "--num-nodes <= 1438",
        "dataset=data.parquet_num-nodes=3": "no such file or folder: /nowhere/data.parquet",
        "dataset=data.parquet_num-nodes=2000": "no such file or folder: /nowhere/data.parquet"}
    assert sorted(loads) == ["/nowhere/data.parquet", "digits"]  # once per data settings
    res = CliRunner().invoke(_app(), ["sweep", str(config), "--output", str(tmp_path / "out"),
                                      "--dry-run"], env={"COLUMNS": "250"})
    assert res.exit_code == 1, res.output  # the table's cells wrap with the console's width
    assert "4 of 4 points would run, 3 of them would fail at the start" in res.output
    assert not (tmp_path / "out").exists()


def test_a_prepared_run_on_data_loaded_once_is_the_same_as_on_its_own_load():
    from fedavg.data.load import data_settings, load
    from fedavg.run.lifecycle import prepare

    config = RunConfig().replace(strategy="greedy-soup", rounds=1, num_nodes=4, alpha=0.5,
                                 partitioner="dirichlet")
    shared = load("digits", **data_settings(config.data))
    notes = list(shared.notes)
    first, again = prepare(config, data=shared), prepare(config, data=shared)
    alone = prepare(config)
    assert len(shared.train) == 1438 and shared.notes == notes  # the shared data is unchanged
    for got in (first, again):
        assert len(got.data.train) == len(alone.data.train) == 1438 - len(alone.validation)
        assert np.array_equal(got.validation.y, alone.validation.y)
        assert all(np.array_equal(a, b) for a, b in zip(got.parts, alone.parts))
        assert got.data.notes == alone.data.notes


def test_a_sweep_folder_that_is_or_lies_below_a_file_is_refused(tmp_path):
    from fedavg.run.output import check_folder

    (tmp_path / "afile").write_text("x")
    check_folder(tmp_path / "new" / "deeper")  # to be made: fine
    check_folder(tmp_path)
    with pytest.raises(UserError, match=r"^--output .*afile is a file; give a folder$"):
        check_folder(tmp_path / "afile")
    with pytest.raises(UserError, match=r"afile/sub/x is below .*afile, a file; give a folder"):
        check_folder(tmp_path / "afile" / "sub" / "x")
    for args in (["--dry-run"], []):
        res = CliRunner().invoke(_app(), ["sweep", str(TINY), "--output",
                                          str(tmp_path / "afile" / "sub"), *args])
        assert res.exit_code == 2 and "is below" in res.output and "a file" in res.output


def test_a_run_folder_is_not_a_sweep_folder(tmp_path):
    run = fake_run(tmp_path / "run", [0.5, 0.6], 1.0)
    before = sorted(p.name for p in run.iterdir())
    for args in (["--dry-run"], []):
        res = CliRunner().invoke(_app(), ["sweep", str(TINY), "--output", str(run), *args])
        assert res.exit_code == 2, res.output
        assert f"{run} holds a run (model.safetensors), not a sweep" in res.output.replace(
            "\n", "")
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_bad_config_on_the_command_line_is_one_line(tmp_path):
    path = toml(tmp_path, "[grid]\nalpha = []\n")
    proc = run_cli("sweep", path, "--output", tmp_path / "out", check=False, timeout=120)
    assert proc.returncode == 2
    assert "[grid] alpha is an empty list" in assert_one_error_line(proc.stderr)
    proc = run_cli("sweep", TINY, "--parallel", "0", check=False, timeout=120)
    assert proc.returncode == 2 and "--parallel must be >= 1" in proc.stderr


def _app():
    from fedavg.cli.app import build_app

    return build_app()


def _wait_for(predicate, timeout_s: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.3)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.e2e
def test_sigterm_stops_the_running_points_and_exits_130(tmp_path, no_leaks):
    import psutil

    config = toml(tmp_path, "[base]\nnum-nodes = 2\nrounds = 1000\ncpus-per-node = 2\n"
                            "[grid]\nseed = [0, 1, 2]\n")
    out = tmp_path / "sweep"
    sweep = subprocess.Popen([sys.executable, "-m", "fedavg.cli", "sweep", str(config),
                              "--output", str(out), "--parallel", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = ["seed=0", "seed=1"]
        _wait_for(lambda: all((out / n / "checkpoint.safetensors").exists() for n in names),
                  300, "first round of both running points", sweep)
        pids = [sweep_record(out)[n]["pid"] for n in names]
        assert all(psutil.pid_exists(pid) for pid in pids)
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 130, err
    assert "interrupted" in err
    record = sweep_record(out)
    assert [record[n]["status"] for n in names] == ["interrupted", "interrupted"]
    assert record["seed=2"]["status"] == "pending"
    assert json.loads((out / "sweep.json").read_text())["status"] == "interrupted"
    assert not [pid for pid in pids if _alive(pid)]
    _wait_for(lambda: engine_processes() == [], 20, "end of the engine processes")
    dry = run_cli("sweep", config, "--output", out, "--dry-run", timeout=120)
    assert dry.stdout.count("go on after round") == 2
    assert sorted(p.name for p in out.glob("seed=*")) == names
    # the stopped point goes on from its checkpoint: its first rounds stay as they were
    metrics = out / "seed=0" / "metrics.jsonl"
    before = metrics.read_text().splitlines()
    again = subprocess.Popen([sys.executable, "-m", "fedavg.cli", "sweep", str(config),
                              "--output", str(out), "--only", "seed=0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(metrics.read_text().splitlines()) > len(before) + 1, 300,
                  "a resumed round", again)
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=120)
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    after = metrics.read_text().splitlines()
    assert after[:len(before)] == before
    assert [json.loads(line)["round"] for line in after] == list(range(1, len(after) + 1))
    starts = [line for line in (out / "seed=0" / "sweep.log").read_text().splitlines()
              if line.startswith("# fedavg ")]  # each attempt's command, the first kept
    assert len(starts) == 2 and "--resume" not in starts[0] and "--resume" in starts[1]


def test_a_point_stops_when_its_sweep_is_killed(tmp_path):
    """The sweep's children get SIGTERM when the sweep dies, even by SIGKILL."""
    import psutil

    code = ("import subprocess, sys, time\n"
            "from fedavg.sweeps.runner import point_process\n"
            "p = point_process([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    sweep = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        point = int(sweep.stdout.readline())
        assert _alive(point)
        sweep.kill()  # SIGKILL: no handler of the sweep runs
        sweep.wait(30)
        _wait_for(lambda: not _alive(point), 10, "the point's end")
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
        with contextlib.suppress(psutil.Error):
            psutil.Process(point).kill()


@pytest.mark.e2e
def test_raising_rounds_in_the_config_trains_finished_points_on(tmp_path, no_leaks):
    out = tmp_path / "sweep"
    config = toml(tmp_path, "[base]\nnum-nodes = 2\nrounds = 1\n[grid]\nseed = [0, 1]\n")
    run_cli("sweep", config, "--output", out, "--only", "seed=0", timeout=300)
    metrics = out / "seed=0" / "metrics.jsonl"
    first = metrics.read_text().splitlines()
    assert len(first) == 1
    config.write_text(config.read_text().replace("rounds = 1", "rounds = 2"))
    dry = run_cli("sweep", config, "--output", out, "--dry-run", timeout=300)
    assert dry.stdout.count("train on after round 1 (finished; rounds raised)") == 1
    assert "sweep of 1 point:" in run_cli("sweep", config, "--output", out, "--only", "seed=1",
                                          timeout=300).stdout
    run_cli("sweep", config, "--output", out, timeout=600)
    after = metrics.read_text().splitlines()
    assert after[0] == first[0] and [json.loads(line)["round"] for line in after] == [1, 2]
    starts = [line for line in (out / "seed=0" / "sweep.log").read_text().splitlines()
              if line.startswith("# fedavg ")]
    assert len(starts) == 2 and "--resume" in starts[1]
    assert json.loads((out / "seed=0" / "summary.json").read_text())["config"]["merge"][
        "rounds"] == 2
    assert {r["name"]: r["status"] for r in _record_points(out)} == {"seed=0": "done",
                                                                   "seed=1": "skipped"}


def test_a_sweep_refuses_model_arguments_its_model_cannot_take_before_any_run(tmp_path):
    """A typo in one point's model-args failed that point only when its turn came."""
    code = tmp_path / "net.py"
    code.write_text("import torch\n\ndef build(input_shape, num_classes, width=8):\n"
                    "    return torch.nn.Linear(64, num_classes)\n")
    for model, bad in (("mlp", "hiddn"), (f"{code}:build", "widht")):
        good = "hidden" if model == "mlp" else "width"
        config = tmp_path / "s.toml"
        config.write_text(f'[base]\nrounds = 1\nnum-nodes = 2\nmodel = "{model}"\n\n'
                          f"[grid]\nmodel-args = [{{{good} = 16}}, {{{bad} = 16}}]\n")
        res = CliRunner().invoke(app, ["sweep", str(config), "--output", str(tmp_path / "sw")])
        assert res.exit_code == 2, res.output
        line = assert_one_error_line(res.stderr)
        assert f"point model-args={bad}-16:" in line and f"argument {bad!r}" in line
        assert f"it takes: {good}" in line
        assert not (tmp_path / "sw").exists()  # nothing ran, no folder was made
    from fedavg.models.registry import check_model_args

    check_model_args("fasttext", {})  # vocab_size: the text data's, not missing
    check_model_args("fasttext", {"dim": 16})
    with pytest.raises(UserError, match="does not take argument 'dimm'"):
        check_model_args("fasttext", {"dimm": 16})


@pytest.mark.parametrize("setting, said", [
    ('model = ["mlp", "nosuchmodel"]', "unknown model 'nosuchmodel'; choose auto or one of"),
    ("cpus-per-node = [1, 0]", "--cpus-per-node must be in (0, "),
    ('device = ["cpu", "tpu"]', "unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
])
def test_a_sweep_refuses_a_point_that_would_fail_at_its_start_before_any_run(tmp_path,
                                                                             setting, said):
    """The first points ran, then this one failed; the dry run said every point would run."""
    config = tmp_path / "s.toml"
    config.write_text(f"[base]\nrounds = 1\nnum-nodes = 2\n\n[grid]\n{setting}\n")
    res = CliRunner().invoke(app, ["sweep", str(config), "--output", str(tmp_path / "sw")])
    assert res.exit_code == 2, res.output
    line = assert_one_error_line(res.stderr)
    assert line.startswith("error: point ") and said in line
    assert not (tmp_path / "sw").exists()  # nothing ran, no folder was made
    dry = run_cli("sweep", config, "--output", tmp_path / "sw", "--dry-run", check=False,
                  env={"COLUMNS": "400"})
    assert dry.returncode == 1 and f"would fail: {said}" in dry.stdout, dry.stdout


def test_an_interrupted_point_without_a_reason_has_no_dangling_colon(monkeypatch):
    """`interrupted seed=0 (exit -15): ` ended on a colon with nothing after it."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from fedavg.cli import sweep as cli_sweep

    shown = io.StringIO()
    monkeypatch.setattr(cli_sweep, "console", Console(file=shown, width=200))
    records = [{"name": "seed=0", "status": "interrupted", "ran": True, "exit_code": -15},
               {"name": "seed=1", "status": "failed", "ran": True, "exit_code": 1,
                "error": "run failed: no node replied"}]

    def run():
        for record in records:
            runner.on_event(record)
        return 130

    runner = SimpleNamespace(run=run, counts=lambda: {"interrupted": 1, "failed": 1},
                             on_event=None)
    assert cli_sweep._run_with_progress(runner, 2) == 130
    lines = shown.getvalue().splitlines()
    assert "interrupted seed=0 (exit -15)" in lines
    assert "failed seed=1 (exit 1): run failed: no node replied" in lines
