"""``fedavg report``: the finished runs under a folder, tables, CSV, plots, published figures.

The end-to-end ones (marker ``e2e``) run ``fedavg sweep`` and ``fedavg report`` for real.
"""

import csv
import json
import shutil
import time
import types
from pathlib import Path

import pytest
from helpers.cli import assert_one_error_line, engine_processes, run_cli
from helpers.sweeps import fake_run, sweep_record, toml
from PIL import Image
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.config.settings import RunConfig
from fedavg.sweeps.grid import load_sweep
from fedavg.sweeps.report import Run, find_runs, write_report
from fedavg.sweeps.runs import read_run
from fedavg.util.errors import UserError


def test_report_names_model_args_as_sweep_points_do():
    from fedavg.sweeps.runs import flat_settings

    config = RunConfig().replace(model_args={"hidden": 16, "act": "gelu"}).as_dict()
    assert flat_settings({"config": config})["model-args"] == "hidden=16,act=gelu"
    assert flat_settings({"config": RunConfig().as_dict()}).get("model-args") is None


def test_report_names_a_local_dataset_by_its_absolute_path(tmp_path, monkeypatch):
    """The same file given relative and absolute is one dataset in a report."""
    from fedavg.run.lifecycle import prepare, write_summary
    from fedavg.sweeps.runs import flat_settings

    (tmp_path / "t.csv").write_text("\n".join(
        ["a,b,label"] + [f"{i},{i % 5},{'xy'[i % 2]}" for i in range(20)]) + "\n")
    monkeypatch.chdir(tmp_path)
    config = RunConfig().replace(dataset="t.csv", num_nodes=2)
    result = types.SimpleNamespace(
        summary_path=tmp_path / "summary.json", accuracy=0.5, loss=1.0,
        rounds=[{"accuracy": 0.5}], num_nodes=2, wall_s=1.0, failures=[], startup_s=None)
    write_summary(result, prepare(config), config)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == str(tmp_path / "t.csv")
    assert flat_settings(summary)["dataset"] == str(tmp_path / "t.csv")


def test_corrupt_run_files_are_left_out_with_a_note(tmp_path):
    fake_run(tmp_path / "good", [0.5, 0.9], 10.0)
    (fake_run(tmp_path / "listed", [0.5], 5.0) / "summary.json").write_text("[1, 2]")
    nan = fake_run(tmp_path / "nan", [0.5, 0.6], 5.0)
    (nan / "summary.json").write_text((nan / "summary.json").read_text().replace(
        '"accuracy": 0.6', '"accuracy": NaN'))
    (tmp_path / "sweep.json").write_text("[]")
    runs, notes = find_runs(tmp_path)
    assert [r.path.name for r in runs] == ["good"]
    assert sorted(n.split(" left out")[0].rsplit("/", 1)[-1] for n in notes) == ["listed",
                                                                                 "nan"]
    result = write_report(tmp_path)
    assert result["num_runs"] == 1
    assert any("sweep.json is not a sweep record" in n for n in result["notes"])
    (fake_run(tmp_path / "stopped", [0.5], 5.0) / "summary.json").unlink()  # was silent
    runs, notes = find_runs(tmp_path)
    assert [r.path.name for r in runs] == ["good"]
    assert f"{tmp_path / 'stopped'} left out: no summary.json (a run stopped before its end; " \
           f"--resume {tmp_path / 'stopped'} finishes it)" in notes
    shutil.rmtree(tmp_path / "stopped")
    (fake_run(tmp_path / "empty", [0.5], 5.0) / "metrics.jsonl").write_text("")
    runs, notes = find_runs(tmp_path)
    assert sorted(r.path.name for r in runs) == ["empty", "good"]
    assert f"{tmp_path / 'empty'}: its metrics.jsonl holds no rounds, so it has no curve, " \
           "target round or round time" in notes


def test_a_run_inside_a_run_folder_is_found(tmp_path):
    outer = fake_run(tmp_path / "outer", [0.5, 0.6], 5.0)
    fake_run(outer / "inner", [0.7], 5.0)  # --output chosen inside a run's folder
    (outer / "nodes" / "node-0").mkdir(parents=True)  # a run's node models are no runs
    (outer / "nodes" / "node-0" / "model.json").write_text("{}")
    runs, notes = find_runs(tmp_path)
    assert [r.path for r in runs] == [outer, outer / "inner"] and notes == []


