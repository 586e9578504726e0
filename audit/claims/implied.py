"""The noise-implied ε: the ε a mechanism has if its Gaussian noise is ``factor`` times the
claimed one (every event's σ multiplied by ``factor``), the figure the conformance audits
put beside the claimed ε (:func:`audit.bounds.conformance.implied_noise_factor` gives the
factor: the worst parameter group's upper confidence bound on the observed noise scale,
capped at 1).

One core for both audits: a run's (``audit.bundle.conformance``: the ledger's events per
accounting unit, :func:`epsilon_of_scaled_events`) and a training done elsewhere
(``audit.canaries.outside``: the claim's mechanism, :func:`epsilon_of_scaled_claim`).

The figure is conditional on the noise being Gaussian at the observed scale; it is not a
certified bound. Below :data:`SIGMA_FLOOR` the PLD grid of a subsampled Gaussian grows past
memory: an effective σ below it is raised to it (never above the unscaled σ), which gives a
*lower* bound on the implied ε (ε falls as σ grows), reported as "at least".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from audit.claims.mistakes import Eps, Mech
from fl.privacy.accounting import Event, epsilon_of_events

__all__ = ["SIGMA_FLOOR", "epsilon_of_scaled_claim", "epsilon_of_scaled_events"]

#: below this effective σ the PLD grid grows past memory (see the module doc)
SIGMA_FLOOR = 0.25


def _scaled(e: Event, factor: float) -> tuple[Event, bool]:
    s = e.noise_multiplier * factor
    floor = min(SIGMA_FLOOR, e.noise_multiplier)
    if 0 < s < floor:
        return replace(e, noise_multiplier=floor), True
    return replace(e, noise_multiplier=s), False


def epsilon_of_scaled_events(
    units: Iterable[Iterable[Event]], factor: float, delta: float
) -> tuple[float, bool]:
    """(ε, at_least): the largest over accounting ``units`` (each an iterable of events) of
    the ε(δ) of its events with every σ multiplied by ``factor`` (PLD); ``factor`` <= 0 →
    ∞. ``at_least``: some effective σ was raised to :data:`SIGMA_FLOOR`, so ε is a lower
    bound on the implied ε."""
    if factor <= 0:
        return math.inf, False
    floored, eps = False, 0.0
    for events in units:
        scaled = []
        for e in events:
            s, f = _scaled(e, factor)
            scaled.append(s)
            floored = floored or f
        eps = max(eps, epsilon_of_events(scaled, delta))
    return eps, floored


def epsilon_of_scaled_claim(
    mech: Mech, sigma: float, factor: float, delta: float
) -> tuple[float, bool]:
    """(ε, at_least): the ε(δ) of a claim's mechanism (:func:`audit.claims.mistakes.reference`)
    at noise multiplier σ × ``factor``, computed as :func:`audit.claims.check.check_claim`
    computes the claim's own ε (so ``factor`` = 1 gives exactly its ``epsilon_pld``):
    Poisson-subsampled steps by PLD, with the floor of :data:`SIGMA_FLOOR` on the step's
    multiplier (``at_least``); plain Gaussians in closed form (μ-GDP), no floor needed.
    σ or ``factor`` <= 0 → ∞."""
    if factor <= 0 or sigma <= 0:
        return math.inf, False
    s = sigma * factor
    if mech.poisson and mech.q < 1.0:
        ev, floored = _scaled(mech.event(sigma), factor)
        if not floored:
            return Eps(s, delta)(mech, "pld"), False
        return epsilon_of_events([ev], delta), True
    return Eps(s, delta)(mech, "pld"), False
