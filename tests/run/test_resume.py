"""Checkpoint and resume: the checkpoint file, the settings check, and killed runs resumed."""

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.cluster import Cluster, rounds_of

import strategies
from fedavg.config.settings import RunConfig
from fedavg.run import resume, resume_checks
from fedavg.util.errors import UserError


def rec(r):
    """Return a round record as metrics.jsonl holds it."""
    return {"round": r, "accuracy": 0.5, "loss": 1.0, "train_loss": 1.2, "num_nodes": 2,
            "num_failed": 0, "wall_s": 0.1, "train_s": 0.05}


def _rounds(strategy, w, batches):
    for models in batches:
        w = strategy.merge(models, [1.0, 3.0], reference=w).state_dict
    return w


def _batches():
    g = torch.Generator().manual_seed(0)
    return [[{"a": torch.randn(3, generator=g), "n": torch.tensor(r)} for _ in range(2)]
            for r in range(4)]


@pytest.mark.parametrize("name", ["fedadam", "fedavgm", "fedyogi", "fedadagrad", "fedavg"])
def test_strategy_state_through_a_checkpoint_file_continues_exactly(tmp_path, name):
    w0 = {"a": torch.zeros(3), "n": torch.tensor(0)}
    batches = _batches()
    unbroken = _rounds(strategies.get(name), w0, batches)

    first = strategies.get(name)
    w2 = _rounds(first, w0, batches[:2])
    ckpt = resume.capture(2, w2, RunConfig().replace(strategy=name, rounds=4), first,
                          [rec(1), rec(2)], ["round 1, node 3: gone"])
    resume.save(tmp_path, ckpt)
    back = resume.load(tmp_path)
    again = strategies.get(name)
    again.load_state(back.strategy)
    resumed = _rounds(again, back.model, batches[2:])

    assert torch.equal(resumed["a"], unbroken["a"])
    assert back.round == 2 and back.failures == ["round 1, node 3: gone"]
    assert back.run_config().merge.strategy == name


def test_random_states_are_restored():
    import random

    random.seed(7)
    torch.manual_seed(7)
    ckpt = resume.capture(1, {"a": torch.zeros(1)}, RunConfig(), strategies.get("fedavg"),
                          [rec(1)], [])
    expected = (random.random(), torch.rand(2))
    random.seed(99)
    torch.manual_seed(99)
    ckpt.restore_random()
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(2), expected[1])


def test_a_stateless_strategy_refuses_foreign_state():
    with pytest.raises(strategies.MergeError, match="keeps no state"):
        strategies.get("fedavg").load_state({"m.a": torch.zeros(1)})
    with pytest.raises(strategies.MergeError, match="unexpected checkpoint entry 'x.a'"):
        strategies.get("fedadam").load_state({"x.a": torch.zeros(1)})


