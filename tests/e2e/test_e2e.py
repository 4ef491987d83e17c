"""End-to-end: the real CLI on real data (scikit-learn digits, MNIST from ../shared/data)."""

import csv
import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.cli import engine_processes, run_cli
from helpers.patience import within
from PIL import Image

pytestmark = pytest.mark.e2e

ROUND_KEYS = {"round", "accuracy", "loss", "train_loss", "num_nodes", "wall_s"}


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_run_whose_output_pipe_closes_trains_on_and_saves(tmp_path, no_leaks):
    """``fedavg simulate | head -2``: the reader leaves; the run finishes, exit code 0."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli", "simulate", "--rounds", "2",
                             "--output", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()  # the first line, then the reader is gone
    proc.stdout.close()
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    assert (out / "model.safetensors").exists()


def test_default_simulate_on_digits_then_evaluate_and_predict(tmp_path, no_leaks):
    out = tmp_path / "run"
    proc = run_cli("simulate", "--output", out)
    assert "round" in proc.stdout and "accuracy" in proc.stdout  # per-round table on console

    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy", "loss", "rounds", "num_nodes", "wall_s"} <= set(summary)
    assert summary["accuracy"] >= 0.90, summary
    assert summary["rounds"] == 10 and summary["num_nodes"] == 5
    startup = summary["startup_s"]  # where the time before round 2 went, phase by phase
    assert list(startup) == ["imports", "prepare", "node_data", "ray_start", "engine_start",
                             "round1", "stop"]
    assert all(v >= 0 for v in startup.values()) and startup["imports"] > 0.1, startup
    assert sum(startup.values()) - startup["imports"] < summary["wall_s"], startup

    rounds = _read_jsonl(out / "metrics.jsonl")
    assert startup["round1"] == pytest.approx(rounds[0]["wall_s"], abs=0.01)
    assert [r["round"] for r in rounds] == list(range(1, 11))
    assert all(ROUND_KEYS <= set(r) for r in rounds)
    assert all(r["num_nodes"] == 5 for r in rounds)
    assert rounds[-1]["accuracy"] == summary["accuracy"]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]  # nodes really trained
    # bytes on the wire: each of the 5 nodes gets the model and sends it back, serialised
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    for r in rounds:  # plus a .npy header (< 200 bytes) per array
        for way in ("bytes_to_nodes", "bytes_from_nodes"):
            assert 5 * model_bytes < r[way] < 5 * (model_bytes + 200 * len(weights)), r
    assert summary["bytes_to_nodes"] == sum(r["bytes_to_nodes"] for r in rounds)
    assert summary["bytes_from_nodes"] == sum(r["bytes_from_nodes"] for r in rounds)
    assert re.search(r"sent\s+[\d.]+\s+[kMG]?B\s+got\s+[\d.]+\s+[kMG]?B", proc.stdout)

    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["name"] == "mlp" and meta["classes"] == [str(i) for i in range(10)]
    assert meta["input"]["shape"] == [1, 8, 8] and meta["strategy"] == "fedavg"
    assert meta["rounds"] == 10 and meta["dataset"]["source"] == "digits"
    assert (out / "model.safetensors").stat().st_size > 0

    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3)
    assert ev["num_examples"] == 359  # the same seeded 20 % hold-out as in training

    # predict on PNG files of held-out digits, loading only the saved artifacts
    from fedavg.data.load import load

    test = load("digits", seed=0).test
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i in range(30):
        Image.fromarray(test.x[i, 0]).save(folder / f"{i:02d}_label{test.y[i]}.png")
    preds = tmp_path / "predictions.csv"
    run_cli("predict", out, folder / f"00_label{test.y[0]}.png", folder, "--output", preds)
    with open(preds) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 30  # one file + a folder of 30 holding it: each image once
    assert set(rows[0]) == {"input", "prediction", "class_index", "confidence"}
    correct = sum(r["prediction"] == r["input"].rsplit("label", 1)[1][0] for r in rows)
    assert correct / len(rows) >= 0.8
    assert all(0 < float(r["confidence"]) <= 1 for r in rows)


def test_python_api_dirichlet(tmp_path, no_leaks):
    import torch

    import fedavg
    from fedavg.data.load import load, normalize

    res = fedavg.simulate(dataset="digits", partitioner="dirichlet", alpha=0.5, num_nodes=4,
                          rounds=4, fraction=0.5, output=tmp_path / "api")
    assert len(res.rounds) == 4
    assert all(r["num_nodes"] == 2 for r in res.rounds)  # participation fraction 0.5 of 4
    assert json.loads(res.summary_path.read_text())["accuracy"] == res.accuracy
    assert res.accuracy > 0.5

    model = fedavg.load_model(res.model_dir)
    assert isinstance(model, torch.nn.Module)
    test = load("digits", seed=0).test
    with torch.no_grad():
        logits = model(normalize(torch.as_tensor(test.x), model.fedavg_meta["input"]))
    acc = float((logits.argmax(1).numpy() == test.y).mean())
    assert acc == pytest.approx(res.accuracy, abs=1e-6)
    assert fedavg.evaluate_model(res.model_dir)["accuracy"] == pytest.approx(acc, abs=1e-6)
    # the API function, not the submodule, even after the submodule was imported
    rows = fedavg.predict(res.model_dir, ["digits"])
    assert len(rows) == len(test.y)
    assert np.mean([int(r["prediction"]) == y for r, y in zip(rows, test.y)]) == \
        pytest.approx(acc, abs=1e-6)


def test_one_node_run(tmp_path, no_leaks):
    """Minimum node counts come from the run: a single node works and nothing waits.

    Also: a RAY_ADDRESS in the environment does not send the run's own Ray elsewhere.
    """
    res = run_cli("simulate", "--num-nodes", "1", "--rounds", "2", "--output", tmp_path / "one",
                  timeout=300, env={"RAY_ADDRESS": "127.0.0.1:1"})
    rounds = _read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["num_nodes"] for r in rounds] == [1, 1], res.stdout


def test_mnist_end_to_end(tmp_path, mnist_path, no_leaks):
    out = tmp_path / "mnist"
    run_cli("simulate", "--dataset", mnist_path, "--num-nodes", "3", "--rounds", "2",
            "--model", "mlp", "--partitioner", "iid", "--output", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_samples"] == 10000 and summary["train_samples"] == 60000
    assert summary["accuracy"] >= 0.93, summary
    ev = json.loads(run_cli("evaluate", out, "--dataset", mnist_path, "--json").stdout)
    assert ev["num_examples"] == 10000
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3)
    preds = tmp_path / "p.json"
    run_cli("predict", out, mnist_path, "--output", preds)
    rows = json.loads(preds.read_text())
    assert len(rows) == 10000
    from fedavg.data.load import load

    labels = load(str(mnist_path)).test.y
    acc = np.mean([int(r["prediction"]) == y for r, y in zip(rows, labels)])
    assert acc == pytest.approx(summary["accuracy"], abs=1e-3)


def test_failing_nodes_fail_the_run_clearly(tmp_path, no_leaks):
    proc = run_cli("simulate", "--num-nodes", "2", "--rounds", "2", "--lr", "1e30",
                   "--output", tmp_path / "bad", check=False, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "FloatingPointError: training diverged" in proc.stderr
    assert "lower --lr" in proc.stderr
    assert not (tmp_path / "bad").exists()  # no empty run folder is left


# SIGTERM takes the same handler (tests/cli/test_cli.py); test_cleanup.py and test_deployment.py
# send it
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_interrupt_keeps_finished_rounds_and_leaves_no_process(tmp_path, sig):
    before = {p.split(":")[0] for p in engine_processes()}
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedavg.cli", "simulate", "--rounds", "500",
         "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + within(240)
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    # finished rounds are kept: the model of the last finished round loads
    import fedavg

    done = len(_read_jsonl(out / "metrics.jsonl"))
    assert done >= 2
    assert fedavg.load_model(out).fedavg_meta["rounds"] >= 2
    time.sleep(1)
    leaked = [p for p in engine_processes() if p.split(":")[0] not in before]
    assert not leaked, leaked


def test_one_shot_ensemble_node_models_and_offline_merge(tmp_path, no_leaks):
    run = tmp_path / "ens"
    run_cli("simulate", "--strategy", "ensemble", "--ensemble-weights", "fitted", "--rounds", "1",
            "--local-epochs", "4", "--num-nodes", "3", "--save-node-models", "--output", run)
    meta = json.loads((run / "model.json").read_text())
    assert meta["kind"] == "ensemble" and len(meta["member_weights"]) == 3
    assert sum(meta["member_weights"]) == pytest.approx(1.0)
    assert meta["dataset"]["validation_samples"] == 144  # 10 % of digits' train, kept from nodes
    summary = json.loads((run / "summary.json").read_text())
    ev = json.loads(run_cli("evaluate", run, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3) and ev["accuracy"] > 0.85
    nodes = sorted(p.name for p in (run / "nodes").iterdir())
    assert nodes == ["node-0", "node-1", "node-2"]
    node_meta = json.loads((run / "nodes" / "node-1" / "model.json").read_text())
    assert node_meta["node"]["partition_id"] == 1 and node_meta["node"]["num_examples"] > 0

    # offline: the node models merged again, with a method that needs held-out data
    soup = tmp_path / "soup"
    out = run_cli("merge", run / "nodes", "--strategy", "greedy-soup", "--validation", "digits",
                  "--dataset", "digits", "--output", soup).stdout
    assert "merged 3 models with greedy-soup" in out
    soup_summary = json.loads((soup / "summary.json").read_text())
    members = soup_summary["merge_info"]["members"]
    assert 1 <= len(members) <= 3
    assert f"kept {len(members)} of 3: {', '.join(members)}" in out
    assert json.loads(run_cli("evaluate", soup, "--json").stdout)["accuracy"] == pytest.approx(
        soup_summary["accuracy"], abs=1e-6)
    ens = tmp_path / "ens2"
    run_cli("merge", "--models", run / "nodes", "--strategy", "ensemble", "--output", ens)
    preds = tmp_path / "p.csv"
    run_cli("predict", ens, "digits", "--output", preds)
    assert len(preds.read_text().splitlines()) == 360  # header + 359 held-out digits

    bad = run_cli("simulate", "--strategy", "ensemble", "--rounds", "3", check=False)
    assert bad.returncode == 2 and "--rounds 1" in bad.stderr


def test_server_optimiser_and_fedprox_runs(tmp_path, no_leaks):
    import fedavg

    for name in ("fedadam", "fedprox"):
        res = fedavg.simulate(strategy=name, rounds=4, num_nodes=3, output=tmp_path / name)
        accs = [r["accuracy"] for r in res.rounds]
        assert accs[-1] > accs[0] and accs[-1] > 0.8, (name, accs)
        assert json.loads((res.output / "model.json").read_text())["strategy"] == name
    # the node recipe: augmented batches, a cosine schedule, a per-round decay, SAM and the
    # logit-adjusted loss on the nodes, not at evaluation
    res = fedavg.simulate(rounds=4, num_nodes=3, augment=True, lr_schedule="cosine",
                          lr_decay=0.9, sam_rho=0.05, logit_adjust=1.0,
                          output=tmp_path / "recipe")
    accs = [r["accuracy"] for r in res.rounds]
    assert accs[-1] > accs[0] and accs[-1] > 0.5, accs
    train = json.loads(res.summary_path.read_text())["config"]["train"]
    assert (train["augment"], train["lr_schedule"], train["lr_decay"], train["sam_rho"],
            train["logit_adjust"]) == (True, "cosine", 0.9, 0.05, 1.0)
    assert fedavg.evaluate_model(res.model_dir)["accuracy"] == pytest.approx(res.accuracy)


def test_two_runs_at_once_do_not_touch_each_other(tmp_path, no_leaks):
    """Both in this process group: one run's clean-up must not stop the other's engine."""
    long_run = subprocess.Popen(
        [sys.executable, "-m", "fedavg.cli", "simulate", "--rounds", "12", "--local-epochs",
         "3", "--output", str(tmp_path / "long")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + within(120)
        while not (tmp_path / "long" / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        run_cli("simulate", "--rounds", "1", "--num-nodes", "2", "--output", tmp_path / "short")
        _, err = long_run.communicate(timeout=300)
    finally:
        if long_run.poll() is None:
            long_run.kill()
    assert long_run.returncode == 0, err
    assert len(_read_jsonl(tmp_path / "long" / "metrics.jsonl")) == 12


def test_overwrite_replaces_the_previous_run_as_a_whole(tmp_path, no_leaks):
    """A run given --overwrite that fails in round 1 leaves none of the old run's files."""
    out = tmp_path / "run"
    run_cli("simulate", "--strategy", "ensemble", "--rounds", "1", "--num-nodes", "2",
            "--save-node-models", "--output", out)
    (out / "notes.txt").write_text("mine")
    assert (out / "nodes" / "node-1" / "model.safetensors").exists()
    assert (out / "start" / "model.safetensors").exists()  # what the nodes started from
    bad_model = run_cli("simulate", "--model", "nope", "--output", out, "--overwrite",
                        check=False)
    assert bad_model.returncode == 2 and (out / "model.safetensors").exists()  # not started
    diverged = run_cli("simulate", "--rounds", "1", "--num-nodes", "2", "--lr", "1e30",
                       "--output", out, "--overwrite", check=False)
    assert diverged.returncode == 1, diverged.stderr
    left = sorted(p.name for p in out.iterdir())
    assert left == ["notes.txt"], left


def test_without_a_terminal_a_long_phase_prints_a_line_at_least_every_heartbeat(tmp_path,
                                                                             no_leaks):
    # stdout is a pipe here, as under nohup or in CI: no bar is drawn; heartbeat every 0.5 s
    proc = run_cli("simulate", "--rounds", "2", "--local-epochs", "3", "--output",
                   tmp_path / "run", env={"FEDAVG_HEARTBEAT_S": "0.5"})
    beats = re.findall(r"\.\.\. still (training round \d|finishing) \((\d+) s\)", proc.stdout)
    assert beats and beats[0][0] == "training round 1", proc.stdout
    assert all(int(seconds) >= 0 for _, seconds in beats)
    lines = proc.stdout.splitlines()
    first_round = next(i for i, line in enumerate(lines) if line.startswith("round   1/2"))
    assert any("still training round 1" in line for line in lines[:first_round])
