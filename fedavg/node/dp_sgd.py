"""Record-level differential privacy on a node: DP-SGD with Opacus.

DP-SGD (Abadi et al. 2016, arXiv:1607.00133): each step draws its batch by Poisson sampling
(every sample of the node's partition joins independently with probability ``q = 1 /
ceil(N / B)``, ``N`` the partition's samples and ``B`` ``--batch-size``, as Opacus's
``DPDataLoader`` draws it), clips each sample's gradient to L2 norm ``C``
(``--dp-max-grad-norm``, over all trainable parameters together), sums the clipped
gradients, adds Gaussian noise of standard deviation ``z C`` (``--dp-noise``) and divides by
the expected batch size ``q N``; the optimizer (``--optimizer``) steps with that. Opacus
computes the per-sample gradients (``GradSampleModule``) and clips and noises them
(``DPOptimizer``). A round runs ``--local-epochs`` x ``ceil(N / B)`` such steps (or
``--local-steps``), an empty batch included: its step is noise alone, as the analysis
assumes.

The noise's generator is seeded from the operating system's randomness every round, not
from ``--seed``. Layers whose output for one sample depends on the other samples of its
batch (BatchNorm) have no per-sample gradient: a model holding one is refused, naming the
layer. The coordinator accounts the steps (:class:`fedavg.run.privacy.RecordLevelDP`).
"""

from __future__ import annotations

import contextlib
import math
import secrets
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fedavg.util.errors import UserError


def sample_rate(num_samples: int, batch_size: int) -> float:
    """Return ``q = 1 / ceil(N / B)``, the chance a sample joins a step's batch.

    Examples
    --------
    >>> sample_rate(100, 32)
    0.25
    """
    return 1.0 / max(1, math.ceil(num_samples / batch_size))


def steps_per_round(num_samples: int, batch_size: int, local_epochs: int,
                    local_steps: int = 0) -> int:
    """Return a round's DP-SGD steps: ``local_steps``, else ``local_epochs * ceil(N / B)``."""
    if local_steps:
        return int(local_steps)
    return int(local_epochs) * max(1, math.ceil(num_samples / batch_size))