def test_missing_and_damaged_checkpoints_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        resume.load(tmp_path / "nope")
    with pytest.raises(UserError, match="no checkpoint.safetensors in it .no round finished"):
        resume.load(tmp_path)
    sweep = tmp_path / "my sweep"  # a sweep's folder names the command that goes on with it
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"config": "configs/a b.toml", "points": []}))
    with pytest.raises(UserError) as err:
        resume.load(sweep)
    assert str(err.value) == (f"--resume {sweep}: no checkpoint.safetensors in it (a sweep's "
                              f"folder: `fedavg sweep 'configs/a b.toml' --output '{sweep}'` "
                              "goes on with its points)")
    ckpt = resume.capture(1, {"a": torch.ones(4)}, RunConfig(), strategies.get("fedavg"),
                          [rec(1)], [])
    path = resume.save(tmp_path, ckpt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(UserError, match=r"checkpoint.safetensors is damaged") as err:
        resume.load(tmp_path)
    assert "\n" not in str(err.value)
    path.write_bytes(b"\x00" * 64)  # garbage
    with pytest.raises(UserError, match="is damaged"):
        resume.load(tmp_path)


def _edited(tmp_path, **state_changes):
    """Write a checkpoint, then rewrite its JSON state with ``state_changes``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ckpt = resume.capture(2, {"a": torch.ones(2)}, RunConfig().replace(strategy="fedadam"),
                          strategies.get("fedadam"), [rec(1), rec(2)], [])
    path = resume.save(tmp_path, ckpt)
    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    state = json.loads(meta["state"])
    tensors.update(state_changes.pop("tensors", {}))
    state.update(state_changes)
    del meta["sha256"]  # rewritten without a checksum, as before checksums existed
    save_file(tensors, str(path), metadata={**meta, "state": json.dumps(state)})
    return path


def test_a_flipped_bit_in_a_checkpoint_is_damage_and_one_without_a_checksum_loads(tmp_path):
    ckpt = resume.capture(1, {"a": torch.arange(64, dtype=torch.float32)}, RunConfig(),
                          strategies.get("fedavg"), [rec(1)], [])
    path = resume.save(tmp_path, ckpt)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the tensor bytes, at the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="do not match its SHA-256 checksum") as err:
        resume.load(tmp_path)
    assert "\n" not in str(err.value)
    _edited(tmp_path)  # no checksum, as written before checksums existed: still loads
    assert resume.load(tmp_path).round == 2


@pytest.mark.parametrize("change, why", [
    ({"round": 2.7}, "not a whole number"),
    ({"failures": "oops"}, "not a list of lines"),
    ({"rounds": [rec(1), {"foo": 2}]}, "RoundRecord"),
    ({"rounds": [1, 2]}, "not a list of round records"),
    ({"python_random": [1, 2, 3]}, "bad random state"),
    ({"python_random": [3, [1, 2, 3], None]}, "bad random state"),
    ({"tensors": {"rng.torch": torch.zeros(3)}}, "bad random state"),
    ({"config": {"lr": "fast"}}, "its settings: setting 'lr' expects float"),
    ({"config": {"num-nodes": -1}}, "its settings: --num-nodes must be >= 1"),
])
def test_hand_edited_checkpoints_are_damaged_not_a_crash(tmp_path, change, why):
    _edited(tmp_path, **change)
    with pytest.raises(UserError, match="checkpoint.safetensors is damaged") as err:
        resume.load(tmp_path)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_server_moments_must_fit_the_model_and_be_there():
    opt = strategies.get("fedadam")
    model = {"a": torch.zeros(2)}
    with pytest.raises(strategies.MergeError, match=r"'m.a' of shape \(3,\) fits no parameter"):
        opt.load_state({"round": 1, "m.a": torch.zeros(3), "v.a": torch.zeros(3)}, model)
    with pytest.raises(strategies.MergeError, match="lacks its 'm' moments after 2 step"):
        opt.load_state({"round": 2}, model)
    with pytest.raises(strategies.MergeError, match="lacks its step count"):
        opt.load_state({"m.a": torch.zeros(2), "v.a": torch.zeros(2)}, model)
    strategies.get("fedavgm", server_momentum=0.0).load_state({"round": 3}, model)  # none kept


def test_model_mismatch_names_the_tensor():
    model = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    assert resume.model_mismatch(model, {"w": torch.zeros(2, 3), "b": torch.zeros(2)}) is None
    assert "tensors missing ['b']" in resume.model_mismatch(model, {"w": torch.zeros(2, 3)})
    assert resume.model_mismatch(model, {"w": torch.zeros(3, 2), "b": torch.zeros(2)}) == \
        "tensor 'w' is (3, 2) torch.float32, the model's is (2, 3) torch.float32"
    assert "NaN" in resume.model_mismatch(model, {"w": torch.zeros(2, 3),
                                                  "b": torch.tensor([0.0, math.nan])})


def test_local_data_paths_are_kept_absolute(tmp_path, monkeypatch):
    (tmp_path / "data.csv").write_text("x,label\n1,0\n")
    monkeypatch.chdir(tmp_path)
    ckpt = resume.capture(1, {"a": torch.zeros(1)}, RunConfig().replace(dataset="data.csv"),
                          strategies.get("fedavg"), [rec(1)], [])
    assert ckpt.config["dataset"] == str(tmp_path / "data.csv")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # the same file, named from elsewhere
    asked = ckpt.run_config().replace(dataset="../data.csv", rounds=3)
    assert resume.resumed_config(ckpt, asked, "run").merge.rounds == 3
    (tmp_path / "data.csv").rename(tmp_path / "moved.csv")
    with pytest.raises(UserError, match=r"data.csv is gone: put it back there"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(dataset="../moved.csv",
                                                              rounds=3), "run")


def test_a_resume_whose_tokenizer_file_is_gone_names_the_runs_copy(tmp_path, monkeypatch):
    """The run's --tokenizer file gone: the error names the run folder's copy.

    ``--tokenizer`` may name that copy (it was refused as another tokenizer). The run's
    setting stays the original path when the file is there (a sweep compares it).
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok.json").write_text("{}")  # the file the run was started with
    ckpt = resume.capture(1, {"a": torch.zeros(1)}, RunConfig().replace(tokenizer="tok.json"),
                          strategies.get("fedavg"), [rec(1)], [])
    run = tmp_path / "run"
    run.mkdir()
    copy = run / "tokenizer.json"
    copy.write_text("{}")  # as the run saved it (the data check compares the SHA-256)
    there = resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=2), str(run))
    assert there.data.tokenizer == str(tmp_path / "tok.json")  # not rewritten to the copy
    (tmp_path / "tok.json").unlink()
    with pytest.raises(UserError, match=rf"the run's tokenizer {tmp_path}/tok.json is gone: "
                                        rf"copy {copy} \(the run's copy\) there, or pass "
                                        rf"--tokenizer {copy}"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=2), str(run))
    named = ckpt.run_config().replace(rounds=2, tokenizer=str(copy))  # as the error says
    assert resume.resumed_config(ckpt, named, str(run)).data.tokenizer == str(copy)
    with pytest.raises(UserError, match="--tokenizer .*other.json differs from the run's"):
        (tmp_path / "other.json").write_text("{}")
        resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=2, tokenizer="other.json"),
                              str(run))


