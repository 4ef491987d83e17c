"""`fedavg merge` on saved models: strategies offline, and its user errors."""

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.config.settings import RunConfig
from fedavg.data.load import load
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.use.inference import evaluate_model, load_model
from fedavg.use.merge import merge_models
from fedavg.util.errors import UserError

runner = CliRunner()


def _meta(name="mlp", shape=(1, 8, 8)):
    data = load("digits", seed=0)
    return {"model": {"name": name, "input_shape": list(shape), "num_classes": 10, "args": {}},
            "classes": data.classes, "input": data.input_spec(),
            "dataset": {"source": "digits", "seed": 0, "test_fraction": 0.2,
                        "columns": {"image": None, "label": None}}}


@pytest.fixture
def node_models(tmp_path):
    """Three saved models with sample counts 10, 20, 30."""
    meta = _meta()
    dirs = []
    for i, n in enumerate((10, 20, 30)):
        torch.manual_seed(i)
        d = tmp_path / "nodes" / f"node-{i}"
        checkpoint.save(d, build_model("mlp", (1, 8, 8), 10).state_dict(),
                        {**meta, "node": {"num_examples": n, "partition_id": i}})
        dirs.append(d)
    return tmp_path / "nodes", dirs


def test_average_uses_sample_counts(tmp_path, node_models):
    folder, dirs = node_models
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "average", "--output",
                              str(tmp_path / "avg")])
    assert res.exit_code == 0, res.output
    merged, meta = checkpoint.load(tmp_path / "avg")
    states = [checkpoint.load(d)[0] for d in dirs]
    key = "1.weight"
    expected = (10 * states[0][key] + 20 * states[1][key] + 30 * states[2][key]) / 60
    assert torch.allclose(merged[key], expected, atol=1e-6)
    assert meta["strategy"] == "average" and len(meta["merged_from"]) == 3


