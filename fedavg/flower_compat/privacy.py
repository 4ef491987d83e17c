"""Flower's privacy accountant (``flwr.supercore.privacy_accounting``, over ``dp-accounting``).

Node-level DP (:mod:`fedavg.run.privacy`) accounts its rounds with it: Flower's RDP accountant
with its neighbouring relations and sampling methods, one Gaussian release per round.
"""

from __future__ import annotations

from typing import Any


def rdp_accountant(delta: float, population: int, sampled: bool) -> Any:
    """Return Flower's RDP accountant for a run of ``population`` nodes.

    ``sampled``: rounds sample nodes without replacement (the neighbouring relation is then
    replacing one node); else every node takes part (adding or removing one node, no
    amplification by sampling).
    """
    from flwr.supercore.privacy_accounting import (
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    if sampled:
        how = (NeighboringRelation.REPLACE_ONE, SamplingMethod.WITHOUT_REPLACEMENT)
    else:
        how = (NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    return RdpAccountant(PrivacyConfig(delta, population, *how))


def gaussian_release(noise_multiplier: float, sample: int, population: int) -> Any:
    """Return one round's release: a Gaussian of ``noise_multiplier`` over ``sample`` nodes."""
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    return GaussianPrivacyEvent(noise_multiplier, sample, population)