STOPPED_WHILE_LOADING = """
import os, signal, sys, time
import fedavg.engines.simulation.simulate

def loading(*args, **kwargs):  # a Ctrl-C while the resumed run loads its data
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)

fedavg.engines.simulation.simulate.simulate = loading
from fedavg.cli.app import main
sys.argv = ["fedavg", "simulate", "--resume", sys.argv[1], "--rounds", "60"]
main()
"""


def test_a_resume_stopped_before_its_folder_opens_keeps_and_names_its_rounds(tmp_path):
    """It said "nothing of this run was saved" of a run whose rounds are all there."""
    run = tmp_path / "run"
    run.mkdir()
    resume.save(run, resume.capture(2, {"a": torch.zeros(1)}, RunConfig().replace(rounds=2),
                                    strategies.get("fedavg"), [rec(1), rec(2)], []))
    res = subprocess.run([sys.executable, "-c", STOPPED_WHILE_LOADING, str(run)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 130, res.stderr[-2000:]
    assert f"interrupted: finished rounds are kept in {run}; resume with: fedavg simulate " \
        f"--rounds 60 --resume {run}" in " ".join(res.stderr.split()), res.stderr[-2000:]
    assert (run / "checkpoint.safetensors").is_file()


def test_one_writer_per_run_folder(tmp_path):
    from fedavg.run.output import make_output, release_output

    out = make_output(tmp_path / "run", lock=True)
    with pytest.raises(UserError, match="another fedavg command is writing into"):
        make_output(tmp_path / "run", lock=True)
    release_output(out)
    killed = out / ".checkpoint.safetensors.x1y2.tmp"  # a save cut by kill -9
    killed.write_bytes(b"half")
    (out / "notes.tmp").write_text("the user's")
    (out / ".draft.x1y2.tmp").write_text("the user's too")  # not a run file's
    release_output(make_output(tmp_path / "run", lock=True))
    assert not killed.exists()
    assert (out / "notes.tmp").exists() and (out / ".draft.x1y2.tmp").exists()


@pytest.mark.parametrize("named", [True, False])
def test_a_signal_right_after_the_run_folder_is_made_removes_it(tmp_path, monkeypatch, named):
    """A SIGTERM between ``mkdir`` and the lock: the handler finds the new folder, removes it.

    It was left behind, empty, when the folder was recorded only after the lock.
    """
    from fedavg.run import output

    def signal_arrives(out):  # what the signal handler of cli_support.on_signal does
        if output.RUN_OUTPUT:
            output.remove_if_empty(output.RUN_OUTPUT[0])
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(output, "RUN_OUTPUT", [])
    monkeypatch.setattr(output, "_lock", signal_arrives)
    with pytest.raises(KeyboardInterrupt):
        output.make_output(tmp_path / "run" if named else None, lock=True)
    assert list(tmp_path.iterdir()) == []  # neither run/ nor runs/<timestamp> (nor runs/)
    kept = tmp_path / "mine"
    kept.mkdir()  # a folder that was there before is not this command's to remove
    output.RUN_OUTPUT[:] = []
    with pytest.raises(KeyboardInterrupt):
        output.make_output(kept, lock=True)
    assert kept.is_dir()


def test_the_resume_hint_is_only_for_this_runs_checkpoint(tmp_path, monkeypatch):
    from fedavg.cli import support as cli_support

    ckpt = resume.capture(1, {"a": torch.zeros(1)}, RunConfig(), strategies.get("fedavg"),
                          [rec(1)], [])
    path = resume.save(tmp_path, ckpt)
    monkeypatch.setattr(cli_support.sys, "argv", ["fedavg", "simulate", "--output",
                                                  str(tmp_path), "--overwrite"])
    os.utime(path, (cli_support.STARTED - 60, cli_support.STARTED - 60))  # an older run's
    assert cli_support.interrupted(tmp_path) == ("interrupted before the first round finished: "
                                                 "nothing of this run was saved")
    os.utime(path, None)  # written by this command
    assert cli_support.interrupted(tmp_path).endswith(
        f"resume with: fedavg simulate --resume {tmp_path}")
    monkeypatch.setattr(cli_support.sys, "argv", ["fedavg", "simulate", "--resume",
                                                  str(tmp_path)])
    os.utime(path, (cli_support.STARTED - 60, cli_support.STARTED - 60))  # resumed, not new
    assert "resume with:" in cli_support.interrupted(tmp_path)
    (tmp_path / "summary.json").write_text("{}")  # this command finished the run
    assert cli_support.interrupted(tmp_path) == ("interrupted after the run finished: its model "
                                                 f"and results are in {tmp_path}")


def test_only_the_rounds_may_change(tmp_path):
    ckpt = resume.Checkpoint(round=2, model={"a": torch.zeros(1)},
                             config=RunConfig().replace(rounds=4, lr=0.05).to_flat(),
                             rounds=[rec(1), rec(2)])
    more = resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=6), "run")
    assert more.merge.rounds == 6 and more.train.lr == 0.05
    assert resume.resumed_config(ckpt, None, "run").merge.rounds == 4
    with pytest.raises(UserError, match=r"--lr 0.1 differs from the run's 0.05; only --rounds"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(lr=0.1), "run")
    with pytest.raises(UserError, match=r"--strategy fedadam differs from the run's fedavg"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(strategy="fedadam"), "run")
    with pytest.raises(UserError, match=r"--model-arg \{\"hidden\": 200\} differs from the run, "
                                        r"which had no --model-arg;"):  # the option's name
        resume.resumed_config(ckpt, ckpt.run_config().replace(model_args={"hidden": 200}),
                              "run")
    with pytest.raises(UserError, match=r"--validation other differs from the run, which had "
                                        r"no --validation; only --rounds"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(validation="other"), "run")
    averaged = resume.Checkpoint(round=2, model={"a": torch.zeros(1)}, rounds=[rec(1), rec(2)],
                                 config=RunConfig().replace(rounds=4, swa_start=3).to_flat())
    with pytest.raises(UserError, match=r"leaving out --swa-start differs from the run's 3"):
        resume.resumed_config(averaged, RunConfig().replace(rounds=4), "run")
    bound = ckpt.run_config().replace(max_update_norm=2.0, rounds=5)  # to go on after a refusal
    assert resume.resumed_config(ckpt, bound, "run").merge.max_update_norm == 2.0
    assert resume.resumed_config(ckpt, ckpt.run_config().replace(device="cpu", rounds=5),
                                 "run").train.device == "cpu"
    # stopped after its last round, before summary.json: resuming with the same rounds
    # finishes it; once summary.json is there it is done
    assert resume.resumed_config(ckpt, None, str(tmp_path)).merge.rounds == 4
    ckpt.round, ckpt.rounds = 4, [rec(i) for i in range(1, 5)]
    assert resume.resumed_config(ckpt, None, str(tmp_path)).merge.rounds == 4
    with pytest.raises(UserError, match=r"has finished 4 round\(s\); pass --rounds N with N >= 4 "
                                        r"\(4 finishes it there, more trains longer\)"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=3), str(tmp_path))
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(UserError, match=r"has finished 4 round\(s\); pass --rounds N with N > 4"):
        resume.resumed_config(ckpt, None, str(tmp_path))
    with pytest.raises(UserError, match=r"has finished 4 round\(s\)"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=3), str(tmp_path))
    (tmp_path / "summary.json").write_text('{"acc')  # cut short: not finished, as a sweep says
    assert resume.resumed_config(ckpt, None, str(tmp_path)).merge.rounds == 4