def test_ensemble_merge_is_one_loadable_model(tmp_path, node_models):
    folder, dirs = node_models
    res = runner.invoke(app, ["merge", "--models", str(dirs[0]), "--models", str(dirs[2]),
                              "--strategy", "ensemble", "--output", str(tmp_path / "ens"),
                              "--dataset", "digits"])
    assert res.exit_code == 0, res.output
    model = load_model(tmp_path / "ens")
    assert model.fedavg_meta["member_weights"] == pytest.approx([0.25, 0.75])
    summary = json.loads((tmp_path / "ens" / "summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(evaluate_model(tmp_path / "ens")["accuracy"])


@pytest.mark.parametrize("args, message", [
    (["--strategy", "greedy-soup"], "--validation"),
    (["--strategy", "distill", "--validation", "digits"], "--distill-data"),
    (["--strategy", "distill"], "distill needs data: pass --validation DATASET (held-out data) "
                                "and --distill-data DATASET (unlabeled inputs)"),
    (["--strategy", "nope"], "unknown strategy"),
    (["--strategy", "trimmed-mean", "--beta", "0.7"], "--beta"),
    *[(["--strategy", s], f"{s} changes how nodes train")
      for s in ("scaffold", "fednova", "moon", "feddyn", "fedprox")],
    # a server optimiser would step from the first model given: order-dependent nonsense
    *[(["--strategy", s], f"{s} steps from a round's starting model")
      for s in ("fedavgm", "fedadam", "fedyogi", "fedadagrad")],
    (["--strategy", "trimmed-mean", "--beta", "0.3"],
     "trimmed-mean: --beta 0.3 trims floor(0.3 x 3) = 0 of 3 models per side, so it is a "
     "plain mean (raise --beta to at least 0.334); or merge more models"),
    (["--strategy", "average", "--validation", "digits"], "average does not use --validation"),
    (["--strategy", "greedy-soup", "--validation", "digits", "--distill-data", "digits"],
     "greedy-soup does not use --distill-data"),
])
def test_merge_user_errors(tmp_path, node_models, args, message):
    folder, _ = node_models
    res = runner.invoke(app, ["merge", str(folder), "--output", str(tmp_path / "x"), *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_merging_one_model_is_refused(tmp_path, node_models):
    _, dirs = node_models
    for models, message in (([dirs[0]], f"one model found ({dirs[0]}); a merge needs two or "
                                         "more"), ([dirs[1], dirs[1]], "is given twice")):
        res = runner.invoke(app, ["merge", *map(str, models), "--output", str(tmp_path / "x")])
        assert res.exit_code == 2, res.output
        assert message in res.output
        assert not (tmp_path / "x").exists()


def test_merge_never_writes_over_a_run_or_its_inputs(tmp_path, node_models):
    folder, dirs = node_models
    before = (dirs[0] / "model.safetensors").read_bytes()
    for target, message in ((dirs[0], "holds the models being merged"),
                            (folder, "holds the models being merged")):
        res = runner.invoke(app, ["merge", str(folder), "--output", str(target)])
        assert res.exit_code == 2 and message in res.output, res.output
    assert (dirs[0] / "model.safetensors").read_bytes() == before
    out = tmp_path / "merged"
    assert runner.invoke(app, ["merge", str(folder), "--output", str(out)]).exit_code == 0
    again = runner.invoke(app, ["merge", str(folder), "--output", str(out)])
    assert again.exit_code == 2 and "already holds a run" in again.output
    assert runner.invoke(app, ["merge", str(folder), "--output", str(out),
                               "--overwrite"]).exit_code == 0
    (tmp_path / "a-file").write_text("x")
    for bad in (tmp_path / "a-file", tmp_path / "a-file" / "sub"):
        res = runner.invoke(app, ["merge", str(folder), "--output", str(bad)])
        assert res.exit_code == 2, res.output
        assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output


def test_merge_refuses_mixed_architectures(tmp_path, node_models):
    folder, _ = node_models
    other = tmp_path / "nodes" / "node-9"
    checkpoint.save(other, build_model("mlp", (1, 8, 8), 10, hidden=50).state_dict(),
                    {**_meta(), "model": {**_meta()["model"], "args": {"hidden": 50}}})
    res = runner.invoke(app, ["merge", str(folder), "--output", str(tmp_path / "x")])
    assert res.exit_code == 2 and "differs" in res.output and "'model'" in res.output
    res = runner.invoke(app, ["merge", str(tmp_path / "missing"), "--output", str(tmp_path / "x")])
    assert res.exit_code == 2 and "no such model folder" in res.output
    res = runner.invoke(app, ["merge", "--output", str(tmp_path / "x")])
    assert res.exit_code == 2 and "pass the model folders" in res.output


def _saved_run(tmp_path, kept: int, fraction: float = 0.1):
    """Two node models whose run kept ``kept`` validation samples (``fraction`` of train)."""
    meta = _meta()
    meta["dataset"]["validation_samples"] = kept
    meta["config"] = {"merge": {"validation_fraction": fraction}}
    for i in range(2):
        torch.manual_seed(i)
        checkpoint.save(tmp_path / "nodes" / f"node-{i}",
                        build_model("mlp", (1, 8, 8), 10).state_dict(),
                        {**meta, "node": {"num_examples": 10, "partition_id": i}})
    return tmp_path / "nodes", meta


def test_merge_validates_on_the_slice_the_run_kept_from_its_nodes(tmp_path):
    import numpy as np

    from fedavg.data.held_out import saved_merge_samples
    from fedavg.data.load import holdout

    _, meta = _saved_run(tmp_path, kept=288, fraction=0.2)
    got = saved_merge_samples("digits", meta, 0.1, None, held_out=True)
    # the run's own fraction (0.2 of digits' 1,438 train samples) and seed + 1, not merge's 0.1
    _, want = holdout(load("digits", seed=0).train, 0.2, 1)
    assert len(got) == 288 and np.array_equal(got.y, want.y)
    assert np.array_equal(got.x.reshape(len(got), -1), want.x.reshape(len(want), -1))


def test_merge_refuses_validation_data_the_nodes_trained_on(tmp_path):
    folder, _ = _saved_run(tmp_path, kept=0)
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "greedy-soup",
                              "--validation", "digits", "--output", str(tmp_path / "soup")])
    assert res.exit_code == 2, res.output
    assert "trained on all of its train split" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "soup").exists()
    # another dataset is data the nodes did not train on: a slice of it is fine
    from fedavg.data.held_out import saved_merge_samples

    _, meta = _saved_run(tmp_path / "elsewhere", kept=0)
    meta["dataset"]["source"] = str(tmp_path / "their-data")
    assert len(saved_merge_samples("digits", meta, 0.1, None, held_out=True)) == 144


@pytest.mark.parametrize("count", ["many", 0, -5, None, True, float("nan")])
def test_a_bad_sample_count_in_a_node_models_metadata_is_one_line(tmp_path, node_models, count):
    folder, dirs = node_models
    meta_path = dirs[1] / "model.json"
    meta = json.loads(meta_path.read_text())
    meta["node"]["num_examples"] = count
    meta_path.write_text(json.dumps(meta))
    res = runner.invoke(app, ["merge", str(folder), "--output", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "node.num_examples" in res.output and "node-1" in res.output
    assert isinstance(res.exception, SystemExit) and not (tmp_path / "x").exists()


def test_a_model_given_twice_is_refused(tmp_path, node_models):
    folder, dirs = node_models
    res = runner.invoke(app, ["merge", str(folder), str(dirs[0]), "--output",
                              str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert f"{dirs[0]} is given twice" in res.output and "count twice" in res.output
    assert not (tmp_path / "x").exists()


def test_merge_overwrite_replaces_a_run_as_a_whole(tmp_path, node_models):
    folder, _ = node_models
    run = tmp_path / "run"
    (run / "nodes" / "node-0").mkdir(parents=True)
    (run / "nodes" / "node-0" / "model.safetensors").write_bytes(b"old")
    for name in ("checkpoint.safetensors", "metrics.jsonl", "summary.json", "model.json"):
        (run / name).write_text("old")
    (run / "notes.txt").write_text("mine")
    res = runner.invoke(app, ["merge", str(folder), "--output", str(run), "--overwrite"])
    assert res.exit_code == 0, res.output
    # the old run's files went as a whole: a --resume there cannot mix it with the merge
    assert not (run / "checkpoint.safetensors").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "nodes").exists() and (run / "notes.txt").read_text() == "mine"
    assert json.loads((run / "summary.json").read_text())["num_models"] == 3


def test_merge_refuses_a_folder_another_command_is_writing(tmp_path, node_models):
    from fedavg.run.output import make_output, release_output

    folder, _ = node_models
    busy = make_output(tmp_path / "busy", lock=True)  # as a running simulation holds it
    try:
        res = runner.invoke(app, ["merge", str(folder), "--output", str(busy)])
    finally:
        release_output(busy)
    assert res.exit_code == 2, res.output
    assert "another fedavg command is writing into" in res.output
    assert list(busy.iterdir()) == []
    res = runner.invoke(app, ["merge", str(folder), "--output", str(busy)])
    assert res.exit_code == 0, res.output


def test_krum_refuses_too_few_models_for_its_num_malicious(tmp_path, node_models):
    folder, _ = node_models  # 3 models: f = 1 needs more than 4
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "krum", "--num-malicious", "1",
                              "--output", str(tmp_path / "k")])
    assert res.exit_code == 2, res.output
    assert "needs more than 2f+2 = 4 node models per merge, got 3" in res.output
    assert not (tmp_path / "k").exists()
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "multi-krum", "--output",
                              str(tmp_path / "k")])  # f = 0: the 3 best-scored, all of them
    assert res.exit_code == 0, res.output
    kept = json.loads((tmp_path / "k" / "summary.json").read_text())["merge_info"][
        "selected_nodes"]
    assert len(kept) == 3 and f"kept 3 of 3: {', '.join(kept)}" in res.output.replace("\n", " ")


