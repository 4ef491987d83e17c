"""The benchmark scripts' own logic: the plain Flower baseline's model, phases, options."""

import json
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path[:0] = [str(EXPERIMENTS), str(EXPERIMENTS / "plain_flower")]

import bench_compress  # noqa: E402
import bench_overhead  # noqa: E402
import bench_scale  # noqa: E402


def test_the_plain_flower_app_trains_the_same_network_as_fedavgs_cnn():
    import torch
    from plain_flower.task import Net

    from fedavg.models.registry import make_model

    ours = make_model("cnn", (1, 28, 28), 10)
    shapes = [tuple(p.shape) for p in ours.parameters()]
    assert [tuple(p.shape) for p in Net().parameters()] == shapes
    assert Net()(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_phases_split_a_wall_time_into_start_up_rounds_and_end():
    # launched at 100, rounds 110-130, 130-135, 135-141, exit at 143
    got = bench_overhead.phases(100.0, 143.0, [110.0, 130.0, 135.0], [130.0, 135.0, 141.0])
    assert got == {"wall_s": 43.0, "startup_s": 10.0, "round1_s": 20.0, "round_s": 5.5,
                   "end_s": 2.0}


def test_repeated_legs_report_the_median_of_each_figure_and_every_wall():
    runs = [{"wall_s": 10.0, "round_s": 2.0, "accuracy": 0.9},
            {"wall_s": 14.0, "round_s": 2.5, "accuracy": 0.8},
            {"wall_s": 12.0, "round_s": 3.0, "accuracy": 0.85}]
    assert bench_overhead.medians(runs) == {"wall_s": 12.0, "round_s": 2.5, "accuracy": 0.85}
    leg = {"wall_s": 12.0, "startup_s": 1.0, "round1_s": 4.0, "round_s": 2.5, "end_s": 0.5,
           "accuracy": 0.85}
    result = {"one_thread_samples_s": 1000.0, "cores": 2, "limit_samples_s": 2000.0,
              "sample_epochs": 20000, "fedavg": leg, "fedavg-1": leg, "flower": leg,
              "pytorch": {**leg, "wall_s": 24.0},
              "walls_s": {"fedavg": [10.0, 14.0, 12.0], "fedavg-1": [12.0],
                          "flower": [12.0], "pytorch": [24.0]}}
    text = bench_overhead.table(result)
    assert "fedavg 10.0, 14.0, 12.0;" in text
    assert "fedavg / plain Flower: 1.00; fedavg / plain PyTorch: 0.50" in text


def test_repeats_alternate_the_legs_each_run_in_a_folder_of_its_own(tmp_path, monkeypatch,
                                                                    capsys):
    import datasets

    calls = []

    def leg(name):
        def run(*args):
            folder = args[-2] if name == "fedavg-1" else args[-1]
            assert folder.is_dir() and not any(folder.iterdir())  # fresh, empty
            (folder / "flwr-home").mkdir()  # what a leg writes: a second run would collide
            calls.append((name, folder.name))
            return {"wall_s": 10.0 + len(calls), "startup_s": 1.0, "round1_s": 3.0,
                    "round_s": 2.0, "end_s": 0.5, "accuracy": 0.9}
        return run

    fedavg_leg, fedavg_one = leg("fedavg"), leg("fedavg-1")
    monkeypatch.setattr(bench_overhead, "run_fedavg", lambda *a: (
        fedavg_one if len(a) == 5 else fedavg_leg)(*a))
    monkeypatch.setattr(bench_overhead, "run_flower", leg("flower"))
    monkeypatch.setattr(bench_overhead, "run_torch", leg("pytorch"))
    monkeypatch.setattr(bench_overhead, "one_thread_limit", lambda: 1000.0)

    class Rows:
        num_rows = 100

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: Rows())
    out = tmp_path / "result.json"
    assert bench_overhead.main(["--dataset", str(tmp_path), "--repeats", "2",
                                "--json", str(out)]) == 0
    order = ["fedavg", "fedavg-1", "flower", "pytorch"]
    assert [name for name, _ in calls] == order + order[::-1]
    assert len({folder for _, folder in calls}) == 8
    result = json.loads(out.read_text())
    assert result["walls_s"]["fedavg"] == [11.0, 18.0]
    assert result["fedavg"]["wall_s"] == 14.5  # the median of its two runs
    assert "fedavg 11.0, 18.0;" in capsys.readouterr().out


def test_scale_points_parse_and_bad_ones_are_one_line():
    assert bench_scale.parse_points("10:digits,10000:../data/mnist") == [
        (10, "digits"), (10000, "../data/mnist")]
    for bad in ("10", "x:digits", "0:digits", "10:"):
        with pytest.raises(SystemExit, match="is not NODES:DATASET"):
            bench_scale.parse_points(bad)


def test_cold_start_medians_and_table_cover_every_phase():
    import bench_cold

    runs = [{"wall": 10.0, "round1": 4.0, "round": 0.2}, {"wall": 14.0, "round1": 6.0,
                                                         "round": 0.4},
            {"wall": 12.0, "round1": 5.0, "round": 0.3}]
    assert bench_cold.medians(runs) == {"wall": 12.0, "round1": 5.0, "round": 0.3}
    text = bench_cold.table({"this": {"wall": 12.0, "round1": 5.0}})
    header, row = text.splitlines()
    assert header.split()[1:] == ["wall", *bench_cold.PHASES, "round"]
    assert row.split()[:2] == ["this", "12.00"] and "nan" in row  # a phase not measured


def test_compression_legs_name_their_options():
    assert bench_compress.leg_args("fedavg/none") == []
    assert bench_compress.leg_args("fedavg/topk1-noef") == [
        "--compress", "topk", "--topk-fraction", "0.01", "--no-error-feedback"]
    assert bench_compress.leg_args("diloco/int8") == [
        "--strategy", "diloco", "--local-steps", "190", "--compress", "int8"]
    assert bench_compress.leg_args("fedavg/int8+down") == [
        "--compress", "int8", "--compress-down", "int8"]


def test_compression_summary_counts_the_uplink_to_the_target():
    rounds = [{"round": i + 1, "accuracy": a, "bytes_from_nodes": 100, "bytes_to_nodes": 400,
               "wall_s": w} for i, (a, w) in enumerate([(0.5, 9.0), (0.97, 2.0), (0.981, 3.0),
                                                       (0.99, 4.0)])]
    row = bench_compress.summarise("fedavg/int8", rounds, 0.98, baseline_up=400)
    assert row["reached"] == {"round": 3, "uplink_bytes": 300}
    assert row["up_share"] == 0.25 and row["round_s"] == 3.0 and row["best"] == 0.99