def test_a_bad_metrics_line_leaves_out_that_line_not_the_run(tmp_path):
    """A line cut short (a killed run), edited or not JSON: the run stays, the line is named."""
    run = fake_run(tmp_path / "cut", [0.5, 0.6, 0.7, 0.8], 5.0)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = "not json"  # line 2
    lines[2] = '{"round": 3, "accuracy": NaN}'  # line 3
    lines.append(lines[3][:25])  # line 5: the last line, cut short
    lines.append(lines[0].replace("0.5", "0.55"))  # round 1 again: the last record counts
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    runs, notes = find_runs(tmp_path)
    assert [r.path.name for r in runs] == ["cut"]
    assert runs[0].curve == [(1, 0.55), (4, 0.8)] and runs[0].accuracy == 0.8
    assert notes == [f"{run}: line(s) 2, 3, 5 of its metrics.jsonl are not round records; "
                     "they are left out of its curve"]


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    fake_run(root / "a" / "fedavg-0", [0.5, 0.8], 10.0, strategy="fedavg", seed=0)
    fake_run(root / "a" / "fedavg-1", [0.6, 0.9], 20.0, strategy="fedavg", seed=1)
    fake_run(root / "b" / "deep" / "fedavg-2", [0.7, 0.7], 30.0, strategy="fedavg", seed=2)
    fake_run(root / "fedprox-0", [0.4, 0.95], 12.5, strategy="fedprox", seed=0)
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "summary.json").write_text("{}")  # no model.json, metrics.jsonl
    return root


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path) as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("walls, median", [
    ([0.2, 0.4, 0.3], 0.3),
    ([0.2, 0.4, 0.3, 0.5], 0.3),  # the lower median: a round that was run, not 0.35
    ([0.2], 0.2),
    ([], None),  # a one-round run has no round without the start-up
])
def test_round_time_is_the_lower_median_of_the_rounds_without_start_up(walls, median):
    run = Run(Path("r"), {}, 0.9, 0.9, len(walls) + 1, 10.0, [], walls)
    assert run.round_s == median


def test_report_has_one_rounds_column_when_rounds_is_a_setting_that_varies(tmp_path):
    fake_run(tmp_path / "two", [0.5, 0.8], 10.0)
    fake_run(tmp_path / "three", [0.5, 0.8, 0.9], 12.0)
    write_report(tmp_path)
    for name in ("results.csv", "runs.csv"):
        header = (tmp_path / name).read_text().splitlines()[0].split(",")
        assert header.count("rounds") == 1, header
    assert sorted(r["rounds"] for r in _csv(tmp_path / "runs.csv")) == ["2", "3"]
    head = (tmp_path / "results.md").read_text().split("\n| ", 1)[1].splitlines()[0]
    assert head.count("| rounds |") + head.startswith("rounds |") == 1, head
    fake_run(tmp_path / "seed", [0.5, 0.9, 0.9], 12.0, seed=1)  # rounds no longer varies alone
    write_report(tmp_path / "seed")
    assert "rounds" in _csv(tmp_path / "seed" / "results.csv")[0]


def test_report_piped_prints_the_markdown_table_with_whole_rows(runs):
    res = CliRunner().invoke(app, ["report", str(runs), "--target", "0.85"])  # not a terminal
    assert res.exit_code == 0, res.output
    row = "| fedavg | 3 | 0 1 2 | 0.8000 ± 0.1000 | 0.8000 ± 0.1000 | 2 (1/3) | 2 |"
    assert [line for line in res.stdout.splitlines() if line.startswith(row)] == [
        line for line in (runs / "results.md").read_text().splitlines() if line.startswith(row)]
    assert "| strategy | n | seeds |" in res.stdout