def test_merge_refuses_a_sweeps_folder(tmp_path, node_models):
    folder, _ = node_models
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    res = runner.invoke(app, ["merge", str(folder), "--output", str(sweep), "--overwrite"])
    assert res.exit_code == 2, res.output
    assert "is a sweep's folder (sweep.json)" in res.output
    assert sorted(p.name for p in sweep.iterdir()) == ["sweep.json"]


def test_an_old_run_file_overwrite_cannot_remove_is_one_line(tmp_path, node_models,
                                                             monkeypatch):
    folder, _ = node_models
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("old")
    unlink = Path.unlink

    def refuse(self, missing_ok=False):  # as for another user's file (root may remove any)
        if self.name == "metrics.jsonl":
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    res = runner.invoke(app, ["merge", str(folder), "--output", str(run), "--overwrite"])
    assert res.exit_code == 2, res.output
    assert (f"--overwrite cannot remove the previous run's {run / 'metrics.jsonl'}: Operation "
            "not permitted; remove it yourself") in res.output.replace("\n", "")
    assert (run / "metrics.jsonl").read_text() == "old"


def test_trimmed_mean_with_a_beta_that_trims_one_per_side(tmp_path, node_models):
    folder, dirs = node_models
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "trimmed-mean", "--beta",
                              "0.334", "--output", str(tmp_path / "tm")])
    assert res.exit_code == 0, res.output
    merged, _ = checkpoint.load(tmp_path / "tm")
    stacked = torch.stack([checkpoint.load(d)[0]["1.weight"] for d in dirs])
    assert torch.equal(merged["1.weight"], stacked.median(dim=0).values)  # 3 - 2 x 1 left


