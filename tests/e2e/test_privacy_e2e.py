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


def test_dp_sgd_on_every_node_accounts_each_node_and_stops_within_the_budget(tmp_path):
    from fedavg.run.privacy import record_epsilon

    out = tmp_path / "dp-sgd"
    proc = run_cli("simulate", "--num-nodes", "3", "--rounds", "6", "--dp-sgd", "--dp-noise",
                   "1.5", "--dp-max-grad-norm", "1", "--dp-epsilon", "1.9", "--output", out)
    # digits: 1,438 train samples, 479-480 a node at --batch-size 32: q = 1/15, 15 steps a
    # round; z = 1.5 spends 1.22, 1.54, 1.80 in rounds 1-3 and 2.03 in round 4
    assert "the run stops after round 3 of 6" in proc.stdout
    assert "record-level DP (DP-SGD on every node)" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["dp_steps"] == {str(k): [1 / 15, 15] for k in range(3)} for r in rows)
    assert [r["epsilon"] for r in rows] == pytest.approx(
        [record_epsilon(1.5, [(1 / 15, 15 * k)], 1e-5) for k in (1, 2, 3)])
    assert rows[-1]["accuracy"] > 0.5  # it learns through the noise (0.1 is chance)
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    assert privacy["level"] == "record" and privacy["epsilon"] == pytest.approx(
        rows[-1]["epsilon"]) and privacy["nodes"] == 3 and privacy["budget"] == 1.9
    assert json.loads((out / "model.json").read_text())["privacy"] == privacy
    # resumed, the accountant replays the three rounds from metrics.jsonl: nothing is left
    again = run_cli("simulate", "--resume", out, "--rounds", "6", check=False)
    assert again.returncode == 2
    assert "this run has spent its --dp-epsilon 1.9 (epsilon 1.8 after round 3)" in again.stderr
