"""What a data-driven merge gets from a run: the model builder, held-out data, the device."""

from __future__ import annotations

from typing import Any

import torch

import strategies
from fedavg.data.load import normalize
from fedavg.models.evaluation import resolve_device
from fedavg.models.registry import ModelSpec
from fedavg.node.recipe import augmenter


def merge_context(spec: ModelSpec, input_spec: dict[str, Any], seed: int,
                  validation=None, distill_x=None, device: str = "auto"):
    """Return what data-driven merges may use: model builder, normalisation, held-out data.

    Parameters
    ----------
    spec : ModelSpec
        The architecture being merged.
    input_spec : dict
        Input normalisation (``model.json``'s ``input``).
    seed : int
        Seed of any random choice in the merge.
    validation : fedavg.data.load.Split, optional
        Held-out labelled data: ``(N, ...)`` inputs, ``(N,)`` labels.
    distill_x : numpy.ndarray, optional
        ``(M, ...)`` unlabeled inputs.
    device : str
        ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Returns
    -------
    strategies.MergeContext
    """
    return strategies.MergeContext(
        build_model=spec.build,
        normalize=lambda x: normalize(x, input_spec),
        val_x=None if validation is None else torch.as_tensor(validation.x),
        val_y=None if validation is None else torch.as_tensor(validation.y, dtype=torch.long),
        distill_x=None if distill_x is None else torch.as_tensor(distill_x),
        device=resolve_device(device),
        seed=seed,
        augment=augmenter(input_spec),
    )

