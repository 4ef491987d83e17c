"""Server-side stochastic weight averaging (SWA) of the global model over rounds.

Whatever strategy merges a round, the coordinator may also keep the running mean of the
merged models from a chosen round on, and evaluate and save that mean instead of the last
round's model; the nodes keep training from the last merged model, as without it. Averaging
the late points of one training trajectory lands in a wider, flatter region of the loss than
any single point (Izmailov et al. 2018, "Averaging Weights Leads to Wider Optima and Better
Generalization", arXiv:1803.05407); in federated learning the server averages its global
models (Caldarola et al. 2022, "Improving Generalization in Federated Learning by Seeking Flat
Minima", arXiv:2203.11834, SWA with a cycle of one round here).

Pure tensor math over state dicts, no Flower import.
"""

from __future__ import annotations

import torch

from strategies.tensors import MergeError, StateDict, first_non_finite, is_float, signature


class WeightAverage:
    """Running mean of a sequence of state dicts: ``mean_n = mean_{n-1} + (x_n - mean_{n-1}) / n``.

    Floating-point tensors are averaged (in float64, stored in their own dtype); integer and
    boolean buffers (BatchNorm's ``num_batches_tracked``) take the latest model's value.
    BatchNorm running statistics are averaged like weights, an approximation of recomputing
    them for the averaged weights.

    Attributes
    ----------
    count : int
        Models averaged so far.
    """

    def __init__(self) -> None:
        self.count = 0
        self._mean: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def add(self, state_dict: StateDict) -> dict[str, torch.Tensor]:
        """Fold in one model; return the mean of all models added so far.

        Parameters
        ----------
        state_dict : mapping of str to torch.Tensor
            A model with the keys, shapes and dtypes of the first one added.

        Returns
        -------
        dict of str to torch.Tensor
            The mean, each tensor in its model's dtype (new tensors, safe to keep).

        Raises
        ------
        MergeError
            Keys, shapes or dtypes that differ from the first model's, or non-finite values.
        """
        bad = first_non_finite(state_dict)
        if bad is not None:
            raise MergeError(f"the model to average holds NaN or infinite values in {bad!r}")
        if self.count:
            _check_fits(self._signature(), state_dict, "the model to average")
        self.count += 1
        n = self.count
        if n == 1:
            self._dtypes = {k: t.dtype for k, t in state_dict.items()}
        for key, t in state_dict.items():
            t = t.detach().cpu()
            if n == 1 or not is_float(t.dtype):
                self._mean[key] = t.to(torch.float64) if is_float(t.dtype) else t.clone()
            else:
                self._mean[key] += (t.to(torch.float64) - self._mean[key]) / n
        return self.mean()

    def mean(self) -> dict[str, torch.Tensor]:
        """Return the current mean, each tensor in its model's dtype (new tensors).

        Raises
        ------
        MergeError
            Nothing added yet.
        """
        if not self.count:
            raise MergeError("no model averaged yet")
        return {k: v.to(self._dtypes[k]).clone() for k, v in self._mean.items()}

    def _signature(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), self._dtypes[k]) for k, v in self._mean.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """Return the exact mean for a checkpoint (empty before any add).

        Floating tensors stay in float64, so that a resumed run averages as an unbroken one.
        """
        return {k: v.clone() for k, v in self._mean.items()}

    def load(self, mean: StateDict, count: int, reference: StateDict) -> None:
        """Go on from a :meth:`state` of ``count`` models, for a model like ``reference``.

        Raises
        ------
        MergeError
            A count below 1, or a mean that does not fit ``reference``.
        """
        if count < 1:
            raise MergeError(f"a saved weight average of {count} models")
        stored = {k: (shape, torch.float64 if is_float(dtype) else dtype)
                  for k, (shape, dtype) in signature(reference).items()}
        _check_fits(stored, mean, "the saved weight average")
        bad = first_non_finite(mean)
        if bad is not None:
            raise MergeError(f"the saved weight average holds NaN or infinite values in {bad!r}")
        self.count = count
        self._dtypes = {k: v.dtype for k, v in reference.items()}
        self._mean = {k: v.detach().cpu().clone() for k, v in mean.items()}


def _check_fits(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], state_dict: StateDict,
                what: str) -> None:
    """Raise :class:`MergeError` naming the first key of ``state_dict`` unlike ``expected``."""
    got = signature(state_dict)
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise MergeError(f"{what} has other tensors: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    for key, (shape, dtype) in expected.items():
        if got[key] != (shape, dtype):
            raise MergeError(f"{what}: {key!r} is {got[key][0]} {got[key][1]}, expected "
                             f"{shape} {dtype}")