def poisson_batches(num_samples: int, q: float, steps: int,
                    generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Yield ``steps`` index batches, each sample in each batch with probability ``q``.

    A batch may be empty (its step adds noise alone).
    """
    for _ in range(steps):
        yield torch.nonzero(torch.rand(num_samples, generator=generator) < q).flatten()


def unsupported_layer(model: nn.Module) -> str | None:
    """Return the first layer Opacus cannot give per-sample gradients, said in one line.

    ``None`` when every trainable layer is supported. The usual one is BatchNorm: each
    sample's output depends on the rest of its batch (a model with GroupNorm or LayerNorm
    instead trains privately).
    """
    from opacus.validators import ModuleValidator

    for name, module in model.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(module))
        trains = any(p.requires_grad for p in module.parameters(recurse=False))
        errors = check(module) if check is not None and trains else []
        if not errors:
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            advice = ("DP-SGD needs a model without BatchNorm: give --group-norm (GroupNorm "
                      "instead), or pick another --model")
        else:
            said = str(errors[0]).splitlines()[0].split(". ")[0][:160]
            advice = f"Opacus: {said}; pick another --model"
        return f"layer {name!r} ({type(module).__name__}) has no per-sample gradient: {advice}"
    return None


@dataclass
class PrivateTraining:
    """One round's DP-SGD: the wrapped model and optimizer, and the batches to draw.

    Parameters
    ----------
    model : torch.nn.Module
        Trained in place (Opacus's wrapper shares its parameters).
    optimizer : torch.optim.Optimizer
        The round's fresh optimizer; :attr:`optimizer` wraps it.
    num_samples, batch_size : int
        ``N`` and ``B``.
    noise : float
        ``z``, the noise multiplier.
    max_grad_norm : float
        ``C``, each sample's gradient clip.
    probe : torch.Tensor, optional
        A normalised batch of two inputs made of zeros (none of the node's samples, whose
        gradients this pass must not touch): per-sample gradients are taken with Opacus's
        hooks, unless a forward and backward pass of it fails on an in-place operation on a
        hooked layer's output (a ResNet's ``out += identity``); then with torch's expanded
        weights (Opacus's ``ew`` mode), which need no hooks.

    Raises
    ------
    UserError
        A layer has no per-sample gradient (:func:`unsupported_layer`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    num_samples: int
    batch_size: int
    noise: float
    max_grad_norm: float
    probe: torch.Tensor | None = None

    def __post_init__(self) -> None:
        from opacus.optimizers import DPOptimizer

        if problem := unsupported_layer(self.model):
            raise UserError(problem)
        for module in self.model.modules():  # Opacus's backward hooks take no in-place ops
            if getattr(module, "inplace", False) is True:
                module.inplace = False
        self.q = sample_rate(self.num_samples, self.batch_size)
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        with _quiet():
            self.module = self._per_sample_module()
            self.private_optimizer = DPOptimizer(
                self.optimizer, noise_multiplier=self.noise, max_grad_norm=self.max_grad_norm,
                expected_batch_size=max(1, round(self.num_samples * self.q)),
                loss_reduction="mean", generator=generator)

    def _per_sample_module(self) -> nn.Module:
        """Wrap the model for per-sample gradients: Opacus's hooks, else expanded weights."""
        from opacus.grad_sample import get_gsm_class

        mode = "hooks" if self.probe is None else per_sample_mode(self.model, self.probe)
        return get_gsm_class(mode)(self.model, loss_reduction="mean")

    def batches(self, local_epochs: int, local_steps: int,
                generator: torch.Generator) -> Iterator[torch.Tensor]:
        """Yield the round's Poisson batches (:func:`steps_per_round` of them)."""
        steps = steps_per_round(self.num_samples, self.batch_size, local_epochs, local_steps)
        yield from poisson_batches(self.num_samples, self.q, steps, generator)

    def close(self) -> None:
        """Take Opacus's hooks off the model (its weights keep the round's training)."""
        self.module.cleanup()
        for p in self.model.parameters():
            p.grad = None


def per_sample_mode(model: nn.Module, probe: torch.Tensor, name: str = "") -> str:
    """Return how Opacus takes ``model``'s per-sample gradients: ``hooks`` or ``ew``.

    A forward and backward pass of ``probe`` (a normalised batch of two inputs made of
    zeros) with Opacus's hooks, else with torch's expanded weights (a model that adds to a
    hooked layer's output in place, as a ResNet's ``out += identity``, fails the hooks).
    The model keeps no gradient of it.

    Raises
    ------
    UserError
        Neither gives per-sample gradients (a layer called without a batch dimension, one
        Opacus has no rule for ...), naming the model and both errors.
    """
    from opacus.grad_sample import get_gsm_class

    errors = []
    for mode in ("hooks", "ew"):
        wrapped = None
        try:
            with _quiet(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                wrapped = get_gsm_class(mode)(model, loss_reduction="mean")
                wrapped(probe).sum().backward()
            return mode
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
            errors.append(f"{mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        finally:
            if wrapped is not None and hasattr(wrapped, "cleanup"):
                wrapped.cleanup()
            for p in model.parameters():
                p.grad = None
                if hasattr(p, "grad_sample"):
                    p.grad_sample = None
    raise UserError(f"--dp-sgd: Opacus gives no per-sample gradients for model "
                    f"{name or type(model).__name__} ({'; '.join(errors)}): pick another "
                    "--model")


@contextlib.contextmanager
def _quiet():
    """Silence Opacus's notes on secure random numbers (the generator is seeded by the OS)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@contextlib.contextmanager
def quiet_hooks(private: PrivateTraining | None):
    """Silence torch's note that Opacus's backward hooks fire with no input needing a gradient.

    (The first layer's input is data: that is how per-sample gradients are taken.)
    """
    with warnings.catch_warnings():
        if private is not None:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
        yield