def test_node_models_and_a_whole_runs_model_are_not_mixed(tmp_path, node_models):
    """A model of no node would weigh one sample against the nodes' hundreds."""
    folder, _ = node_models
    meta = _meta()
    checkpoint.save(tmp_path / "run", build_model("mlp", (1, 8, 8), 10).state_dict(), meta)
    res = runner.invoke(app, ["merge", str(folder), str(tmp_path / "run"), "--output",
                              str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert f"{tmp_path / 'run'} is no node's model" in res.output and "node-0 is" in res.output
    assert not (tmp_path / "x").exists()
    # whole runs' models alone: equal weights
    checkpoint.save(tmp_path / "run2", build_model("mlp", (1, 8, 8), 10).state_dict(), meta)
    res = runner.invoke(app, ["merge", str(tmp_path / "run"), str(tmp_path / "run2"),
                              "--output", str(tmp_path / "y")])
    assert res.exit_code == 0, res.output
    a, b = (checkpoint.load(tmp_path / r)[0]["1.weight"] for r in ("run", "run2"))
    assert torch.allclose(checkpoint.load(tmp_path / "y")[0]["1.weight"], (a + b) / 2)


def test_a_merge_that_overflows_writes_nothing(tmp_path):
    """Finite inputs can merge to Inf (float32 overflow): refused, no folder."""
    meta = _meta()
    for i, sign in enumerate((1.0, -1.0)):
        state = build_model("mlp", (1, 8, 8), 10).state_dict()
        state["1.weight"].fill_(sign * 3e38)
        checkpoint.save(tmp_path / "nodes" / f"node-{i}", state,
                        {**meta, "node": {"num_examples": 5, "partition_id": i}})
    res = runner.invoke(app, ["merge", str(tmp_path / "nodes"), "--output", str(tmp_path / "x")])
    assert res.exit_code == 2, res.output
    assert "the average merge holds NaN or infinite values in 1.weight" in res.output
    assert not (tmp_path / "x").exists()


def test_sample_counts_whose_sum_overflows_are_refused(tmp_path, node_models):
    folder, dirs = node_models
    for d in dirs:
        meta = json.loads((d / "model.json").read_text())
        meta["node"]["num_examples"] = 1e308
        (d / "model.json").write_text(json.dumps(meta))
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "ensemble", "--output",
                              str(tmp_path / "x")])
    assert res.exit_code == 2 and "sum beyond the float range" in res.output, res.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("shift, merges", [(0.001, True), (0.07, True), (0.5, False)])
