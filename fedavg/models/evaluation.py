"""Where a model runs and how it is scored: the device, class probabilities, accuracy and loss.

Plain PyTorch; no Flower import. Nodes train with :mod:`fedavg.node.train`; everything that
only runs a model forward (the coordinator's evaluation, ``fedavg evaluate`` / ``predict``,
data-driven merges) uses this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fedavg.data.load import normalize
from fedavg.util.errors import UserError


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as given.

    Raises
    ------
    fedavg.util.errors.UserError
        A CUDA device asked for on a machine without one, or an unknown device string.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: no CUDA device here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    return dev


def evaluation_device(device: str = "auto") -> torch.device:
    """Where the coordinator evaluates the merged model, for the run's ``--device``.

    The run's CUDA device when this machine has it, the first CUDA device when it has another
    one (a coordinator whose nodes have more GPUs), else the CPU; ``cpu`` stays on the CPU.
    Never raises for a device the nodes have and this machine lacks.
    """
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")

    try:
        return resolve_device(device)
    except UserError:
        return torch.device("cuda")


@torch.no_grad()
def predict_proba(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    input_spec: dict[str, Any],
    *,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Class probabilities, ``(N, K)`` float32 on the CPU (softmax of the logits)."""
    device = torch.device(device)
    model.to(device).eval()
    xt = torch.as_tensor(x)
    out = []
    for start in range(0, len(xt), batch_size):
        xb = normalize(xt[start : start + batch_size].to(device), input_spec)
        out.append(torch.softmax(model(xb).float(), dim=1).cpu())
    if not out:
        return torch.zeros(0, 0)
    return torch.cat(out)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    input_spec: dict[str, Any],
    *,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``(x, y)``.

    Returns
    -------
    dict
        ``accuracy`` (fraction in [0, 1]), ``loss`` (mean cross-entropy, nats),
        ``num_examples``.
    """
    device = torch.device(device)
    model.to(device).eval()
    xt, yt = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.long)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(yt), batch_size):
        xb = normalize(xt[start : start + batch_size].to(device), input_spec)
        yb = yt[start : start + batch_size].to(device)
        logits = model(xb).float()
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    n = len(yt)
    return {
        "accuracy": correct / n if n else 0.0,
        "loss": loss_sum / n if n else 0.0,
        "num_examples": n,
    }