def test_round_time_leaves_out_round_one_and_the_first_round_of_a_resume(tmp_path):
    run = fake_run(tmp_path / "runs" / "a", [0.5, 0.6, 0.7, 0.8, 0.9], 9.0)
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    walls = [8.0, 0.3, 0.2, 7.0, 0.4]  # round 4 began a resumed run: it waited for start-up
    for row, wall in zip(rows, walls):
        row["wall_s"] = wall
    rows[3]["resumed"] = True
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [found], _ = find_runs(tmp_path / "runs")
    assert found.round_walls == [0.3, 0.2, 0.4] and found.round_s == 0.3


def test_report_groups_over_seeds_with_mean_and_std(runs):
    res = write_report(runs, target=0.85)
    assert res["num_runs"] == 4 and res["num_groups"] == 2
    rows = {r["strategy"]: r for r in _csv(runs / "results.csv")}
    fedavg, fedprox = rows["fedavg"], rows["fedprox"]
    # final accuracies 0.8, 0.9, 0.7: mean 0.8, sample std sqrt((0 + 0.01 + 0.01) / 2) = 0.1
    assert float(fedavg["accuracy_mean"]) == pytest.approx(0.8)
    assert float(fedavg["accuracy_std"]) == pytest.approx(0.1)
    assert float(fedavg["best_accuracy_mean"]) == pytest.approx(0.8)
    assert float(fedavg["wall_s_mean"]) == pytest.approx(20.0)
    assert float(fedavg["wall_s_std"]) == pytest.approx(10.0)
    # target 0.85: only seed 1 gets there, in round 2
    assert float(fedavg["target_round_mean"]) == 2 and fedavg["target_reached"] == "1"
    assert fedavg["n"] == "3" and fedavg["seeds"] == "0 1 2"
    assert float(fedavg["round_s_mean"]) == pytest.approx(1.0)  # round 2's (round 1 left out)
    assert fedprox["n"] == "1" and fedprox["accuracy_std"] == ""
    assert float(fedprox["accuracy_mean"]) == 0.95 and float(fedprox["target_round_mean"]) == 2
    md = (runs / "results.md").read_text()
    assert "| fedavg | 3 | 0 1 2 | 0.8000 ± 0.1000 | 0.8000 ± 0.1000 | 2 (1/3) | 2 |" in md
    assert "| fedprox | 1 | 0 | 0.9500 | 0.9500 | 2 (1/1) | 2 |" in md
    assert "![accuracy per round](plots/accuracy_per_round.png)" in md
    # iid runs: the Dirichlet alpha and the pathological labels per node shaped none of them
    shared = next(line for line in md.splitlines() if line.startswith("Shared settings"))
    assert "`partitioner=iid`" in shared and "`lr=" in shared
    assert "`alpha=" not in shared and "`classes-per-node=" not in shared


def test_settings_apply_by_partitioner():
    from fedavg.sweeps.report import applies

    assert applies("alpha", {"partitioner": "dirichlet"})
    assert not applies("alpha", {"partitioner": "iid"})
    assert applies("classes-per-node", {"partitioner": "pathological"})
    assert not applies("partition-by", {"partitioner": "dirichlet"})
    assert applies("lr", {"partitioner": "iid"})


def test_runs_csv_numbers_equal_the_summary_files(runs):
    write_report(runs, target=0.99)
    rows = _csv(runs / "runs.csv")
    assert [r["run"] for r in rows] == ["a/fedavg-0", "a/fedavg-1", "b/deep/fedavg-2",
                                        "fedprox-0"]
    for row in rows:
        summary = json.loads((runs / row["run"] / "summary.json").read_text())
        assert float(row["accuracy"]) == summary["accuracy"]
        assert float(row["best_accuracy"]) == summary["best_accuracy"]
        assert float(row["wall_s"]) == summary["wall_s"]
        assert int(row["rounds"]) == summary["rounds"]
        assert int(row["seed"]) == summary["config"]["data"]["seed"]
        assert row["target_round"] == ""  # 0.99 is never reached


def test_target_round_is_the_first_round_reaching_it(tmp_path):
    fake_run(tmp_path / "r" / "x", [0.3, 0.91, 0.89, 0.95], 1.0)
    (run,), _ = find_runs(tmp_path / "r")
    assert run.target_round(0.9) == 2 and run.target_round(0.95) == 4
    assert run.target_round(0.3) == 1 and run.target_round(0.96) is None