def test_models_of_runs_with_other_seeds_merge(tmp_path, node_models, shift, merges):
    """Other seeds hold out other test samples: input statistics differ a little, not much."""
    folder, dirs = node_models
    for d in dirs:  # 1,438 train samples: statistics may move 3 / sqrt(1438) = 0.079 std
        meta = json.loads((d / "model.json").read_text())
        meta["dataset"]["train_samples"] = 1438
        (d / "model.json").write_text(json.dumps(meta))
    mean, std = meta["input"]["mean"], meta["input"]["std"]
    meta["input"]["mean"] = [m + shift * s for m, s in zip(mean, std)]
    (dirs[2] / "model.json").write_text(json.dumps(meta))
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "ensemble", "--output",
                              str(tmp_path / "x")])
    if merges:
        assert res.exit_code == 0, res.output
        assert load_model(tmp_path / "x").fedavg_meta["input"]["mean"] == mean  # the first's
    else:
        assert res.exit_code == 2, res.output
        assert f"{dirs[2]} differs from {dirs[0]} in its inputs: mean/std of input 0 " \
            f"{mean[0] + shift * std[0]:.4g}/{std[0]:.4g} against {mean[0]:.4g}/" in res.output
        assert not (tmp_path / "x").exists()


def test_models_of_runs_with_other_seeds_say_what_that_means(tmp_path, node_models):
    """Other seeds: other initial weights and other test hold-outs, said in notes.

    An average of weights from other starts is rarely a model, and the merged model is
    scored on samples another member trained on.
    """
    folder, dirs = node_models
    meta = json.loads((dirs[2] / "model.json").read_text())
    meta["dataset"]["seed"] = 1
    (dirs[2] / "model.json").write_text(json.dumps(meta))
    start = "the models come from runs of seeds 0, 1, which "
    res = merge_models(dirs, tmp_path / "avg", dataset="digits")
    assert res["notes"] == [
        start + "start from other initial weights: an average of such weights is rarely a "
        "good model (merge node models of one run, or use --strategy ensemble)",
        start + "hold out other test samples: some samples the merged model is scored on "
        "trained another member, so its accuracy is optimistic"]
    assert json.loads((tmp_path / "avg" / "summary.json").read_text())["notes"] == res["notes"]
    ensemble = merge_models(dirs, tmp_path / "ens", RunConfig().replace(strategy="ensemble"))
    assert ensemble.get("notes", []) == []  # whole models, and no test data to speak of
    same = merge_models(dirs[:2], tmp_path / "same", dataset="digits")
    assert "notes" not in same


def test_a_wrong_dataset_stops_the_merge_before_it_replaces_a_run(tmp_path, node_models):
    folder, _ = node_models
    out = tmp_path / "merged"
    assert runner.invoke(app, ["merge", str(folder), "--output", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "ensemble", "--output",
                              str(out), "--overwrite", "--dataset", "./digitz"])
    assert res.exit_code == 2 and "no such file or folder: ./digitz" in res.output, res.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_distillation_inputs_are_never_the_validation_samples(tmp_path):
    """Both from digits' train split: the student is not picked on what it learnt from."""
    import numpy as np

    from fedavg.data.held_out import saved_merge_samples

    for kept in (0, 144):
        _, meta = _saved_run(tmp_path / str(kept), kept=kept)
        meta["dataset"]["source"] = "elsewhere" if not kept else "digits"
        validation = saved_merge_samples("digits", meta, 0.1, None, held_out=True)
        unlabeled = saved_merge_samples("digits", meta, 0.2, None, unlabeled=True)
        rows = {r.tobytes() for r in validation.x.reshape(len(validation), -1)}
        assert len(unlabeled) > 200 and len(validation) == 144
        assert not rows & {r.tobytes() for r in unlabeled.x.reshape(len(unlabeled), -1)}
        assert np.unique(unlabeled.x.reshape(len(unlabeled), -1), axis=0).shape[0] > 200


