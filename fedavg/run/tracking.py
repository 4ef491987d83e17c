"""Experiment tracking: per-round scalars to TensorBoard, params, metrics and the model to MLflow.

Both are optional extras (``tensorboard``, ``mlflow``: the packages they name) and
both only observe a run: :func:`tracked` opens them for a run folder, the round progress
hands every finished round to :meth:`Trackers.on_round`, and the end of the run closes them
with its status. A tracker that fails mid-run (a full disk, a locked database) is switched off
with one warning; the run goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fedavg.util.errors import UserError, first_line

log = logging.getLogger(__name__)

#: Round scalars (``RoundRecord`` fields) logged by both trackers; ``None`` values are left out.
SCALARS = ("accuracy", "loss", "train_loss", "wall_s", "train_s", "num_nodes", "num_failed",
           "bytes_to_nodes", "bytes_from_nodes",
           "merged_accuracy", "merged_loss")
#: Files of the run folder logged to MLflow as the ``model`` artifact.
MODEL_FILES = ("model.safetensors", "model.json", "summary.json", "metrics.jsonl",
               "tokenizer.json")
#: MLflow experiment runs are logged to.
EXPERIMENT = "fedavg"


@dataclass(frozen=True)
class TrackingOptions:
    """Where a run is tracked.

    Attributes
    ----------
    tensorboard : path or None
        Folder of TensorBoard event files (``tensorboard --logdir`` it); each run writes
        into a subfolder named after its run folder.
    mlflow_uri : str or None
        MLflow tracking URI; :func:`default_mlflow_uri` is a local store in ``./mlruns``.
    """

    tensorboard: Path | None = None
    mlflow_uri: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether any tracker is asked for."""
        return self.tensorboard is not None or self.mlflow_uri is not None


def default_mlflow_uri(folder: str | Path = "mlruns") -> str:
    """Return the local MLflow store in ``folder``: a SQLite database, artifacts beside it.

    MLflow's plain file store is deprecated; its own recommendation is a SQLite database.
    ``mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db`` shows the runs.
    """
    return f"sqlite:///{Path(folder).expanduser().resolve() / 'mlflow.db'}"


class _TensorBoard:
    """Per-round scalars under ``fedavg/<name>`` as TensorBoard event files."""

    def __init__(self, logdir: Path, run_name: str, params: dict[str, Any],
                 first_round: int = 1) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:  # purge_step: a rerun (--overwrite) or resumed run hides rounds logged before
            self.writer = SummaryWriter(log_dir=str(Path(logdir) / run_name),
                                        purge_step=first_round)
        except OSError as exc:
            raise UserError(f"--tensorboard {logdir}: cannot write there ({exc.strerror})") \
                from None
        self.writer.add_text("settings", "\n".join(f"    {k} = {v}"
                                                   for k, v in sorted(params.items())))

    def on_round(self, record: dict[str, Any]) -> None:
        for key in SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(f"fedavg/{key}", record[key], record["round"])
        self.writer.flush()

    def finish(self, status: str, out: Path) -> None:
        self.writer.close()


class _MLflow:
    """One MLflow run: the settings as params, per-round metrics, the model as an artifact."""

    def __init__(self, uri: str, run_name: str, params: dict[str, Any]) -> None:
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        try:
            if uri.startswith("sqlite:///"):
                Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(EXPERIMENT)
            exp_id = found.experiment_id if found else self.client.create_experiment(
                EXPERIMENT, artifact_location=_artifact_root(uri))
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            self.client.log_batch(self.run_id, params=[
                mlflow.entities.Param(k, str(v)[:6000]) for k, v in sorted(params.items())])
        except Exception as exc:  # mlflow raises its own and the store's exceptions
            first = first_line(exc)
            raise UserError(f"--mlflow: cannot use the tracking store {uri} ({first})") \
                from None

    def on_round(self, record: dict[str, Any]) -> None:
        import mlflow

        metrics = [mlflow.entities.Metric(key, float(record[key]), _now_ms(), record["round"])
                   for key in SCALARS if record.get(key) is not None]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, out: Path) -> None:
        for name in MODEL_FILES:
            if (out / name).is_file():
                self.client.log_artifact(self.run_id, str(out / name), "model")
        self.client.set_terminated(self.run_id, status)


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a local SQLite store go beside the database, not into the cwd."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "artifacts").as_uri()
    return None


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