def test_a_run_resumed_to_train_longer_keeps_only_its_last_rounds_node_models(tmp_path):
    """Node models of the earlier last round go once the new last round is checkpointed."""
    import types

    from fedavg.run import checkpoint
    from fedavg.run.lifecycle import RunState
    from fedavg.run.server_app import ServerRun

    def saved(folder, rounds):
        checkpoint.save(tmp_path / "nodes" / folder, {"w": torch.zeros(2)},
                        {"rounds": rounds, "node": {"num_examples": 3}})

    config = RunConfig().replace(rounds=4, save_node_models=True)
    prepared = types.SimpleNamespace(meta={"model": None})
    info = {"partition_id": 0, "node_id": 7, "num_examples": 3}
    for resumed, left in ((False, {"node-0", "node-1", "node-2", "mine"}),
                          (True, {"node-0", "node-1", "mine"})):
        for folder, rounds in (("node-0", 2), ("node-1", 4), ("node-2", 2)):
            saved(folder, rounds)
        (tmp_path / "nodes" / "mine").mkdir(exist_ok=True)  # not a node model: left alone
        run = ServerRun(config, prepared, tmp_path, RunState(),
                        resume_from=object() if resumed else None)
        run.adapter = types.SimpleNamespace(reference={"w": torch.full((2,), float(resumed))})
        run.save_node_model(3, {"w": torch.ones(2)}, info)  # not the last round: no file
        assert json.loads((tmp_path / "nodes/node-0/model.json").read_text())["rounds"] == 2
        run.save_node_model(4, {"w": torch.ones(2)}, info)
        run.save_node_model(4, {"w": torch.ones(2)}, {**info, "partition_id": 1})
        assert (tmp_path / "nodes/node-2").is_dir()  # kept until round 4's checkpoint: a
        if resumed:  # Ctrl-C before it would lose the model and leave round 4 to redo
            run.drop_stale_node_models(4)
        assert {d.name for d in (tmp_path / "nodes").iterdir()} == left
        assert json.loads((tmp_path / "nodes/node-0/model.json").read_text())["rounds"] == 4
        from safetensors.torch import load_file

        start = load_file(tmp_path / "start/model.safetensors")  # what round 4 started from
        meta = json.loads((tmp_path / "start/model.json").read_text())
        assert torch.equal(start["w"], torch.full((2,), float(resumed))) and meta["rounds"] == 3


