"""Evaluation samples that are also training samples: the same input in both splits.

A test or validation split that shares inputs with the train split reports an accuracy that
overstates what the model does on data it has not seen (a published sample of a dataset may
hold its validation texts in its train split too). A run says so with its plan, and
``fedavg evaluate`` with its result.
"""

from __future__ import annotations

import hashlib

import numpy as np

#: Bytes of each input's digest: BLAKE2b-128, so a false match needs a collision.
DIGEST_BYTES = 16


def _digests(x: np.ndarray) -> list[bytes]:
    """Return one digest per input (``x``: ``(N, ...)``), of its raw bytes."""
    rows = np.ascontiguousarray(x).reshape(len(x), int(np.prod(x.shape[1:], dtype=np.int64)))
    return [hashlib.blake2b(row.tobytes(), digest_size=DIGEST_BYTES).digest() for row in rows]


def shared_inputs(x: np.ndarray, train_x: np.ndarray) -> int:
    """Return how many inputs of ``x`` are also inputs of ``train_x``.

    Parameters
    ----------
    x, train_x : numpy.ndarray
        ``(N, ...)`` and ``(M, ...)`` inputs of one dataset (same dtype and input shape);
        two inputs are the same when their bytes are.

    Returns
    -------
    int
        The count, from 0 to ``N``: an input present twice in ``x`` counts twice.
    """
    if x.dtype != train_x.dtype or x.shape[1:] != train_x.shape[1:]:
        return 0
    seen = set(_digests(train_x))
    return sum(digest in seen for digest in _digests(x))


def overlap_note(x: np.ndarray, train_x: np.ndarray, split: str, source: str) -> str | None:
    """Say how many samples of ``split`` have the same input as a train sample, if any.

    Returns ``None`` when none has; ``source`` names the dataset.
    """
    shared = shared_inputs(x, train_x)
    if not shared:
        return None
    return (f"{split} split of {source}: {shared} of {len(x)} samples have the same input as "
            "a train sample, so accuracy on it overstates accuracy on unseen data")
