"""Task arithmetic, TIES, DARE, DARE-TIES and Fisher merging end to end, in a run and offline."""

import json

import pytest
import torch
from helpers.cli import SHARED_DATA, assert_one_error_line, run_cli
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

METHODS = ("task-arithmetic", "ties", "dare", "dare-ties")


@pytest.fixture(scope="module")
def one_shot_run(tmp_path_factory):
    """Five label-skewed nodes trained once from one start, their models kept."""
    run = tmp_path_factory.mktemp("tv") / "run"
    run_cli("simulate", "--strategy", "ties", "--rounds", "1", "--local-epochs", "5",
            "--num-nodes", "5", "--partitioner", "dirichlet", "--alpha", "0.5", "--seed", "1",
            "--save-node-models", "--output", run)
    return run


def test_a_one_shot_ties_run_keeps_the_start_and_merges_as_fedavg_merge_does(one_shot_run,
                                                                             tmp_path):
    run = one_shot_run
    start = load_file(run / "start" / "model.safetensors")
    assert json.loads((run / "start" / "model.json").read_text())["rounds"] == 0
    # the nodes trained away from the start
    node = load_file(run / "nodes" / "node-0" / "model.safetensors")
    assert any(not torch.equal(node[k], start[k]) for k in start)
    # the same merge offline, its start read from the run: the run's own model again
    again = tmp_path / "again"
    run_cli("merge", run / "nodes", "--strategy", "ties", "--output", again)
    mine, theirs = load_file(again / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.allclose(mine[k].float(), theirs[k].float(), atol=1e-6) for k in theirs)
    assert json.loads((again / "model.json").read_text())["start"] == str(run / "start")


@pytest.mark.parametrize("method", METHODS)
def test_each_method_merges_saved_node_models_into_a_working_model(one_shot_run, tmp_path,
                                                                   method):
    run = one_shot_run
    out = tmp_path / method
    proc = run_cli("merge", run / "nodes", "--strategy", method, "--start", run / "start",
                   "--dataset", "digits", "--output", out)
    assert f"merged 5 models with {method}" in proc.stdout
    accuracy = json.loads((out / "summary.json").read_text())["accuracy"]
    average = tmp_path / "average"
    if not average.exists():
        run_cli("merge", run / "nodes", "--strategy", "average", "--dataset", "digits",
                "--output", average)
    baseline = json.loads((average / "summary.json").read_text())["accuracy"]
    assert accuracy >= 0.80 and accuracy >= baseline - 0.05, (method, accuracy, baseline)
    merged = load_file(out / "model.safetensors")
    averaged = load_file(average / "model.safetensors")
    differs = any(not torch.allclose(merged[k].float(), averaged[k].float()) for k in merged)
    assert differs == (method != "task-arithmetic")  # at scale 1 it is the average


def test_a_start_is_needed_and_used_only_by_task_vector_merges(one_shot_run, tmp_path):
    nodes = [one_shot_run / "nodes" / "node-0", one_shot_run / "nodes" / "node-1"]
    copy = tmp_path / "elsewhere"  # node models outside their run: no start beside them
    for n in nodes:
        (copy / n.name).mkdir(parents=True)
        for f in n.iterdir():
            (copy / n.name / f.name).write_bytes(f.read_bytes())
    proc = run_cli("merge", copy, "--strategy", "dare", "--output", tmp_path / "m", check=False)
    assert proc.returncode == 2
    assert "pass --start MODEL_FOLDER" in assert_one_error_line(proc.stderr)
    proc = run_cli("merge", *nodes, "--strategy", "average", "--start", one_shot_run / "start",
                   "--output", tmp_path / "m", check=False)
    assert proc.returncode == 2 and "does not use --start" in assert_one_error_line(proc.stderr)
    proc = run_cli("merge", *nodes, "--strategy", "ties", "--start", tmp_path / "none",
                   "--output", tmp_path / "m", check=False)
    assert proc.returncode == 2 and "no such model folder" in assert_one_error_line(proc.stderr)
    assert not (tmp_path / "m").exists()
    # the merged model may not replace the start it is measured from
    proc = run_cli("merge", *nodes, "--strategy", "ties", "--start", one_shot_run / "start",
                   "--output", one_shot_run / "start", "--overwrite", check=False)
    assert proc.returncode == 2
    assert "holds the models being merged" in assert_one_error_line(proc.stderr)
    assert json.loads((one_shot_run / "start" / "model.json").read_text())["rounds"] == 0


