"""Weighted output ensembles and ensemble distillation of the final node models.

- ``ensemble``: the merged model is the weighted average of the members' softmax outputs,
  ``p(y|x) = sum_i w_i softmax(f_i(x))``, saved as one artifact. Weights
  (``--ensemble-weights``): ``num-examples`` (proportional to training samples), ``uniform``,
  ``accuracy`` (proportional to held-out accuracy) or ``fitted`` (the weights on the simplex
  that minimise held-out negative log-likelihood, i.e. stacking / "super learner" weights,
  van der Laan et al. 2007).
- ``distill``: ensemble distillation into one network, as in FedDF (Lin et al. 2020,
  Ensemble Distillation for Robust Model Fusion in Federated Learning, arXiv:2006.07242): the
  student starts from the parameter average and is trained with Adam to match the ensemble's
  softmax (KL divergence) on unlabeled inputs, keeping the student with the best held-out
  accuracy.
"""

from __future__ import annotations

import torch

from strategies.base import Merged, MergeError, Option, register
from strategies.fedavg import FedAvg
from strategies.robust import _Collect

WEIGHTINGS = ("num-examples", "uniform", "accuracy", "fitted")


def fit_weights(probs: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> torch.Tensor:
    """Simplex weights minimising the NLL of the mixture ``sum_i w_i probs[i]``.

    Parameters
    ----------
    probs : torch.Tensor
        ``(M, N, K)`` member probabilities on ``N`` held-out samples.
    labels : torch.Tensor
        ``(N,)`` int64 labels.

    Returns
    -------
    torch.Tensor
        ``(M,)`` float64 weights, non-negative, summing to 1 (softmax parameterisation,
        optimised with L-BFGS from uniform).
    """
    p = probs.to(torch.float64)[:, torch.arange(len(labels)), labels]  # (M, N)
    theta = torch.zeros(p.shape[0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        w = torch.softmax(theta, 0)
        loss = -torch.log((w[:, None] * p).sum(0).clamp_min(1e-12)).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return torch.softmax(theta.detach(), 0)


@register
class Ensemble(_Collect):
    """Weighted average of the members' softmax outputs, saved as one model.

    Parameters
    ----------
    ensemble_weights : str
        ``num-examples``, ``uniform``, ``accuracy`` or ``fitted``.
    """

    name = "ensemble"
    description = "one-shot: weighted average of node models' softmax outputs"
    paper = ("Dietterich 2000, Ensemble Methods in Machine Learning; fitted weights: "
             "van der Laan et al. 2007, Super Learner")
    one_shot = True
    #: Its result is the node models as they came (no parameter merge): a LoRA run keeps
    #: each member's own adapters.
    keeps_members = True

    options = (Option("ensemble_weights", str, "num-examples", "How members are weighted",
                      choices=WEIGHTINGS),)

    def check(self) -> None:
        """``accuracy`` and ``fitted`` weights need a validation set."""
        self.needs_validation = self.ensemble_weights in ("accuracy", "fitted")

    def weights(self) -> tuple[torch.Tensor, dict]:
        """``(M,)`` member weights and facts about how they were chosen."""
        n = torch.tensor(self._weights, dtype=torch.float64)
        if self.ensemble_weights == "num-examples":
            return n / n.sum(), {}
        if self.ensemble_weights == "uniform":
            return torch.full_like(n, 1.0 / len(n)), {}
        ctx = self._context
        if ctx is None or ctx.val_x is None:
            raise MergeError(f"--ensemble-weights {self.ensemble_weights} needs a validation "
                             "set (--validation)")
        probs = torch.stack([ctx.probabilities(m, ctx.val_x) for m in self._models])
        accs = torch.tensor([ctx.accuracy(p) for p in probs], dtype=torch.float64)
        info = {"member_val_accuracy": dict(zip(self._nodes, [round(float(a), 6) for a in accs]))}
        if self.ensemble_weights == "accuracy":
            return (accs / accs.sum() if accs.sum() > 0 else torch.full_like(accs, 1 / len(accs)),
                    info)
        return fit_weights(probs, ctx.val_y), info

    def combine(self) -> Merged:
        """Return the collected models as ensemble members, weighted by ``ensemble_weights``.

        The merged ``state_dict`` is the members' sample-weighted parameter average.
        """
        w, info = self.weights()
        avg = FedAvg().merge(self._models, self._weights, self._nodes)
        return Merged(avg.state_dict, len(self._models), sum(self._weights),
                      members=self._models, member_weights=[float(v) for v in w],
                      info={"weighting": self.ensemble_weights, "nodes": self._nodes, **info})


@register
class Distill(_Collect):
    """FedDF-style ensemble distillation into one network.

    Parameters
    ----------
    distill_steps : int
        Adam steps on batches of unlabeled inputs.
    distill_lr : float
        Adam learning rate.
    distill_batch_size : int
        Samples per step.
    distill_temperature : float
        Softmax temperature of teacher and student in the KL loss.
    distill_augment : str
        ``none``, or ``default``: each distillation batch is augmented with the data kind's
        default (random crop and flip for colour images) and the ensemble labels it anew,
        as FedDF does; each step then runs every member once more.
    """

    name = "distill"
    description = ("one-shot: distil the node ensemble into one network on unlabeled data "
                   "(--distill-data)")
    paper = ("Lin et al. 2020, Ensemble Distillation for Robust Model Fusion in Federated "
             "Learning, arXiv:2006.07242")
    one_shot = True
    needs_validation = True
    needs_unlabeled = True

    options = (
        Option("distill_steps", int, 1000, "Adam steps of distillation (>= 1)"),
        Option("distill_lr", float, 1e-3, "Adam learning rate of distillation (> 0)"),
        Option("distill_batch_size", int, 128, "Unlabeled samples per distillation step"),
        Option("distill_temperature", float, 1.0, "Softmax temperature of the KL loss (> 0)"),
        Option("distill_augment", str, "none", "Augment distillation batches (the data kind's "
               "default, labelled by the ensemble each step)", choices=("none", "default")),
    )

    def check(self) -> None:
        """Check that steps and batch size are >= 1, learning rate and temperature > 0."""
        for flag, value, ok in (("--distill-steps", self.distill_steps, ">= 1"),
                                ("--distill-batch-size", self.distill_batch_size, ">= 1"),
                                ("--distill-lr", self.distill_lr, "> 0"),
                                ("--distill-temperature", self.distill_temperature, "> 0")):
            if not (value >= 1 if ok == ">= 1" else value > 0):
                raise ValueError(f"{flag} must be {ok} (got {value})")

    def combine(self) -> Merged:
        """Return one network distilled from the weighted ensemble of the collected models.

        The student starts from the FedAvg of the models; the state with the best validation
        accuracy is kept (``info["best_step"]``: 0 when no step beat the start, and then
        ``info["note"]`` says so).
        """
        ctx = self._context
        if ctx is None or ctx.distill_x is None or ctx.val_x is None:
            raise MergeError("distill needs unlabeled data (--distill-data) and a validation "
                             "set (--validation)")
        augment = None
        if self.distill_augment == "default":
            if ctx.augment is None:
                raise MergeError("--distill-augment default: this kind of input has no default "
                                 "augmentation; use --distill-augment none")
            augment = ctx.augment
        x, t = ctx.distill_x, self.distill_temperature
        teachers = self._teachers()
        fixed = None if augment is not None else self._soft_labels(teachers, x)
        start = FedAvg().merge(self._models, self._weights, self._nodes).state_dict
        student = ctx.build_model()
        student.load_state_dict(start)
        student.to(ctx.device)
        opt = torch.optim.Adam(student.parameters(), lr=self.distill_lr)
        g = torch.Generator().manual_seed(ctx.seed)

        def val_acc() -> float:
            sd = {k: v.detach().cpu() for k, v in student.state_dict().items()}
            return ctx.accuracy(ctx.probabilities(sd, ctx.val_x))

        best_acc = start_acc = val_acc()
        best_step = 0
        best = {k: v.detach().cpu().clone() for k, v in student.state_dict().items()}
        check_every = max(self.distill_steps // 20, 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)  # the augmentations' draws
            for step in range(1, self.distill_steps + 1):
                idx = torch.randint(len(x), (min(self.distill_batch_size, len(x)),), generator=g)
                xb = x[idx] if augment is None else augment(x[idx])
                target = fixed[idx] if fixed is not None else self._soft_labels(teachers, xb)
                student.train()
                out = student(ctx.normalize(xb.to(ctx.device))).float()
                loss = torch.nn.functional.kl_div(torch.log_softmax(out / t, dim=1),
                                                  target.to(ctx.device),
                                                  reduction="batchmean") * t * t
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step % check_every == 0 or step == self.distill_steps:
                    acc = val_acc()
                    if acc > best_acc:
                        best_acc, best_step = acc, step
                        best = {k: v.detach().cpu().clone()
                                for k, v in student.state_dict().items()}
        info = {"val_accuracy_average": round(start_acc, 6), "val_accuracy": round(best_acc, 6),
                "steps": self.distill_steps, "best_step": best_step, "unlabeled_samples": len(x),
                "augment": self.distill_augment}
        if best_step == 0:  # said by the run and by `fedavg merge`
            info["note"] = ("no distillation step beat the members' average on the validation "
                            "data, so the model is that average (try other --distill-steps or "
                            "--distill-lr)")
        return Merged(best, len(self._models), sum(self._weights), info=info)

    def _teachers(self) -> list[tuple[float, torch.nn.Module]]:
        """Return the members as ``(weight, model)``, weights summing to 1, in eval mode."""
        ctx = self._context
        weights = torch.tensor(self._weights, dtype=torch.float32)
        out = []
        for w, m in zip((weights / weights.sum()).tolist(), self._models):
            model = ctx.build_model()
            model.load_state_dict(m)
            out.append((w, model.to(ctx.device).eval()))
        return out

    @torch.no_grad()
    def _soft_labels(self, teachers, x: torch.Tensor) -> torch.Tensor:
        """``(N, K)``: the ensemble's weighted softmax at temperature ``T`` on raw ``x``."""
        ctx, t = self._context, self.distill_temperature
        total = None
        for w, model in teachers:
            logits = torch.cat([model(ctx.normalize(x[i:i + 1024].to(ctx.device))).float().cpu()
                                for i in range(0, len(x), 1024)])
            p = torch.softmax(logits / t, dim=1) * w
            total = p if total is None else total + p
        return total