def test_simulate_validation_on_its_own_dataset_is_the_slice_kept_from_the_nodes():
    """Its train split is the nodes' data: validating on it would pick on trained samples."""
    import numpy as np

    from fedavg.config.settings import RunConfig
    from fedavg.data.held_out import run_merge_data
    from fedavg.data.load import holdout

    train = load("digits", seed=0).train
    rest, want = holdout(train, 0.1, 1)
    for config in (RunConfig().replace(strategy="greedy-soup", validation="digits", rounds=1),
                   RunConfig().replace(strategy="distill", validation="digits", rounds=1,
                                       distill_data="digits")):
        data = load("digits", seed=0)
        got, unlabeled = run_merge_data(config, config.build_strategy(), data)
        assert np.array_equal(got.y, want.y) and np.array_equal(got.x, want.x)
        nodes = rest
        if unlabeled is not None:
            nodes, kept = holdout(rest, 0.1, 2)
            assert np.array_equal(unlabeled, kept.x)
        assert np.array_equal(data.train.x, nodes.x)  # the nodes never see either slice
        assert any("(the run's own dataset: its train split is the nodes' data)" in n
                   for n in data.notes), data.notes


def test_simulate_notes_data_its_strategy_does_not_use():
    from fedavg.config.settings import RunConfig
    from fedavg.data.held_out import run_merge_data

    config = RunConfig().replace(strategy="average", validation="digits", distill_data="x",
                                 rounds=1)
    data = load("digits", seed=0)
    n = len(data.train)
    assert run_merge_data(config, config.build_strategy(), data) == (None, None)
    assert len(data.train) == n
    assert "--validation digits does nothing with --strategy average" in data.notes
    assert "--distill-data x does nothing with --strategy average" in data.notes