def _valid_png(path: Path) -> None:
    assert path.stat().st_size > 0
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100


def test_every_plot_is_a_valid_png_and_skipped_ones_say_so(tmp_path, runs):
    write_report(runs)
    assert sorted(p.name for p in (runs / "plots").iterdir()) == [
        "accuracy_per_round.png", "accuracy_vs_bytes.png", "accuracy_vs_uplink.png"]
    _valid_png(runs / "plots" / "accuracy_per_round.png")
    grid = tmp_path / "grid"
    for alpha in (0.1, 1.0):
        for nodes in (2, 4):
            for seed in (0, 1):
                fake_run(grid / f"a{alpha}-n{nodes}-s{seed}", [0.5, 0.6 + alpha / 10],
                         10.0 * nodes + seed, partitioner="dirichlet", alpha=alpha,
                         num_nodes=nodes, seed=seed)
    res = write_report(grid, output=tmp_path / "report")
    names = sorted(p.name for p in (tmp_path / "report" / "plots").iterdir())
    assert names == ["accuracy_per_round.png", "accuracy_vs_alpha.png", "accuracy_vs_bytes.png",
                     "accuracy_vs_uplink.png", "wall_time_vs_nodes.png"]
    for name in names:
        _valid_png(tmp_path / "report" / "plots" / name)
    assert res["notes"] == [] and not (grid / "results.csv").exists()
    # a plot whose setting no longer varies is removed, with a note
    (tmp_path / "report" / "plots" / "accuracy_vs_alpha.png").rename(
        runs / "plots" / "accuracy_vs_alpha.png")
    res = write_report(runs)
    assert not (runs / "plots" / "accuracy_vs_alpha.png").exists()
    assert "no run's partitioner takes alpha: no plots/accuracy_vs_alpha.png" in res["notes"]
    assert any("num-nodes does not vary" in n for n in res["notes"])
    for nodes in (2, 4):  # dirichlet runs of one alpha
        fake_run(tmp_path / "one-alpha" / f"n{nodes}", [0.5, 0.6], 10.0 * nodes,
                 partitioner="dirichlet", alpha=0.1, num_nodes=nodes, seed=0)
    res = write_report(tmp_path / "one-alpha")
    assert "alpha does not vary among the runs whose partitioner takes it: no " \
        "plots/accuracy_vs_alpha.png" in res["notes"]
    fake_run(tmp_path / "uncounted" / "a", [0.5, 0.6], 10.0, round_bytes=None)
    res = write_report(tmp_path / "uncounted")
    for name in ("accuracy_vs_bytes.png", "accuracy_vs_uplink.png"):
        assert not (tmp_path / "uncounted" / "plots" / name).exists()
        assert f"no run counted its bytes (runs of an older fedavg): no plots/{name}" \
            in res["notes"]


def test_bytes_are_a_column_and_a_curve_of_cumulative_bytes(tmp_path):
    fake_run(tmp_path / "runs" / "small", [0.5, 0.7, 0.8], 10.0, round_bytes=250_000,
             uplink_bytes=250_000)
    fake_run(tmp_path / "runs" / "big", [0.6, 0.8, 0.9], 10.0, round_bytes=5_000_000,
             strategy="fedprox", mu=0.01)
    write_report(tmp_path / "runs")
    table = (tmp_path / "runs" / "results.md").read_text()
    assert "MB sent + got" in table
    # 3 rounds of 250 kB both ways: 1.5 MB; of 5 MB both ways: 30 MB
    assert "| 1.5 |" in table and "| 30 |" in table
    rows = {r["run"]: r for r in csv.DictReader(open(tmp_path / "runs" / "runs.csv"))}
    assert rows["small"]["bytes"] == "1500000" and rows["big"]["bytes"] == "30000000"
    run = read_run(tmp_path / "runs" / "small")
    assert run.bytes_curve == [(500_000, 0.5), (1_000_000, 0.7), (1_500_000, 0.8)]
    assert run.uplink_curve == [(250_000, 0.5), (500_000, 0.7), (750_000, 0.8)]
    _valid_png(tmp_path / "runs" / "plots" / "accuracy_vs_bytes.png")
    _valid_png(tmp_path / "runs" / "plots" / "accuracy_vs_uplink.png")


