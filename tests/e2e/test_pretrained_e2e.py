"""End to end with real pretrained weights: MiniLM LoRA adapters on a few hundred AG News texts."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from helpers.cli import SHARED_DATA, run_cli

pytestmark = pytest.mark.e2e

SPORTS = "The Yankees beat the Red Sox 7-2 as their pitcher threw a shutout in the playoff game"
#: all-MiniLM-L6-v2's weights, float32 (22.7M values)
FULL_MODEL_BYTES = 90_800_000


def _news(folder, train=400, test=200):
    folder.mkdir()
    for split, rows in (("train", train), ("test", test)):
        table = pq.read_table(SHARED_DATA / "ag_news" / f"{split}.parquet").slice(0, rows)
        pq.write_table(table, folder / f"{split}.parquet")
    return folder


def test_minilm_lora_trains_adapters_only_merges_exactly_predicts_and_exports(tmp_path,
                                                                             no_leaks):
    out = tmp_path / "run"
    proc = run_cli("simulate", "--dataset", _news(tmp_path / "news"), "--model", "minilm",
                   "--lora-rank", "4", "--num-nodes", "2", "--rounds", "1", "--max-tokens",
                   "32", "--optimizer", "adam", "--lr", "0.001", "--output", out)
    assert "LoRA r=4, alpha=16 on 12 layers (query,value), head head" in proc.stdout
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["lora"]["merge"] == "exact"
    assert meta["input"]["tokenizer"]["kind"] == "file"  # minilm's own, no --tokenizer
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # up: 2 nodes x (adapters + head), far below 2 % of the full model each; down in round 1
    # the same (every node builds the adapted weights from its own install)
    assert 0 < row["bytes_from_nodes"] < 2 * 0.02 * FULL_MODEL_BYTES, row
    assert row["bytes_to_nodes"] == row["bytes_from_nodes"], row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] > 0.5, summary  # 4 classes; the base alone is chance
    pred = run_cli("predict", out, SPORTS, "--text", "--output", "-").stdout
    assert f"{SPORTS},sports," in pred

    full = tmp_path / "full"
    run_cli("export", out, "--output", full)
    assert "lora" not in json.loads((full / "model.json").read_text())["model"]
    assert (full / "model.safetensors").stat().st_size > FULL_MODEL_BYTES * 0.99
    ev = json.loads(run_cli("evaluate", full, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3)


def test_an_ensemble_of_lora_nodes_saves_one_base_and_each_nodes_adapters(tmp_path, no_leaks):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageClassification, ViTConfig

    folder = tmp_path / "vit"  # a pretrained base: weights in model.safetensors
    AutoModelForImageClassification.from_config(ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_channels=3)).save_pretrained(folder)
    out = tmp_path / "run"
    proc = run_cli("simulate", "--model", f"hf:{folder}", "--lora-rank", "2", "--strategy",
                   "ensemble", "--rounds", "1", "--num-nodes", "3", "--output", out)
    assert "each member keeps its own adapters" in proc.stdout
    meta = json.loads((out / "model.json").read_text())
    assert meta["kind"] == "ensemble" and meta["model"]["lora"]["merge"] == "average"
    saved = load_file(out / "model.safetensors")
    members = {k.split(".", 2)[1] for k in saved}
    assert members == {"0", "1", "2"}  # member.<i>.<key>
    assert all(".lora_" in k or ".classifier." in k for k in saved), sorted(saved)[:5]
    base_bytes = (folder / "model.safetensors").stat().st_size
    assert (out / "model.safetensors").stat().st_size < base_bytes  # 3 adapters < 1 base
    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(json.loads(
        (out / "summary.json").read_text())["accuracy"], abs=1e-3)


def _vit(folder):
    from transformers import AutoModelForImageClassification, ViTConfig

    AutoModelForImageClassification.from_config(ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_channels=3)).save_pretrained(folder)
    return folder


def test_exact_lora_updates_travel_low_rank_and_train_as_whole_weights_do(tmp_path, no_leaks,
                                                                          monkeypatch):
    """The nodes rebuild W from low-rank updates: the run equals one sending W whole."""
    import fedavg
    from fedavg.config.settings import RunConfig
    from fedavg.run.lora_transport import LoraTransport

    config = RunConfig().replace(model=f"hf:{_vit(tmp_path / 'vit')}", lora_rank=2,
                                 rounds=3, num_nodes=3, lr=0.1)
    lean = fedavg.simulate(config, output=tmp_path / "lean")
    monkeypatch.setattr(LoraTransport, "_needs", lambda self, node: None)  # W whole, always
    whole = fedavg.simulate(config, output=tmp_path / "whole")
    for a, b in zip(lean.rounds, whole.rounds):
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=0.01)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
    # round 1: every node builds the base itself; then the rank-6 updates, not W
    down = [r["bytes_to_nodes"] for r in lean.rounds]
    assert down[0] < down[1] == down[2] < whole.rounds[1]["bytes_to_nodes"], (down, whole.rounds)
    assert [r["bytes_from_nodes"] for r in lean.rounds] == [
        r["bytes_from_nodes"] for r in whole.rounds]


@pytest.mark.parametrize("strategy", ["scaffold", "feddyn", "moon", "fednova", "fedadam"])
def test_strategies_whose_nodes_train_differently_train_adapters_too(tmp_path, strategy):
    """Node rules see the trainable adapters and head; the frozen base never travels."""
    from safetensors.torch import load_file

    out, vit = tmp_path / "run", _vit(tmp_path / "vit")
    run_cli("simulate", "--model", f"hf:{vit}", "--lora-rank", "2", "--strategy", strategy,
            "--rounds", "2", "--num-nodes", "3", "--lr", "0.05", "--output", out)
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["num_nodes"], r["num_failed"]) for r in rounds] == [(3, 0), (3, 0)], rounds
    # the nodes' adapters were trained and folded into the adapted weights
    from fedavg.models.registry import ModelSpec

    spec = ModelSpec.from_dict(json.loads((out / "model.json").read_text())["model"])
    base = spec.build().pretrained_weights()  # W as every node builds it
    saved = load_file(out / "model.safetensors")
    assert base and set(base) <= set(saved)
    assert all(not torch.equal(saved[k], w) for k, w in base.items())