def test_a_distillation_that_never_beats_the_average_says_so(tmp_path, node_models):
    folder, _ = node_models
    args = ["merge", str(folder), "--strategy", "distill", "--validation", "digits",
            "--distill-data", "digits", "--distill-steps", "1"]
    res = runner.invoke(app, [*args, "--distill-lr", "1e-12", "--output", str(tmp_path / "d")],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "note: no distillation step beat the members' average on the validation data, so " \
        "the model is that average" in res.output
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["merge_info"]["best_step"] == 0 and summary["notes"]


@pytest.mark.e2e
def test_a_simulated_distillation_that_never_beats_the_average_says_so(tmp_path, no_leaks):
    import io

    from rich.console import Console

    import fedavg

    out = io.StringIO()
    fedavg.simulate(num_nodes=3, rounds=1, strategy="distill", distill_steps=1,
                    distill_lr=1e-12, output=tmp_path / "run", console=Console(file=out,
                                                                               width=300))
    assert "note: no distillation step beat the members' average on the validation data, so " \
        "the model is that average" in out.getvalue()
    meta = json.loads((tmp_path / "run" / "model.json").read_text())
    assert "no distillation step beat" in json.dumps(meta)


def test_a_simulated_trimmed_mean_that_trims_nothing_is_noted_not_refused():
    """The defaults (beta 0.1, 5 nodes) run, saying it is a plain mean; beta 0.2 trims one."""
    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import prepare

    notes = prepare(RunConfig().replace(strategy="trimmed-mean")).data.notes
    assert "trimmed-mean: --beta 0.1 trims floor(0.1 x 5) = 0 of 5 models per side, so it is " \
        "a plain mean (raise --beta to at least 0.2)" in notes
    notes = prepare(RunConfig().replace(strategy="trimmed-mean", beta=0.2)).data.notes
    assert not any("plain mean" in n for n in notes)


def test_a_validation_slice_of_other_data_is_not_the_runs_own_kept_slice(tmp_path):
    """A run validated on dataset B kept nothing of its own: --validation A is refused."""
    from fedavg.data.held_out import saved_merge_samples

    for kept_key in (True, False):  # this version's metadata, and a run saved before it
        _, meta = _saved_run(tmp_path / str(kept_key), kept=144)
        meta["config"]["merge"]["validation"] = str(tmp_path / "other-data")
        if kept_key:
            meta["dataset"]["validation_kept"] = 0
        with pytest.raises(UserError, match="trained on all of its train split"):
            saved_merge_samples("digits", meta, 0.1, None, held_out=True)
    meta["config"]["merge"]["validation"] = None  # kept from train: that slice
    assert len(saved_merge_samples("digits", meta, 0.1, None, held_out=True)) == 144


def test_distillation_data_labels_are_dropped_not_checked(tmp_path, node_models):
    """Classes the models do not know were refused, though distillation drops the labels."""
    folder, _ = node_models
    _image_folder(tmp_path / "unlabelled", ("photos", "scans"))  # classes the models lack
    _distilled(folder, tmp_path / "unlabelled", tmp_path / "d")


def _image_folder(root, classes, count=30):
    """Write ``count`` digits images as PNG files into ``root``, one subfolder per class."""
    from PIL import Image

    from fedavg.data.load import load

    digits = load("digits").train
    for i in range(count):
        part = root / classes[i % len(classes)]
        part.mkdir(parents=True, exist_ok=True)
        Image.fromarray(digits.x[i].reshape(8, 8).astype("uint8"), "L").save(part / f"{i}.png")


def _distilled(models, distill_data, out):
    """Distill ``models`` on ``distill_data`` with `fedavg merge`; check the model is saved."""
    res = runner.invoke(app, ["merge", str(models), "--strategy", "distill", "--validation",
                              "digits", "--distill-data", str(distill_data),
                              "--distill-steps", "2", "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").is_file()


def test_distillation_data_of_a_single_class_is_taken(tmp_path, node_models):
    """One folder of unlabeled images (one "class") was refused as a classifier's data."""
    folder, _ = node_models
    _image_folder(tmp_path / "unlabelled", ("scans",))
    _distilled(folder, tmp_path / "unlabelled", tmp_path / "d")
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "greedy-soup",  # labels count
                              "--validation", str(tmp_path / "unlabelled"),
                              "--output", str(tmp_path / "v")])
    assert res.exit_code == 2 and "has a single class (['scans'])" in res.output