def test_resume_refuses_a_model_now_built_from_other_files(tmp_path):
    """An hf: folder's config.json edited since the run started: the weights may still fit."""
    spec = {"name": "hf:/m", "input_shape": [3, 8, 8], "num_classes": 2,
            "args": {"hf_config": {"hidden_act": "relu", "sizes": (8, 16)}}}
    resume_checks.check_same_model(tmp_path, spec)  # no model.json yet: nothing to compare
    (tmp_path / "model.json").write_text(json.dumps({"model": spec}))
    resume_checks.check_same_model(tmp_path, spec)  # the same (its tuple saved as a list)
    edited = {**spec, "args": {"hf_config": {"hidden_act": "gelu", "sizes": (8, 16)}}}
    with pytest.raises(UserError, match=rf"^{tmp_path} was trained with model hf:/m built with "
                                        r"hf_config.hidden_act = relu, which is now gelu \(its "
                                        r"files or --model-arg changed\): restore them to "
                                        r"resume, or start a new run$"):
        resume_checks.check_same_model(tmp_path, edited)
    with pytest.raises(UserError, match=r"model.json is a model hf:/m, its checkpoint of model "
                                        r"mlp: the folder mixes two runs"):
        resume_checks.check_same_model(tmp_path, {**edited, "name": "mlp"})


def test_resume_refuses_data_that_are_now_other_samples(tmp_path):
    """Another file at the data's path: the run went on, scoring later rounds on other data."""
    from fedavg.run.resume_checks import check_same_data

    image = {"kind": "image", "shape": [1, 8, 8]}
    counts = {"source": "d.csv", "train_samples": 1438, "test_samples": 359}
    check_same_data(tmp_path, image, counts)  # no model.json yet: nothing to compare
    (tmp_path / "model.json").write_text(json.dumps({"input": image, "dataset": counts}))
    check_same_data(tmp_path, image, dict(counts))
    with pytest.raises(UserError, match=rf"^{tmp_path} was trained on 1438 train samples; its "
                                        r"data now has 718 \(the files changed\?\): resume "
                                        r"with the data it was trained on, or start a new run$"):
        check_same_data(tmp_path, image, {**counts, "train_samples": 718})
    with pytest.raises(UserError, match="was trained on 359 test samples; its data now has 180"):
        check_same_data(tmp_path, image, {**counts, "test_samples": 180})


