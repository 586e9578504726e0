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

Never an exception for what was observed: a factor of 0 (no noise observed: the caller's
finding ``noise_absent``), a factor that is not a finite number (a release that holds NaN
or Inf: ``release_nonfinite``) and an effective σ so small that ε leaves the float range
all give ε = ∞ (:func:`noise_finding` names the first two).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from audit.claims.mistakes import Eps, Mech
from fl.privacy.accounting import Event, epsilon_of_events

__all__ = [
    "SIGMA_FLOOR",
    "epsilon_of_scaled_claim",
    "epsilon_of_scaled_events",
    "gdp_epsilon_or_inf",
    "noise_finding",
]

#: below this effective σ the PLD grid grows past memory (see the module doc)
SIGMA_FLOOR = 0.25


def _unusable(factor) -> bool:
    """A factor that implies no noise at all (0, negative) or is not a number."""
    try:
        f = float(factor)
    except (TypeError, ValueError):
        return True
    return not (math.isfinite(f) and f > 0)


def _or_infinite(compute) -> float:
    """``compute()``, or ∞ where an effective σ near 0 takes ε out of the float range (the
    PLD grid and the μ-GDP solver overflow there)."""
    try:
        eps = float(compute())
    except (OverflowError, ZeroDivisionError, FloatingPointError):
        return math.inf
    return eps if not math.isnan(eps) else math.inf


#: a μ-GDP parameter above this is ε = ∞ in floats (ε ≈ μ²/2 overflows the solver)
MU_MAX = 1e150


def gdp_epsilon_or_inf(mu, delta: float) -> float:
    """ε(δ) of μ-GDP (:func:`audit.bounds.hypothesis.gdp_epsilon`), ∞ where μ is ∞, NaN or
    above :data:`MU_MAX` (a noise factor near 0 divides by nearly 0: the solver would
    overflow or raise), never an exception for what was observed."""
    from audit.bounds.hypothesis import gdp_epsilon

    try:
        m = float(mu)
    except (TypeError, ValueError):
        return math.inf
    if not (math.isfinite(m) and m <= MU_MAX):
        return math.inf
    return _or_infinite(lambda: gdp_epsilon(m, delta))


def noise_finding(factor) -> tuple[str, str] | None:
    """(code, why) of the finding an observed noise ``factor`` calls for, or None: not a
    finite number → ``release_nonfinite`` (the releases held NaN or Inf); 0 →
    ``noise_absent`` (the releases carry no noise at all). Either way the implied ε is ∞."""
    try:
        f = float(factor)
    except (TypeError, ValueError):
        return "release_nonfinite", f"the observed noise factor is not a number ({factor!r})"
    if not math.isfinite(f):
        return (
            "release_nonfinite",
            f"the observed noise factor is {f} (the releases hold NaN or Inf)",
        )
    if f <= 0:
        return "noise_absent", "the releases carry no noise: observed noise factor 0"
    return None


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
    bound on the implied ε. A factor that is not a finite number, or an effective σ so small
    that ε overflows: ∞, never an exception."""
    if _unusable(factor):
        return math.inf, False
    floored, eps = False, 0.0
    for events in units:
        scaled = []
        for e in events:
            s, f = _scaled(e, factor)
            scaled.append(s)
            floored = floored or f
        eps = max(eps, _or_infinite(lambda ev=scaled: epsilon_of_events(ev, delta)))
    return eps, floored


def epsilon_of_scaled_claim(
    mech: Mech, sigma: float, factor: float, delta: float
) -> tuple[float, bool]:
    """(ε, at_least): the ε(δ) of a claim's mechanism (:func:`audit.claims.mistakes.reference`)
    at noise multiplier σ × ``factor``, computed as :func:`audit.claims.check.check_claim`
    computes the claim's own ε (so ``factor`` = 1 gives exactly its ``epsilon_pld``):
    Poisson-subsampled steps by PLD, with the floor of :data:`SIGMA_FLOOR` on the step's
    multiplier (``at_least``); plain Gaussians in closed form (μ-GDP), no floor needed.
    σ or ``factor`` <= 0, or not a finite number → ∞; an effective σ so small that ε
    overflows → ∞ (never an exception)."""
    if _unusable(factor) or _unusable(sigma):
        return math.inf, False
    s = sigma * factor
    if not s > 0:  # σ·factor underflowed
        return math.inf, False
    if mech.poisson and mech.q < 1.0:
        ev, floored = _scaled(mech.event(sigma), factor)
        if not floored:
            return _or_infinite(lambda: Eps(s, delta)(mech, "pld")), False
        return _or_infinite(lambda: epsilon_of_events([ev], delta)), True
    if mech.sens * math.sqrt(mech.count) / s > MU_MAX:
        return math.inf, False
    return _or_infinite(lambda: Eps(s, delta)(mech, "pld")), False
