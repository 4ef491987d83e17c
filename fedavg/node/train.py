"""Plain PyTorch local training: one node's round. No Flower import.

Evaluation, which only runs a model forward, is :mod:`fedavg.models.evaluation`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from fedavg.config.settings import LocalTraining
from fedavg.data.load import normalize
from fedavg.node.dp_sgd import PrivateTraining, quiet_hooks
from fedavg.node.recipe import LogitAdjustment, augmenter, make_scheduler, round_lr
from fedavg.util.errors import UserError


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """Return the parameters a node trains: all but the frozen ones (a LoRA model's base)."""
    return [p for p in model.parameters() if p.requires_grad]


def _batches(n: int, batch_size: int, generator: torch.Generator | None, smallest: int = 1):
    """Yield the index batches of one epoch, leaving out one smaller than ``smallest``."""
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        if min(batch_size, n - start) >= smallest:
            yield order[start : start + batch_size]


def _round_batches(n: int, local: LocalTraining, g: torch.Generator, smallest: int):
    """Yield a round's batches: ``local_steps`` of them, else ``local_epochs`` passes."""
    if not local.local_steps:
        for _ in range(local.local_epochs):
            yield from _batches(n, local.batch_size, g, smallest)
        return
    left = local.local_steps
    while left:
        before = left
        for idx in _batches(n, local.batch_size, g, smallest):
            yield idx
            left -= 1
            if not left:
                return
        if left == before:  # a pass without a batch (one sample, BatchNorm): nothing to do
            return


def make_optimizer(model: nn.Module, name: str, *, lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """Return a fresh ``sgd`` (with ``momentum``), ``adam`` or ``adamw`` optimizer over ``model``.

    Raises
    ------
    ValueError
        Another name.
    """
    params = trainable(model)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":  # decoupled weight decay: Loshchilov and Hutter 2019, arXiv:1711.05101
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; use sgd, adam or adamw")


def train(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    input_spec: dict[str, Any],
    local: LocalTraining = LocalTraining(),
    *,
    server_round: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    proximal_mu: float = 0.0,
    rule=None,
    dp_noise: float = 0.0,
) -> dict[str, float]:
    """Train ``model`` in place with SGD (or Adam) on one node's samples, for one round.

    Parameters
    ----------
    model : torch.nn.Module
        Maps ``(N, *input_shape)`` normalised floats to ``(N, K)`` logits.
    x, y : array
        ``(N, C, H, W)`` or ``(N, D)`` raw inputs (:func:`fedavg.data.load.normalize`);
        ``(N,)`` labels.
    input_spec : dict
        Normalisation, :meth:`fedavg.data.load.LoadedData.input_spec`.
    local : LocalTraining
        How to train (each option's meaning is declared there): ``local_epochs`` passes
        over the data at ``batch_size`` samples a step, or ``local_steps`` steps; a fresh
        ``optimizer`` each call (``sgd`` with ``momentum``, ``adam``: Kingma and Ba 2015,
        arXiv:1412.6980, or ``adamw``), so a
        node's optimizer state does not outlive its round; ``lr`` decayed by
        ``lr_decay ** (server_round - 1)``, then ``lr_schedule`` over this call's steps;
        ``augment`` each batch with the default of its kind of input (both
        :mod:`fedavg.node.recipe`); ``sam_rho``, SAM's radius, each step's gradient taken
        at ``w + rho * g / ||g||`` (FedSAM on the nodes, :func:`sharpness_aware_gradient`;
        twice a step's cost); ``logit_adjust``, ``tau`` of the logit-adjusted loss with the
        partition's label frequencies (Menon et al. 2021,
        :class:`fedavg.node.recipe.LogitAdjustment`); ``clip_grad_norm``, the largest L2
        norm of a step's gradient (Pascanu et al. 2013).
    server_round : int
        The round being trained, from 1 (the learning rate's per-round decay).
    device, seed
        Where to train; the seed of the batch order and of the augmentations.
    proximal_mu : float
        FedProx (Li et al. 2020, arXiv:1812.06127): adds ``mu/2 * ||w - w_start||^2`` to
        the loss, ``w_start`` being the weights the node received. 0 is plain SGD.
    rule : strategies.NodeRule, optional
        A method's node side, begun: its ``loss`` joins each batch's, ``before_step`` runs.
    dp_noise : float
        With ``local.dp_sgd``: DP-SGD's noise multiplier ``z``; each step's batch is then
        Poisson-sampled and its per-sample gradients clipped to ``local.dp_max_grad_norm``
        and noised (:mod:`fedavg.node.dp_sgd`).

    Returns
    -------
    dict
        ``train_loss`` (mean cross-entropy of the (adjusted) logits over all steps, nats,
        without the proximal term or the rule's), ``num_examples`` (samples), ``steps``;
        with DP-SGD ``dp_sample_rate``, each sample's chance to join a step's batch.

    Raises
    ------
    UserError
        DP-SGD on a model with a layer that has no per-sample gradient (BatchNorm).
    """
    local = local.resolved()  # a setting not given: its declared fallback
    model.to(device).train()
    xt, yt = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.long)
    opt = make_optimizer(model, local.optimizer,
                         lr=round_lr(local.lr, local.lr_decay, server_round),
                         momentum=local.momentum, weight_decay=local.weight_decay)
    sched = make_scheduler(opt, local.lr_schedule, local.local_steps or
                           local.local_epochs * math.ceil(len(yt) / local.batch_size))
    aug = augmenter(input_spec) if local.augment else None
    g = torch.Generator().manual_seed(seed)
    extras = _extras(model, yt, proximal_mu, rule, local.sam_rho, local.logit_adjust)
    probe = torch.zeros((2, *xt.shape[1:]), dtype=xt.dtype)  # no sample of the node's
    private = PrivateTraining(model, opt, len(yt), local.batch_size, dp_noise,
                              local.dp_max_grad_norm,
                              normalize(probe.to(device), input_spec)) if local.dp_sgd else None
    net, step_opt = (model, opt) if private is None else (private.module,
                                                          private.private_optimizer)
    smallest = 2 if _batchnorms(model) else 1  # BatchNorm cannot train on one sample
    batches = (_round_batches(len(yt), local, g, smallest) if private is None else
               private.batches(local.local_epochs, local.local_steps or 0, g))
    total = count = steps = 0
    try:
        with torch.random.fork_rng(devices=[]), quiet_hooks(private):
            torch.manual_seed(seed)  # the augmentations' draws, without touching the caller's
            for idx in batches:
                xb = normalize((xt[idx] if aug is None else aug(xt[idx])).to(device),
                               input_spec)
                loss = _step(net, step_opt, xb, yt[idx].to(device), *extras,
                             clip=local.clip_grad_norm)
                if sched is not None:
                    sched.step()
                if len(idx):  # an empty DP-SGD batch: a step of noise alone, no loss
                    total, count = total + loss * len(idx), count + len(idx)
                steps += 1
    finally:
        if private is not None:
            private.close()
    if count and not math.isfinite(total):
        raise FloatingPointError(_diverged(total / count, *extras[1:]))
    return {"train_loss": total / max(count, 1), "num_examples": int(len(yt)), "steps": steps,
            **({"dp_sample_rate": private.q} if private is not None else {})}


def check_batch_size(model: nn.Module, batch_size: int) -> None:
    """Refuse ``--batch-size 1`` for a model with BatchNorm layers.

    BatchNorm cannot train on one sample, so every batch would be left out and the nodes
    would train nothing.

    Raises
    ------
    UserError
        ``batch_size`` below 2 and ``model`` holds a BatchNorm layer.
    """
    if batch_size < 2 and _batchnorms(model):
        raise UserError("the model has BatchNorm layers, which cannot train on batches of one "
                        "sample: every batch would be left out; use --batch-size 2 or more")


def _batchnorms(model: nn.Module) -> list[nn.Module]:
    """Return ``model``'s BatchNorm layers (any dimension)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _extras(model: nn.Module, yt: torch.Tensor, proximal_mu: float, rule, sam_rho: float,
            logit_adjust: float) -> tuple:
    """Return what :func:`_step` takes beyond the batch: the proximal anchor, SAM, the rest."""
    anchor = [p.detach().clone() for p in trainable(model)] if proximal_mu > 0 else None
    adjust = LogitAdjustment(yt, logit_adjust) if logit_adjust > 0 else None
    return anchor, proximal_mu, rule, sam_rho, adjust


def _diverged(loss: float, proximal_mu: float, rule, sam_rho: float, adjust=None) -> str:
    """Say that training diverged and what to change: the rates, or the method's options."""
    own = [] if rule is None else ["--" + k.replace("_", "-") for k in rule.options]
    own += ["--mu"] if proximal_mu > 0 else []  # FedProx's proximal term
    rates = ["--lr"] + ["--sam-rho"] * (sam_rho > 0) + ["--logit-adjust"] * (adjust is not None)
    lower = " or ".join(rates) if len(rates) < 3 else f"{', '.join(rates[:-1])} or {rates[-1]}"
    return f"training diverged (loss {loss}); lower {lower}" + (
        f" or check {', '.join(own)}" if own else "")


def _step(model: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor,
          anchor: list[torch.Tensor] | None, proximal_mu: float, rule=None,
          sam_rho: float = 0.0, adjust=None, clip: float = 0.0) -> float:
    """One optimizer step on a batch; return its cross-entropy (without the extra terms).

    The gradient is SAM's when ``sam_rho > 0``, then clipped to the L2 norm ``clip`` (over
    all parameters) when ``clip > 0``, then corrected by the method's node rule.
    """
    opt.zero_grad(set_to_none=True)
    loss, total = _losses(model, xb, yb, anchor, proximal_mu, rule, adjust)
    total.backward()
    if sam_rho > 0:
        sharpness_aware_gradient(
            model, lambda: _losses(model, xb, yb, anchor, proximal_mu, rule, adjust)[1],
            sam_rho)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(trainable(model), clip)
    if rule is not None:
        rule.before_step(model, float(opt.param_groups[0]["lr"]))
    opt.step()
    return float(loss.detach())


def _losses(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor,
            anchor: list[torch.Tensor] | None, proximal_mu: float, rule, adjust=None):
    """Return the batch's cross-entropy and the loss to descend (plus the extra terms)."""
    logits = model(xb)
    loss = nn.functional.cross_entropy(logits if adjust is None else adjust(logits), yb)
    total = loss
    if anchor is not None:
        prox = sum(((p - a) ** 2).sum() for p, a in zip(trainable(model), anchor))
        total = total + 0.5 * proximal_mu * prox
    if rule is not None:
        extra = rule.loss(model, xb, logits)
        if extra is not None:
            total = total + extra
    return loss, total


def sharpness_aware_gradient(model: nn.Module, loss_fn, rho: float) -> None:
    """Replace the parameters' gradients ``g`` by SAM's: the gradient at ``w + rho*g/||g||``.

    Foret et al. 2021 (arXiv:2010.01412), the first-order form: the weights move by
    ``e = rho * g / ||g||`` (``||g||`` the L2 norm over all parameters' gradients), the loss
    is taken and differentiated there, and the weights move back by ``e``; the optimizer
    then steps with the new gradient from the original weights. BatchNorm layers keep their
    running statistics through the perturbed pass (it is not a step of its own). A zero or
    non-finite ``||g||`` leaves ``g`` as it is.

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters hold ``g`` (after ``backward``); they hold SAM's gradient after.
    loss_fn : callable
        Returns the scalar loss to differentiate, computed afresh from ``model``.
    rho : float
        Neighbourhood radius, in the parameters' own units (L2), > 0.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    if not (math.isfinite(norm) and norm > 0):
        return
    moves = [p.grad * (rho / norm) for p in params]
    norms = [m for m in _batchnorms(model) if m.track_running_stats]
    with torch.no_grad():
        for p, e in zip(params, moves):
            p.add_(e)
    for p in model.parameters():
        p.grad = None
    try:
        for m in norms:  # batch statistics, without updating the running ones
            m.track_running_stats = False
        loss_fn().backward()
    finally:
        for m in norms:
            m.track_running_stats = True
        with torch.no_grad():
            for p, e in zip(params, moves):
                p.sub_(e)