def test_a_merge_scored_on_images_of_another_size_says_so(tmp_path, node_models):
    """It printed a test accuracy with no word, where evaluate notes the resizing."""
    from PIL import Image

    folder, _ = node_models
    for i in range(20):
        part = tmp_path / "colour" / str(i % 2)
        part.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (i * 10, 0, 0)).save(part / f"{i}.png")
    res = runner.invoke(app, ["merge", str(folder), "--dataset", str(tmp_path / "colour"),
                              "--output", str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    assert "test accuracy" in res.stdout
    assert "note: the test split's inputs" in " ".join(res.output.split()), res.output


def test_a_copy_of_a_model_in_a_folder_is_refused_as_given_twice(tmp_path, node_models):
    """A copy, or a link to another folder's model, was merged as one more model."""
    import shutil

    folder, _ = node_models
    first = sorted(p for p in folder.iterdir() if p.is_dir())[0]
    for how in ("copy", "link"):
        models = tmp_path / how
        shutil.copytree(folder, models)
        if how == "copy":
            shutil.copytree(first, models / "again")
        else:
            (models / "again").symlink_to(first)
        res = runner.invoke(app, ["merge", str(models), "--output", str(tmp_path / f"m{how}")])
        assert res.exit_code == 2, res.output
        assert "holds the same weights as" in res.output and "pass each model once" in \
            res.output
        assert not (tmp_path / f"m{how}").exists()


def test_a_merge_names_the_folders_it_left_out_and_refuses_a_run_as_data(tmp_path,
                                                                          node_models):
    """Folders left out are named; a run folder as --distill-data is refused as one.

    An empty node folder beside node models was left out without a word; a run folder given
    as --distill-data said only "cannot read dataset ...: Couldn't cast".
    """
    folder, dirs = node_models
    (folder / "node-9").mkdir()  # a node whose model was never saved
    (folder / ".cache").mkdir()  # hidden: not a model folder anyone expects merged
    res = runner.invoke(app, ["merge", str(folder), "--output", str(tmp_path / "avg")])
    assert res.exit_code == 0, res.output
    assert "left out 1 folder(s) without a model.safetensors: " \
        f"{folder / 'node-9'}" in " ".join(res.output.split())
    assert "3 models" in res.output
    res = runner.invoke(app, ["merge", str(folder), "--strategy", "distill", "--validation",
                              "digits", "--distill-data", str(dirs[0]), "--output",
                              str(tmp_path / "distilled")])
    assert res.exit_code == 2
    assert f"{dirs[0]} is a saved model or run folder, not a dataset" in \
        " ".join(res.output.split())
    assert not (tmp_path / "distilled").exists()


def test_merge_models_names_arguments_of_the_wrong_type(tmp_path, node_models):
    from fedavg.use.merge import merge_models

    folder, dirs = node_models
    for kwargs, words in (({"models": None}, "models must be a list of model folders, got None"),
                          ({"output": None}, "output must be a folder path, got None"),
                          ({"dataset": 5}, "dataset must be a name or path (str), got 5")):
        args = {"models": dirs, "output": tmp_path / "out", **kwargs}
        with pytest.raises(TypeError, match=re.escape(words)):
            merge_models(**args)
    assert not (tmp_path / "out").exists()


def test_a_merge_on_a_full_disk_says_merge_failed_and_leaves_no_folder(tmp_path, node_models,
                                                                      monkeypatch):
    """It said "run failed: cannot write ..." and left its empty output folder."""
    import errno

    from fedavg.use import merge

    def full(folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(merge.checkpoint, "save_merged", full)
    folder, _ = node_models
    out = tmp_path / "avg"
    res = runner.invoke(app, ["merge", str(folder), "--output", str(out)])
    assert res.exit_code == 1
    assert f"merge failed: cannot write {out / 'model.safetensors'}: No space left on device" \
        in " ".join(res.output.split())
    assert not out.exists()


def test_a_merge_of_private_models_states_no_epsilon_and_says_why(tmp_path):
    meta = _meta()
    private = {"level": "record", "epsilon": 3.6, "delta": 1e-5}
    dirs = []
    for i, extra in enumerate(({"privacy": private}, {}, {})):  # DP first: copied before
        torch.manual_seed(i)
        dirs.append(tmp_path / f"m{i}")
        checkpoint.save(dirs[-1], build_model("mlp", (1, 8, 8), 10).state_dict(),
                        {**meta, **extra, "node": {"num_examples": 10, "partition_id": i}})
    res = merge_models(dirs[:2], tmp_path / "avg")
    _, merged = checkpoint.load(tmp_path / "avg")
    assert "privacy" not in merged
    assert any("1 of the 2 models were trained with differential privacy" in n
               and "states no epsilon" in n for n in res["notes"])
    plain = merge_models(dirs[1:], tmp_path / "plain")
    assert not any("differential privacy" in n for n in plain.get("notes", []))
