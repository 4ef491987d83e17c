"""Tracking: TensorBoard event files and MLflow runs, read back through their own APIs.

A real run tracked to both is in ``tests/e2e/test_text_e2e.py``; the coordinator's, in
``tests/engines/test_deployment.py``.
"""

import warnings

import pytest

from fedavg.run.tracking import Trackers, TrackingOptions, default_mlflow_uri, tracked
from fedavg.util.errors import UserError

ROUNDS = [{"round": 1, "accuracy": 0.5, "loss": 1.5, "train_loss": 2.0, "wall_s": 1.25,
           "train_s": 0.5, "num_nodes": 3, "num_failed": 0},
          {"round": 2, "accuracy": 0.75, "loss": 0.8, "train_loss": None, "wall_s": 1.0,
           "train_s": None, "num_nodes": 2, "num_failed": 1}]


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow_run(uri):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedavg").experiment_id])
    return client, run


def test_tensorboard_scalars_per_round_read_back(tmp_path):
    out = tmp_path / "run-a"
    out.mkdir()
    with tracked(TrackingOptions(tensorboard=tmp_path / "tb"), {"lr": 0.05}) as trackers:
        trackers.open(out)
        for record in ROUNDS:
            trackers.on_round(record)
    scalars = _scalars(tmp_path / "tb" / "run-a")
    assert scalars["fedavg/accuracy"] == [(1, 0.5), (2, 0.75)]
    assert scalars["fedavg/num_failed"] == [(1, 0.0), (2, 1.0)]
    assert scalars["fedavg/train_loss"] == [(1, 2.0)]  # None is left out, not logged as 0


def test_a_rerun_or_resumed_run_hides_the_rounds_logged_before(tmp_path):
    out = tmp_path / "run-a"
    out.mkdir()
    options = TrackingOptions(tensorboard=tmp_path / "tb")
    for first, rounds in ((1, ROUNDS), (1, ROUNDS[:1]), (2, ROUNDS[1:])):
        # a run of 2 rounds; the same folder again (--overwrite) stopped after round 1;
        # that one resumed at round 2
        with tracked(options, {}) as trackers:
            trackers.open(out, first_round=first)
            for record in rounds:
                trackers.on_round({**record, "accuracy": record["accuracy"] + first / 10})
    # round 1 of the second run (+0.1), round 2 of the resumed one (+0.2); no duplicates
    assert _scalars(tmp_path / "tb" / "run-a")["fedavg/accuracy"] == [
        (1, pytest.approx(0.6)), (2, pytest.approx(0.95))]


def test_mlflow_params_metrics_model_and_status_read_back(tmp_path):
    out = tmp_path / "run-b"
    out.mkdir()
    (out / "model.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    uri = default_mlflow_uri(tmp_path / "mlruns")
    assert uri == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    with tracked(TrackingOptions(mlflow_uri=uri), {"lr": 0.05, "strategy": "fedavg"}) as tr:
        tr.open(out)
        for record in ROUNDS:
            tr.on_round(record)
    client, run = _mlflow_run(uri)
    assert run.info.run_name == "run-b" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.05", "strategy": "fedavg"}
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    files = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert files == {"model/model.json", "model/model.safetensors"}
    assert (tmp_path / "mlruns" / "artifacts").is_dir()  # beside the database, not in the cwd


def test_a_failed_run_is_marked_failed(tmp_path):
    uri = default_mlflow_uri(tmp_path / "mlruns")
    out = tmp_path / "run-c"
    out.mkdir()
    with pytest.raises(RuntimeError):
        with tracked(TrackingOptions(mlflow_uri=uri), {}) as trackers:
            trackers.open(out)
            raise RuntimeError("round 2 failed")
    assert _mlflow_run(uri)[1].info.status == "FAILED"


def test_a_broken_tracker_is_switched_off_with_one_warning(tmp_path):
    class Broken:
        def on_round(self, record):
            raise OSError("disk full")

        def finish(self, status, out):
            raise AssertionError("a switched-off tracker is not called again")

    trackers = Trackers(None, {})
    trackers.sinks, trackers.out = [Broken()], tmp_path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trackers.on_round(ROUNDS[0])
        trackers.on_round(ROUNDS[1])
        trackers.finish("FINISHED")
    assert [str(w.message) for w in caught] == ["Broken tracking stopped: disk full"]


def test_a_missing_package_is_one_line_before_anything_runs(monkeypatch):
    import importlib

    real = importlib.import_module

    def no_mlflow(name, *args):
        if name == "mlflow":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_mlflow)
    with pytest.raises(UserError, match=r"--mlflow needs the mlflow package: pip install "
                                        r"mlflow-skinny sqlalchemy alembic \(the project's "
                                        r"\[mlflow\] extra\)"):
        Trackers(TrackingOptions(mlflow_uri="sqlite:///x.db"), {})


def test_an_unreachable_tracking_server_is_one_line_in_seconds(tmp_path, monkeypatch):
    import socket
    import time

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as sock:  # a free port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    out.mkdir()
    import mlflow  # noqa: F401 - its first import is slow on a busy machine: not timed

    started = time.monotonic()
    with pytest.raises(UserError, match=f"--mlflow: cannot use the tracking store "
                                        f"http://127.0.0.1:{port}"):
        Trackers(TrackingOptions(mlflow_uri=f"http://127.0.0.1:{port}"), {}).open(out)
    assert time.monotonic() - started < 60  # mlflow's default retries take minutes
