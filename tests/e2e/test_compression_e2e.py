"""Compressed node updates end to end in simulation: every codec, the bytes that travel, resume."""

import json

import pytest
from helpers.cli import run_cli

pytestmark = pytest.mark.e2e


def rounds(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_codec_trains_digits_and_sends_fewer_bytes(tmp_path):
    got = {}
    for codec in ("none", "int8", "int4", "topk", "down"):
        out = tmp_path / codec
        how = ["--compress-down", "int8"] if codec == "down" else ["--compress", codec]
        run_cli("simulate", "--num-nodes", "3", "--rounds", "4", *how,
                "--topk-fraction", "0.1", "--output", out)
        got[codec] = rounds(out)
    # --compress-down int8: the round's weights travel quantised, the replies whole
    downlink = got.pop("down")
    assert 0.24 < sum(r["bytes_to_nodes"] for r in downlink) / sum(
        r["bytes_to_nodes"] for r in got["none"]) < 0.29
    assert [r["bytes_from_nodes"] for r in downlink] == [
        r["bytes_from_nodes"] for r in got["none"]]
    # the merge stays exact (each node moved onto the exact start): no drift over rounds
    assert downlink[-1]["accuracy"] >= got["none"][-1]["accuracy"] - 0.01
    up = {c: sum(r["bytes_from_nodes"] for r in rs) for c, rs in got.items()}
    down = {c: sum(r["bytes_to_nodes"] for r in rs) for c, rs in got.items()}
    assert len(set(down.values())) == 1  # the coordinator sends the model whole either way
    assert up["none"] == down["none"]
    # digits' MLP: its three weight matrices are encoded, its 410 biases travel as they are
    assert 0.24 < up["int8"] / up["none"] < 0.29
    assert 0.12 < up["int4"] / up["none"] < 0.17
    assert 0.2 < up["topk"] / up["none"] < 0.25  # 10 % of entries, 8 bytes each, + biases
    final = {c: rs[-1]["accuracy"] for c, rs in got.items()}
    assert final["int8"] >= final["none"] - 0.01
    assert final["int4"] >= final["none"] - 0.03
    assert final["topk"] >= 0.7, final


def test_error_feedback_survives_a_resume(tmp_path):
    """A run stopped after round 2 and resumed ends where an unbroken one does."""
    args = ["--num-nodes", "2", "--compress", "topk", "--topk-fraction", "0.05"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_cli("simulate", *args, "--rounds", "4", "--output", whole)
    run_cli("simulate", *args, "--rounds", "2", "--output", part)
    run_cli("simulate", "--resume", part, "--rounds", "4")
    assert (whole / "model.safetensors").read_bytes() == (part / "model.safetensors").read_bytes()