def test_a_run_whose_model_file_moved_resumes_with_the_file_named_anew(tmp_path):
    """The same file name and function elsewhere is the run's code; another file is not."""
    for folder in ("old", "new"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.py").write_text("def build(input_shape, num_classes): pass\n")
    (tmp_path / "new" / "n.py").write_text("def build(input_shape, num_classes): pass\n")
    saved = RunConfig().replace(model=f"{tmp_path}/old/m.py:build", rounds=2)
    ckpt = resume.Checkpoint(round=1, model={}, config=saved.to_flat())
    moved = resume.resumed_config(ckpt, saved.replace(model=f"{tmp_path}/new/m.py:build"),
                                  "runs/x")
    assert moved.train.model == f"{tmp_path}/new/m.py:build"
    with pytest.raises(UserError, match=r"--model \S+/new/n.py:build differs from the run's"):
        resume.resumed_config(ckpt, saved.replace(model=f"{tmp_path}/new/n.py:build"), "runs/x")


def test_resume_command_replaces_output_and_keeps_the_rest():
    argv = ["simulate", "--num-nodes", "3", "--output", "runs/a b", "--overwrite", "--lr=0.1"]
    assert resume.resume_command(argv, Path("runs/a b")) == \
        "fedavg simulate --num-nodes 3 --lr=0.1 --resume 'runs/a b'"
    again = ["simulate", "--resume", "runs/x", "--rounds", "9"]
    assert resume.resume_command(again, Path("runs/x")) == \
        "fedavg simulate --rounds 9 --resume runs/x"
    # the option that made the run fail is left out, in both spellings
    refused = ["simulate", "--max-update-norm", "2", "--rounds", "9", "--max-update-norm=3"]
    assert resume.resume_command(refused, Path("runs/x"), drop=("--max-update-norm",)) == \
        "fedavg simulate --rounds 9 --resume runs/x"


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def runs(tmp_path):
    """Commands started in the background, stopped and checked for leftovers at the end."""
    c = Cluster(tmp_path)
    yield c
    c.close()


def _kill_tree(proc):
    """SIGKILL a command and every process it started (Ray's too): nothing is cleaned up."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.kill()
    proc.wait(30)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=30)


def _wait_rounds(out, n, proc, runs, timeout=240):
    deadline = time.monotonic() + timeout
    while not ((out / "metrics.jsonl").exists()
               and len((out / "metrics.jsonl").read_text().splitlines()) >= n):
        assert proc.poll() is None, runs.log(proc.name)
        assert time.monotonic() < deadline, runs.log(proc.name)
        time.sleep(0.05)


@pytest.fixture
def short_tmp():
    """Yield a temp folder with a short path; remove it afterwards."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="fedavg-test-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


SIM = ["simulate", "--num-nodes", "4", "--fraction", "0.5", "--rounds", "4", "--seed", "3",
       "--local-epochs", "2"]


@pytest.mark.e2e
def test_run_killed_after_round_two_resumes_to_the_unbroken_result(runs, tmp_path,
                                                                    monkeypatch, short_tmp):
    """SIGKILL after round 2 of 4, then --resume: the same final model as never stopping.

    FedAdam, so the server optimiser's moments must come back too (plain FedAvg has no
    server state, and SCAFFOLD's node state is the next test's).
    """
    # what the kill leaves behind stays in here (short: Ray's socket paths are limited)
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    args = [*SIM, "--strategy", "fedadam"]
    unbroken = runs.start("unbroken", *args, "--output", tmp_path / "unbroken")
    assert runs.wait(unbroken) == 0, runs.log("unbroken")

    out = tmp_path / "killed"
    killed = runs.start("killed", *args, "--output", out)
    _wait_rounds(out, 2, killed, runs)
    _kill_tree(killed)
    done = len(rounds_of(out))
    assert done >= 2 and resume.load(out).round == done  # the last round is loadable

    again = runs.start("resumed", "simulate", "--resume", out)
    assert runs.wait(again) == 0, runs.log("resumed")
    assert f"resuming {out} after round {done} of 4" in runs.log("resumed")
    got, want = rounds_of(out), rounds_of(tmp_path / "unbroken")
    assert [r["round"] for r in got] == [1, 2, 3, 4]
    assert got[-1]["accuracy"] == want[-1]["accuracy"], (got, want)
    # bit for bit: every round's replies are folded in partition order, whatever the arrival
    assert (out / "model.safetensors").read_bytes() == \
        (tmp_path / "unbroken" / "model.safetensors").read_bytes()
    assert [r["num_nodes"] for r in got] == [2, 2, 2, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["accuracy"] == got[-1]["accuracy"]


@pytest.mark.e2e
def test_node_states_resume_with_the_run(runs, tmp_path, short_tmp, monkeypatch):
    """SCAFFOLD's node variates and the weight average come back on --resume.

    The node variates and the server's weight average (``--swa-start 2``) go into the
    checkpoint. A run stopped after round 2 and resumed to 4 ends exactly where the unbroken
    run does.
    """
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    args = ["simulate", "--num-nodes", "4", "--fraction", "0.5", "--seed", "3",
            "--local-epochs", "2", "--strategy", "scaffold", "--swa-start", "2", "--rounds"]
    unbroken = runs.start("unbroken", *args, "4", "--output", tmp_path / "unbroken")
    assert runs.wait(unbroken) == 0, runs.log("unbroken")
    out = tmp_path / "split"
    first = runs.start("first", *args, "2", "--output", out)
    assert runs.wait(first) == 0, runs.log("first")
    saved = resume.load(out)
    assert sorted(saved.node_states) and set(saved.node_states) <= {0, 1, 2, 3}
    assert set(saved.strategy) == {f"c.{k}" for k in next(iter(saved.node_states.values()))}
    again = runs.start("resumed", "simulate", "--resume", out, "--rounds", "4")
    assert runs.wait(again) == 0, runs.log("resumed")
    got, want = rounds_of(out), rounds_of(tmp_path / "unbroken")
    assert [r["accuracy"] for r in got] == [r["accuracy"] for r in want]
    assert [r["merged_accuracy"] for r in got] == [r["merged_accuracy"] for r in want]
    assert got[0]["merged_accuracy"] is None and None not in [r["merged_loss"] for r in got[1:]]
    # round 2's model alone: the mean is that model, kept exactly (float64)
    assert all(torch.equal(saved.swa[k], saved.model[k].double()) for k in saved.model)
    # the saved model is the average of rounds 2-4, not round 4's model the nodes go on from
    from safetensors.torch import load_file

    final, model = resume.load(out), load_file(out / "model.safetensors")
    info = json.loads((out / "model.json").read_text())["merge_info"]["swa"]
    assert info == {"start": 2, "models": 3}
    assert all(torch.equal(model[k], final.swa[k].to(model[k].dtype)) for k in model)
    assert any(not torch.equal(model[k], final.model[k]) for k in model)
    assert got[-1]["loss"] != got[-1]["merged_loss"]


@pytest.mark.e2e
def test_sigterm_says_the_exact_resume_command_and_it_works(runs, tmp_path):
    out = tmp_path / "run"
    proc = runs.start("run", "simulate", "--rounds", "3", "--num-nodes", "2",
                         "--local-epochs", "3", "--output", out)
    _wait_rounds(out, 1, proc, runs)
    proc.send_signal(signal.SIGTERM)
    assert runs.wait(proc, 60) == 130
    assert "SIGTERM received" not in runs.log("run")  # no crash report from Ray's core
    line = re.search(r"resume with: (fedavg .*)", runs.log("run")).group(1)
    assert line.endswith(f"--resume {out}") and "--output" not in line
    args = shlex.split(line)[1:] + ["--rounds", "4"]  # and train one round longer
    again = runs.start("again", *args)
    assert runs.wait(again) == 0, runs.log("again")
    assert [r["round"] for r in rounds_of(out)] == [1, 2, 3, 4]
    bad = runs.start("bad", *args, "--lr", "0.5")
    assert runs.wait(bad) == 2
    assert "--lr 0.5 differs from the run's 0.05" in runs.log("bad")


@pytest.mark.e2e
def test_coordinator_resumes_with_new_nodes_and_more_rounds(runs, tmp_path):
    out = tmp_path / "run"
    coord = runs.coordinator("--rounds", "2", "--min-nodes", "2", "--insecure",
                                "--strategy", "fedadam", "--output", out)
    nodes = [runs.node(f"n{i}", "--insecure", "--partition-id", i, "--num-partitions", 2,
                          "--once") for i in range(2)]
    assert runs.wait(coord) == 0, runs.log("coordinator")
    for n in nodes:
        assert runs.wait(n, 60) == 0
    coord2 = runs.start("coordinator2", "coordinator", "--address", runs.address,
                           "--insecure", "--min-nodes", "2", "--resume", out, "--rounds", "3")
    nodes2 = [runs.node(f"m{i}", "--insecure", "--partition-id", i, "--num-partitions", 2,
                           "--once") for i in range(2)]
    assert runs.wait(coord2) == 0, runs.log("coordinator2")
    assert f"resuming {out} after round 2 of 3" in runs.log("coordinator2")  # as simulate says
    for n in nodes2:
        assert runs.wait(n, 60) == 0
    rounds = rounds_of(out)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert json.loads((out / "model.json").read_text())["rounds"] == 3
    assert resume.load(out).strategy["round"] == 3  # FedAdam's step count went on


def test_a_checkpoint_older_than_a_setting_resumes_with_its_default():
    """Settings added later (the node recipe) were at their default in an older run."""
    flat = RunConfig().replace(rounds=4).to_flat()
    for newer in ("augment", "lr-schedule"):
        del flat[newer]
    ckpt = resume.Checkpoint(round=2, model={"a": torch.zeros(1)}, config=flat,
                             rounds=[rec(1), rec(2)])
    asked = RunConfig().replace(rounds=6)
    assert resume.resumed_config(ckpt, asked, "run").train.augment is False
    with pytest.raises(UserError, match="--augment true differs from the run's false"):
        resume.resumed_config(ckpt, asked.replace(augment=True), "run")


def test_a_strategy_option_given_at_its_default_is_the_same_setting():
    ckpt = resume.Checkpoint(round=1, model={"a": torch.zeros(1)},
                             config=RunConfig().replace(rounds=2, strategy="moon").to_flat(),
                             rounds=[rec(1)])
    again = ckpt.run_config().replace(rounds=3, moon_mu=5.0, temperature=0.5)
    assert resume.resumed_config(ckpt, again, "run").merge.rounds == 3
    with pytest.raises(UserError, match=r"--moon-mu 1.0 differs from the run's 5.0"):
        resume.resumed_config(ckpt, ckpt.run_config().replace(rounds=3, moon_mu=1.0), "run")


@pytest.mark.e2e
def test_a_finished_run_stopped_while_training_longer_is_a_stopped_run(runs, tmp_path):
    """Its old summary.json goes with the first new round; the resume can finish it there."""
    out = tmp_path / "run"
    first = runs.start("first", "simulate", "--rounds", "1", "--num-nodes", "2",
                       "--output", out)
    assert runs.wait(first) == 0, runs.log("first")
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1
    longer = runs.start("longer", "simulate", "--resume", out, "--rounds", "500")
    _wait_rounds(out, 3, longer, runs)
    longer.send_signal(signal.SIGTERM)
    assert runs.wait(longer, 60) == 130
    done = resume.load(out).round
    assert done >= 3 and len(rounds_of(out)) == done
    assert not (out / "summary.json").exists()  # it described round 1, not the model now
    there = runs.start("there", "simulate", "--resume", out, "--rounds", done)
    assert runs.wait(there) == 0, runs.log("there")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == done and summary["accuracy"] == rounds_of(out)[-1]["accuracy"]
    # the first round of each resumed leg is marked: it waited for the start-up
    assert [r["round"] for r in rounds_of(out) if r.get("resumed")] == [2]


def test_a_resumed_coordinator_waits_for_the_runs_own_number_of_nodes(tmp_path):
    """``--min-nodes`` left out on resume: the run's own 3, not the default 2."""
    from dataclasses import replace

    from fedavg.engines.deployment import coordinator as deploy
    from fedavg.engines.deployment.coordinator_options import CoordinatorOptions

    config = RunConfig().replace(num_nodes=3, rounds=4)
    w = {"a": torch.zeros(3)}
    resume.save(tmp_path, resume.capture(2, w, config, strategies.get("fedavg"),
                                         [rec(1), rec(2)], []))
    options = CoordinatorOptions(insecure=True, wait_timeout=10.0, resume=tmp_path)
    opts = deploy._check_options(RunConfig(), options)
    assert opts.min_nodes == 3 and opts.config.merge.num_nodes == 3
    assert deploy._check_options(RunConfig(), replace(options, min_nodes=4)).min_nodes == 4
    fresh = replace(options, resume=None, output=tmp_path / "new")
    assert deploy._check_options(RunConfig(), fresh).min_nodes == 2


def test_two_nodes_of_one_partition_keep_both_node_models_and_say_so(tmp_path):
    """The second one's model replaced the first's in nodes/node-0, with no word."""
    import types

    from fedavg.run.lifecycle import RunState
    from fedavg.run.server_app import ServerRun

    notes = []
    progress = types.SimpleNamespace(on_note=notes.append)
    run = ServerRun(RunConfig().replace(rounds=1, save_node_models=True),
                    types.SimpleNamespace(meta={"model": None}), tmp_path, RunState(),
                    progress=progress)
    run.adapter = types.SimpleNamespace(reference={"w": torch.zeros(2)})
    for node_id, value in ((7, 1.0), (8, 2.0), (7, 3.0)):  # node 7 again: its own folder
        run.save_node_model(1, {"w": torch.full((2,), value)},
                            {"partition_id": 0, "node_id": node_id, "num_examples": 3})
    assert sorted(d.name for d in (tmp_path / "nodes").iterdir()) == ["node-0", "node-0-8"]
    from safetensors.torch import load_file

    assert load_file(tmp_path / "nodes/node-0/model.safetensors")["w"].tolist() == [3.0, 3.0]
    assert load_file(tmp_path / "nodes/node-0-8/model.safetensors")["w"].tolist() == [2.0, 2.0]
    assert notes == ["nodes 7 and 8 both trained partition 0: its samples count twice in the "
                     "merge"]


def test_an_interrupt_says_when_overwrite_removed_the_previous_run(tmp_path, monkeypatch):
    """It said only "nothing of this run was saved" while the old run was gone too."""
    from fedavg.cli import support as cli_support
    from fedavg.run import output

    monkeypatch.setattr(output, "REPLACED", [])
    (tmp_path / "model.json").write_text("{}")  # the previous run
    (tmp_path / "notes.txt").write_text("mine")
    assert cli_support.interrupted(tmp_path) == ("interrupted before the first round finished: "
                                                 "nothing of this run was saved")
    output.clear_previous_run(tmp_path)
    assert not (tmp_path / "model.json").exists() and (tmp_path / "notes.txt").exists()
    assert cli_support.interrupted(tmp_path) == (
        "interrupted before the first round finished: nothing of this run was saved, and the "
        "run it replaced (--overwrite) was removed as it began training")
    other = tmp_path / "other"
    other.mkdir()
    output.clear_previous_run(other)  # nothing there to remove: nothing said
    assert cli_support.interrupted(other).endswith("nothing of this run was saved")
