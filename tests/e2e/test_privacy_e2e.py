"""Node-level DP end to end in simulation: epsilon per round, the budget, the report."""

import json

import pytest
from helpers.cli import run_cli

pytestmark = pytest.mark.e2e


def test_a_private_run_stops_within_its_budget_and_reports_epsilon(tmp_path):
    out = tmp_path / "private"
    proc = run_cli("simulate", "--num-nodes", "10", "--rounds", "8", "--dp-noise", "2",
                   "--dp-clip", "1", "--dp-epsilon", "6", "--output", out)
    # 10 nodes, every one each round, z = 2: round 6 reaches epsilon 5.98, round 7 would
    # pass 6 (tests/run/test_privacy.py checks these against dp-accounting itself)
    assert "the run stops after round 6 of 8" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    epsilons = [r["epsilon"] for r in rows]
    assert epsilons == sorted(epsilons) and 5.9 < epsilons[-1] <= 6.0
    assert f"epsilon {epsilons[-1]:.3g}" in proc.stdout  # on the round line
    summary = json.loads((out / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(epsilons[-1]) and privacy["delta"] == 1e-5
    assert privacy["rounds"] == 6 and privacy["budget"] == 6.0
    assert "add or remove one node" in privacy["accounting"]
    assert json.loads((out / "model.json").read_text())["privacy"] == privacy
    run_cli("simulate", "--num-nodes", "10", "--rounds", "2", "--output", tmp_path / "plain")
    report = run_cli("report", tmp_path)
    assert "epsilon" in report.stdout and f"{epsilons[-1]:.3f}" in report.stdout
    plain = json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[0])
    assert "epsilon" not in plain  # a run without DP has no epsilon to show
