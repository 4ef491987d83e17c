"""Sweep and report test helpers: a sweep TOML, a finished run's files, the sweep record.

Fake run folders are written in the exact format fedavg writes (``summary.json`` as
:func:`fedavg.run.lifecycle.write_summary`, ``metrics.jsonl`` one round a line).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from fedavg.config.settings import RunConfig


def toml(tmp_path: Path, text: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def fake_run(folder: Path, accuracies: list[float], wall_s: float, model: str = "mlp",
             round_bytes: int | None = 1000, uplink_bytes: int | None = None,
             **settings) -> Path:
    """Write a finished run folder as ``fedavg simulate`` does.

    Each round sends ``round_bytes`` to the nodes and gets as many back, or ``uplink_bytes``
    when given (``round_bytes=None``: a run of a fedavg that did not count them).
    """
    config = RunConfig().replace(dataset="digits", rounds=len(accuracies), **settings)
    folder.mkdir(parents=True)
    counted = {} if round_bytes is None else {"bytes_to_nodes": round_bytes,
                                               "bytes_from_nodes": uplink_bytes or round_bytes}
    rows = [{"round": i, "accuracy": a, "loss": 1.0 - a, "train_loss": 1.1 - a,
             "num_nodes": config.merge.num_nodes, "num_failed": 0, "wall_s": 0.5 * i,
             "train_s": 0.1, **counted} for i, a in enumerate(accuracies, start=1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"accuracy": accuracies[-1], "loss": 1.0 - accuracies[-1],
               "best_accuracy": max(accuracies), "rounds": len(accuracies),
               "num_nodes": config.merge.num_nodes, "wall_s": wall_s,
               "strategy": config.merge.strategy, "model": model, "dataset": "digits",
               "train_samples": 1438, "test_samples": 359, "failures": [],
               "config": config.as_dict(),
               **{k: v * len(accuracies) for k, v in counted.items()}}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    (folder / "model.json").write_text(json.dumps({
        "format": "fedavg-model/1", "model": {"name": model, "input_shape": [1, 8, 8],
                                              "num_classes": 10, "args": {}},
        "classes": [str(i) for i in range(10)], "strategy": config.merge.strategy,
        "config": config.as_dict(), "rounds": len(accuracies),
        "metrics": {"accuracy": accuracies[-1], "loss": 1.0 - accuracies[-1]}}))
    save_file({"w": torch.zeros(16)}, folder / "model.safetensors")
    return folder


def sweep_record(out: Path) -> dict:
    return {p["name"]: p for p in json.loads((out / "sweep.json").read_text())["points"]}