def test_the_uplink_curve_counts_what_the_nodes_sent_alone(tmp_path):
    # a compressed run: 1 MB down and 250 kB up a round
    fake_run(tmp_path / "int8", [0.5, 0.7], 10.0, round_bytes=1_000_000, uplink_bytes=250_000)
    run = read_run(tmp_path / "int8")
    assert run.bytes_curve == [(1_250_000, 0.5), (2_500_000, 0.7)]
    assert run.uplink_curve == [(250_000, 0.5), (500_000, 0.7)]


PUBLISHED = """
source = "A paper"
differences = ["fewer rounds"]
[[figures]]
strategy = "fedavg"
dataset = "digits"
best-accuracy = 0.91
[[figures]]
strategy = "scaffold"
best-accuracy = 0.5
"""


def test_published_figures_sit_beside_matching_groups_under_a_name(tmp_path, runs):
    published = tmp_path / "published.toml"
    published.write_text(PUBLISHED)
    res = write_report(runs, output=tmp_path / "out", published=published, name="niid")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "niid.csv", "niid.md", "niid_plots", "niid_runs.csv"]
    rows = {r["strategy"]: r for r in _csv(out / "niid.csv")}
    assert float(rows["fedavg"]["published_best_accuracy"]) == 0.91
    assert rows["fedprox"]["published_best_accuracy"] == ""
    assert len(_csv(out / "niid_runs.csv")) == 4
    md = (out / "niid.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| strategy"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[cells.index("best accuracy") + 1] == "published"
    fedavg_row = next(line for line in md.splitlines() if line.startswith("| fedavg"))
    assert "| 0.9100 |" in fedavg_row and "A paper" in md and "- fewer rounds" in md
    assert "![accuracy per round](niid_plots/accuracy_per_round.png)" in md
    assert res["notes"][-1] == "no run has the settings of the published figure " \
        "strategy=scaffold"
    _valid_png(out / "niid_plots" / "accuracy_per_round.png")


@pytest.mark.parametrize("text, message", [
    ("", "give source"),
    ('source = "x"', r"no \[\[figures"),
    ('source = "x"\n[[figures]]\nbest-accuracy = 0.5', "names no setting"),
    ('source = "x"\n[[figures]]\nstrategy = "fedavg"\nbest-accuracy = 91.0', "fraction"),
    ('source = "x"\ndifferences = "one"', "list of strings"),
    ('source = "x"\nfigures = 3', r"figures must be tables, written \[\[figures"),
    ("source = ", "not valid TOML"),
    ('source = "x"\n[[figures]]\nstrategy = "fedavg"\nbest_acc = 0.5', "has no best-accuracy"),
    ('source = "x"\n[[figures]]\ncolour = "red"\nbest-accuracy = 0.5', "'colour' is not a run"),
])
def test_bad_published_files_are_one_line(tmp_path, runs, text, message):
    published = tmp_path / "published.toml"
    published.write_text(text)
    with pytest.raises(UserError, match=message):
        write_report(runs, published=published)
    with pytest.raises(UserError, match="not found"):
        write_report(runs, published=tmp_path / "missing.toml")
    for name in ("../up", " ", "a b", "a\nb", ".hidden", ""):
        with pytest.raises(UserError, match="file stem"):
            write_report(runs, name=name)
    with pytest.raises(UserError, match="is a folder"):
        write_report(runs, published=tmp_path)


def test_resolved_model_name_and_bad_inputs(tmp_path, runs):
    (run, *_), _ = find_runs(runs)
    assert run.settings["model"] == "mlp"  # summary's resolved model, not the config's auto
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no runs under"):
        write_report(tmp_path / "empty")
    broken = fake_run(tmp_path / "broken" / "d", [0.5], 5.0)
    (broken / "summary.json").write_text("{not json")
    with pytest.raises(UserError, match=r"no readable run under .*broken: .*/d left out: "
                                        r"cannot read it"):
        write_report(tmp_path / "broken")
    (broken / "summary.json").write_text("[1, 2]")  # JSON, but no run's summary
    with pytest.raises(UserError, match=r"d left out: cannot read it \(its summary.json holds "
                                        r"a list, not a run's summary \(an object\)\)"):
        write_report(tmp_path / "broken")
    (broken / "summary.json").unlink()
    (broken / "summary.json").mkdir()  # was: "no summary.json (... --resume ... finishes it)"
    with pytest.raises(UserError, match=r"d left out: its summary.json is not a file$"):
        write_report(tmp_path / "broken")
    with pytest.raises(UserError, match="--target must be an accuracy"):
        write_report(runs, target=1.5)
    proc = run_cli("report", tmp_path / "empty", check=False, timeout=120)
    assert proc.returncode == 2 and "no runs under" in assert_one_error_line(proc.stderr)
    proc = run_cli("report", tmp_path / "missing", check=False, timeout=120)
    assert proc.returncode == 2 and "is not a folder" in assert_one_error_line(proc.stderr)


def test_report_names_sweep_points_without_results(runs):
    (runs / "sweep.json").write_text(json.dumps({"points": [
        {"name": "a", "status": "done"}, {"name": "lr=9.0", "status": "failed"},
        {"name": "lr=8.0", "status": "interrupted"}]}))
    notes = write_report(runs)["notes"]
    assert any(n.startswith("2 sweep point(s) have no results") and "lr=9.0, lr=8.0" in n
               for n in notes), notes


@pytest.mark.e2e
@pytest.mark.timeout(1800)
@pytest.mark.long
def test_twenty_points_in_parallel_one_failing_resume_report_no_engine_left(tmp_path,
                                                                          no_leaks):
    config = toml(tmp_path, f"""
[base]
num-nodes = 2
rounds = 1
cpus-per-node = 2
[grid]
strategy = ["fedavg", "fedprox"]
seed = {list(range(10))}
[[points]]
dataset = "no-such-dataset-folder"
""")
    out = tmp_path / "sweep"
    started = time.monotonic()
    proc = run_cli("sweep", config, "--output", out, "--parallel", "2", check=False,
                   timeout=1700)
    print(f"21 points, 2 at a time: {time.monotonic() - started:.0f} s")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one point failed, all ran
    assert "20 done, 0 skipped, 1 failed" in proc.stdout, proc.stdout
    assert engine_processes() == []  # nothing of Ray or Flower outlives its point
    record, sweep = sweep_record(out), load_sweep(config)
    (bad_name,) = [name for name in record if "no-such-dataset-folder" in name]
    bad = record.pop(bad_name)
    assert bad["status"] == "failed" and bad["exit_code"] == 2 and bad["ran"] is True
    assert bad["error"].startswith("error:") and "no-such-dataset-folder" in bad["error"]
    assert [r["status"] for r in record.values()] == ["done"] * 20
    good = [p for p in sweep.points if p.name in record]
    for point in good:
        summary = json.loads((out / point.name / "summary.json").read_text())
        assert summary["config"] == json.loads(json.dumps(point.config.as_dict()))
        assert record[point.name]["accuracy"] == summary["accuracy"]
        assert (out / point.name / "sweep.log").read_text().startswith("# fedavg simulate ")
    stamps = {p.name: (out / p.name / "summary.json").stat().st_mtime for p in good}
    log = out / bad["name"] / "sweep.log"
    failed_at = log.stat().st_mtime
    again = run_cli("sweep", config, "--output", out, "--parallel", "2", check=False,
                    timeout=300)
    assert again.returncode == 1 and "0 done, 20 skipped, 1 failed" in again.stdout
    assert again.stdout.count("(finished earlier)") == 20
    assert "in an earlier sweep (--retry-failed" in again.stdout
    assert log.stat().st_mtime == failed_at  # the failed point is not run again
    assert stamps == {p.name: (out / p.name / "summary.json").stat().st_mtime for p in good}
    retry = run_cli("sweep", config, "--output", out, "--retry-failed", check=False,
                    timeout=300)
    assert retry.returncode == 1 and "20 skipped, 1 failed" in retry.stdout
    assert log.stat().st_mtime > failed_at and sweep_record(out)[bad["name"]]["ran"] is True
    report = run_cli("report", out, timeout=300)
    assert "fedprox" in report.stdout and "20 runs in 2 groups" in report.stdout
    rows = _csv(out / "runs.csv")
    assert {r["run"] for r in rows} == {p.name for p in good}
    _valid_png(out / "plots" / "accuracy_per_round.png")


def test_report_takes_settings_newer_than_a_run_at_their_default(tmp_path):
    old = fake_run(tmp_path / "runs" / "old", [0.5, 0.6], 1.0)
    summary = json.loads((old / "summary.json").read_text())
    del summary["config"]["train"]["augment"], summary["config"]["train"]["lr_schedule"]
    (old / "summary.json").write_text(json.dumps(summary))
    fake_run(tmp_path / "runs" / "new", [0.5, 0.7], 1.0, seed=1)
    runs, _ = find_runs(tmp_path / "runs")
    assert {r.settings["augment"] for r in runs} == {False}
    assert write_report(tmp_path / "runs")["num_groups"] == 1  # the same but for the seed


def test_report_says_which_data_distillation_used(tmp_path):
    fake_run(tmp_path / "slice", [0.7], 5.0, strategy="distill")
    fake_run(tmp_path / "own", [0.8], 5.0, strategy="distill", distill_data="/data/unlabeled",
             distill_augment="default")
    fake_run(tmp_path / "avg", [0.6], 5.0, strategy="average")
    fake_run(tmp_path / "same", [0.7], 5.0, strategy="distill", distill_data="digits")
    notes = write_report(tmp_path)["notes"]
    assert "distillation data: 10% of the train split, kept from the nodes (unlabeled)" in notes
    assert "distillation data: /data/unlabeled (unlabeled, augmented)" in notes
    assert sum(n.startswith("distillation data") for n in notes) == 2  # digits: the slice


def test_report_names_runs_of_one_setting_and_seed(tmp_path):
    """A copied run folder counts twice in its group's n: the report says so."""
    import shutil

    runs = tmp_path / "runs"
    fake_run(runs / "a", [0.5, 0.6], 1.0, seed=0)
    fake_run(runs / "b", [0.5, 0.7], 1.0, seed=1)
    assert not any("seed of" in n for n in write_report(runs)["notes"])
    shutil.copytree(runs / "a", runs / "a_backup")
    result = write_report(runs)
    assert "| 3 |" in result["table"]  # still counted: the note explains the n
    assert [n for n in result["notes"] if "seed of" in n] == [
        "a_backup has the settings and seed of a (a copy, or the same run again): both count "
        "in the n of all runs"]


@pytest.mark.parametrize("file, before, after", [
    ("metrics.jsonl", '"round": 1, "accuracy": 0.5', '"round": Infinity, "accuracy": 0.5'),
    ("metrics.jsonl", '"round": 1, "accuracy": 0.5', '"round": 1, "accuracy": 1e308'),
    ("summary.json", '"rounds": 1', '"rounds": Infinity'),
    ("summary.json", '"num_nodes": 5', '"num_nodes": [5]'),
    ("summary.json", '"num_nodes": 5', '"num_nodes": "many"'),
    ("summary.json", '"accuracy": 0.5', '"accuracy": 5.0'),
    ("summary.json", '"alpha": 0.5', '"alpha": [0.5]'),
    ("summary.json", '"config": {', '"config": "x", "was": {'),
])
def test_a_damaged_run_is_left_out_of_the_report_with_a_note(tmp_path, file, before, after):
    """Each was a traceback (OverflowError, TypeError), a matplotlib warning, or taken."""
    import warnings

    fake_run(tmp_path / "good", [0.5, 0.9], 10.0)
    bad = fake_run(tmp_path / "bad", [0.5], 5.0, partitioner="dirichlet")
    text = (bad / file).read_text()
    if file == "summary.json":
        text = json.dumps(json.loads(text))  # on one line, as the substrings are written
    assert before in text, text
    (bad / file).write_text(text.replace(before, after, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matplotlib warning either
        result = write_report(tmp_path)
    if file == "summary.json":  # the run is left out
        assert result["num_runs"] == 1
        assert any(n.startswith(f"{bad} left out: cannot read it (its summary.json")
                   or n == f"{bad} left out: its summary.json holds a field of the wrong type "
                   "(not a fedavg run's summary)" for n in result["notes"]), result["notes"]
        assert not any("object has no attribute" in n or "not subscriptable" in n
                       for n in result["notes"])  # Python's words are no reason
    else:  # the round is left out of its curve
        assert result["num_runs"] == 2
        assert f"{bad}: line(s) 1 of its metrics.jsonl are not round records; they are left " \
               "out of its curve" in result["notes"]


def test_report_files_never_replace_another_reports_or_meet_a_folder(tmp_path):
    """Neither replaces the default report's runs.csv, nor is a folder a traceback.

    `--name runs` replaced it; a folder where results.md goes was an IsADirectoryError.
    """
    fake_run(tmp_path / "one", [0.5, 0.9], 10.0)
    write_report(tmp_path)
    runs_csv = (tmp_path / "runs.csv").read_text()
    with pytest.raises(UserError, match="^--name runs: runs.csv is the default report's table"):
        write_report(tmp_path, name="runs")
    assert (tmp_path / "runs.csv").read_text() == runs_csv
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "results.md").mkdir()
    with pytest.raises(UserError, match=r"^cannot write the report into .*r2: .*results.md: Is "
                                        r"a directory$"):
        write_report(tmp_path, output=tmp_path / "r2")


def test_the_sweep_end_names_the_report_command_quoted_for_a_shell(tmp_path, monkeypatch):
    """`fedavg report runs/my sweep` pasted into a shell took two folders."""
    import io
    import shlex
    import time
    from types import SimpleNamespace

    from rich.console import Console

    from fedavg.cli import sweep as cli_sweep

    shown = io.StringIO()
    monkeypatch.setattr(cli_sweep, "console", Console(file=shown, width=500))
    runner = SimpleNamespace(counts=lambda: {"done": 1}, started=time.time(), left_out=[],
                             records={"a": {"status": "done", "name": "a"}})
    out = tmp_path / "real out ü"
    cli_sweep._say_end(runner, out, 0)
    line = shown.getvalue().splitlines()[-1]
    assert line.startswith("tables and plots: fedavg report ")
    assert shlex.split(line.split(": ", 1)[1]) == ["fedavg", "report", str(out)]


@pytest.mark.parametrize("damaged, says", [
    (lambda data: data[:-20], "is cut short"),
    (lambda data: data[:12], "is not a safetensors file (cut short or edited)"),
    (lambda data: None, "is missing"),
])
def test_a_run_whose_model_file_is_damaged_is_reported_with_a_note(tmp_path, damaged, says):
    fake_run(tmp_path / "good", [0.5, 0.9], 10.0)
    bad = fake_run(tmp_path / "bad", [0.5, 0.7], 5.0, partitioner="dirichlet")
    model = bad / "model.safetensors"
    data = damaged(model.read_bytes())
    model.unlink()
    if data is not None:
        model.write_bytes(data)
    result = write_report(tmp_path)
    assert result["num_runs"] == 2  # its figures stand
    assert f"{bad}: its model.safetensors {says}: its figures are reported, but its model " \
           "cannot be loaded (fedavg evaluate / predict)" in result["notes"]
    assert not any(str(tmp_path / "good") in n for n in result["notes"])


@pytest.mark.parametrize("damaged, says", [
    (lambda text: text[: len(text) // 2], "is not JSON (cut short or edited)"),
    (lambda text: "[1, 2]", "holds a list, not an object"),
])
def test_a_run_whose_model_json_is_damaged_is_reported_with_a_note(tmp_path, damaged, says):
    fake_run(tmp_path / "good", [0.5, 0.9], 10.0)
    bad = fake_run(tmp_path / "bad", [0.5, 0.7], 5.0, partitioner="dirichlet")
    (bad / "model.json").write_text(damaged((bad / "model.json").read_text()))
    result = write_report(tmp_path)
    assert result["num_runs"] == 2  # its figures stand
    assert f"{bad}: its model.json {says}: its figures are reported, but its model cannot " \
           "be loaded (fedavg evaluate / predict)" in result["notes"]
    assert not any(str(tmp_path / "good") in n for n in result["notes"])