class Trackers:
    """The trackers of one run, opened once its folder exists (:meth:`open`).

    Each tracker that fails later is switched off with one warning; the run goes on.

    Parameters
    ----------
    options : TrackingOptions or None
        What to track; ``None`` or nothing enabled: every method does nothing.
    params : dict
        The run's flat settings (:meth:`fedavg.config.settings.RunConfig.to_flat`).

    Raises
    ------
    UserError
        A tracker's package is not installed (checked before anything runs).
    """

    def __init__(self, options: TrackingOptions | None, params: dict[str, Any]) -> None:
        self.options, self.params, self.sinks = options, params, []
        self.out: Path | None = None
        if options is not None and options.tensorboard is not None:
            _require("torch.utils.tensorboard", "--tensorboard", "tensorboard", "tensorboard")
        if options is not None and options.mlflow_uri is not None:
            _require("mlflow", "--mlflow", "mlflow", "mlflow-skinny sqlalchemy alembic")

    def open(self, out: Path, first_round: int = 1) -> None:
        """Start tracking the run in folder ``out`` (its name names the run).

        ``first_round`` is the round the run starts with (a resumed run's next one):
        TensorBoard hides what an earlier run in the same folder logged from there on.

        Raises
        ------
        UserError
            The TensorBoard folder or the MLflow store cannot be used.
        """
        opts, self.out = self.options, Path(out)
        if opts is None or not opts.enabled or self.sinks:
            return
        if opts.tensorboard is not None:
            self.sinks.append(_TensorBoard(opts.tensorboard, self.out.name, self.params,
                                           first_round))
        if opts.mlflow_uri is not None:
            os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
            # a tracking server that is down: a one-line error in seconds, not MLflow's
            # default of 7 retries with exponential back-off (minutes)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
            self.sinks.append(_MLflow(opts.mlflow_uri, self.out.name, self.params))

    def on_round(self, record) -> None:
        """Log one finished round (a :class:`fedavg.run.lifecycle.RoundRecord`)."""
        data = record.as_dict() if hasattr(record, "as_dict") else dict(record)
        self._each("on_round", data)

    def finish(self, status: str) -> None:
        """Close every tracker; ``status`` is ``FINISHED``, ``FAILED`` or ``KILLED``."""
        if self.out is not None:
            self._each("finish", status, self.out)
        self.sinks = []

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # noqa: BLE001 - tracking must never stop a run
                self.sinks.remove(sink)
                first = first_line(exc)
                warnings.warn(f"{type(sink).__name__.strip('_')} tracking stopped: {first}",
                              RuntimeWarning, stacklevel=2)


def _require(module: str, flag: str, extra: str, packages: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise UserError(f"{flag} needs the {extra} package: pip install {packages} (the "
                        f"project's [{extra}] extra)") from None


@contextlib.contextmanager
def tracked(options: TrackingOptions | None, params: dict[str, Any]) -> Iterator[Trackers]:
    """Yield the :class:`Trackers` of a run; close them with the run's status.

    The block opens them (:meth:`Trackers.open`) once the run folder exists. They are
    closed as ``FINISHED`` when the block ends normally, ``KILLED`` on an interrupt and
    ``FAILED`` on any other error, which is re-raised.

    Raises
    ------
    UserError
        A tracker's package is missing.
    """
    trackers = Trackers(options, params)
    try:
        yield trackers
    except (KeyboardInterrupt, SystemExit):
        trackers.finish("KILLED")
        raise
    except BaseException:
        trackers.finish("FAILED")
        raise
    trackers.finish("FINISHED")