def test_a_start_unlike_the_nodes_is_refused_and_a_trained_one_noted(one_shot_run, tmp_path):
    other = tmp_path / "other-start"
    other.mkdir()
    for f in (one_shot_run / "start").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    meta = json.loads((other / "model.json").read_text())
    meta["input"]["mean"] = [0.9]  # another input preparation
    (other / "model.json").write_text(json.dumps(meta))
    proc = run_cli("merge", one_shot_run / "nodes", "--strategy", "ties", "--start", other,
                   "--output", tmp_path / "m", check=False)
    assert proc.returncode == 2 and "in its inputs" in assert_one_error_line(proc.stderr)
    # the run's merged model is no start: measured after round 1, not before it
    proc = run_cli("merge", one_shot_run / "nodes", "--strategy", "ties", "--start",
                   one_shot_run, "--output", tmp_path / "m")
    assert "is a model after round 1, while the nodes trained in round 1" in " ".join(
        proc.stdout.split())


def test_fisher_nodes_send_their_estimate_which_merges_again_offline(tmp_path):
    run = tmp_path / "fisher"
    run_cli("simulate", "--strategy", "fisher", "--fisher-samples", "64", "--rounds", "1",
            "--local-epochs", "3", "--num-nodes", "3", "--partitioner", "dirichlet", "--alpha",
            "0.5", "--seed", "1", "--save-node-models", "--output", run)
    summary = json.loads((run / "summary.json").read_text())
    # the estimate is one more model-sized message from each node: counted with the reply
    assert summary["bytes_from_nodes"] > 1.9 * summary["bytes_to_nodes"]
    fisher = load_file(run / "nodes" / "node-0" / "fisher.safetensors")
    model = load_file(run / "nodes" / "node-0" / "model.safetensors")
    assert set(fisher) <= set(model) and all((f >= 0).all() for f in fisher.values())
    assert any(f.sum() > 0 for f in fisher.values())
    again = tmp_path / "again"
    run_cli("merge", run / "nodes", "--strategy", "fisher", "--output", again)
    mine, theirs = load_file(again / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.allclose(mine[k].float(), theirs[k].float(), atol=1e-6) for k in theirs)
    # another node's estimate in its place: refused, the model names its own
    node1 = run / "nodes" / "node-1" / "fisher.safetensors"
    mine = node1.read_bytes()
    node1.write_bytes((run / "nodes" / "node-0" / "fisher.safetensors").read_bytes())
    proc = run_cli("merge", run / "nodes", "--strategy", "fisher", "--output", tmp_path / "m",
                   check=False)
    assert proc.returncode == 2 and "SHA-256 differs" in assert_one_error_line(proc.stderr)
    node1.write_bytes(mine)
    (run / "nodes" / "node-1" / "fisher.safetensors").unlink()
    proc = run_cli("merge", run / "nodes", "--strategy", "fisher", "--output", tmp_path / "m",
                   check=False)
    assert proc.returncode == 2
    assert "has no fisher.safetensors" in assert_one_error_line(proc.stderr)


def test_fisher_with_lora_adapters_is_refused_before_anything_trains(tmp_path):
    proc = run_cli("simulate", "--strategy", "fisher", "--model", "minilm", "--lora-rank", "4",
                   "--dataset", SHARED_DATA / "ag_news", "--rounds", "1", "--output",
                   tmp_path / "run", check=False)
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert "cannot estimate their Fisher: use ties, dare or task-arithmetic" in line
    assert not (tmp_path / "run").exists()
