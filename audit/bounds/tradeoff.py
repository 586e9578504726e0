"""Trade-off curves of f-DP (Dong, Roth & Su 2019) and the families the one-run f-DP test uses.

mu-GDP (:func:`gdp_tradeoff`, :func:`gdp_inverse_blowup`), (eps, delta)-DP
(:func:`dp_inverse_blowup`), a curve from a privacy profile (:class:`ProfileCurve`) and the
ledger's own Poisson-subsampled Gaussian mechanism with its noise divided by a factor
(:class:`SubsampledGaussian`, :func:`mechanism_tradeoff`, :class:`MechanismFamily`), built from
dp_accounting's pessimistic PLD so that the curve lies below the exact one. B(x) = 1 - f(x) is
the blow-up function of a curve f; the test in :mod:`audit.bounds.fdp` needs B^-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import special

__all__ = [
    "gdp_tradeoff",
    "gdp_inverse_blowup",
    "dp_inverse_blowup",
    "ProfileCurve",
    "SubsampledGaussian",
    "MechanismFamily",
    "mechanism_tradeoff",
]


def gdp_tradeoff(mu: float, x) -> np.ndarray:
    """Trade-off curve of mu-GDP: f(x) = Phi(Phi^-1(1 - x) - mu) (Dong, Roth & Su 2019)."""
    x = np.asarray(x, dtype=np.float64)
    return special.ndtr(special.ndtri(1.0 - x) - float(mu))


def gdp_inverse_blowup(mu, a) -> np.ndarray:
    """B^-1(a) = Phi(Phi^-1(a) - mu): the least P[E] under one neighbour given P[E] = a under
    the other, for mu-GDP (B(x) = 1 - f(x)). Broadcasts mu and a."""
    a = np.asarray(a, dtype=np.float64)
    return special.ndtr(special.ndtri(a) - np.asarray(mu, dtype=np.float64))


def dp_inverse_blowup(eps, delta: float, a) -> np.ndarray:
    """B^-1(a) of (eps, delta)-DP: max(0, e^-eps (a - delta), 1 - delta - e^eps (1 - a)).

    From f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x)) and
    B^-1(a) = inf{b : 1 - f(b) >= a}. Broadcasts eps and a.
    """
    a = np.asarray(a, dtype=np.float64)
    eps = np.asarray(eps, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t1 = np.exp(-eps) * (a - delta)
        t2 = 1.0 - delta - np.exp(eps) * (1.0 - a)
    return np.maximum(0.0, np.fmax(t1, np.nan_to_num(t2, nan=-np.inf, neginf=-np.inf)))


@dataclass(frozen=True)
class ProfileCurve:
    """A symmetric trade-off curve given by a privacy profile on a grid of epsilons.

    A mechanism that is (eps_j, delta_j)-DP for every j is f-DP for
    f(x) = max_j max(0, 1 - delta_j - e^eps_j x, e^-eps_j (1 - delta_j - x)) (in both directions,
    since each (eps, delta) curve is symmetric). A finite grid, or deltas that over-state the
    profile, only lower f: a weaker hypothesis, so tests against it stay valid.

    Attributes:
        eps: shape (G,), epsilons (nats, >= 0).
        delta: shape (G,), delta(eps) at each, in [0, 1].
    """

    eps: np.ndarray
    delta: np.ndarray

    def tradeoff(self, x) -> np.ndarray:
        """f(x), shape of x."""
        x = np.asarray(x, dtype=np.float64)[..., None]
        e, d = self.eps, self.delta
        v = np.maximum(1.0 - d - np.exp(e) * x, np.exp(-e) * (1.0 - d - x))
        return np.maximum(v.max(axis=-1), 0.0)

    def inverse_blowup(self, a) -> np.ndarray:
        """B^-1(a) = max_j dp_inverse_blowup(eps_j, delta_j, a), shape of a."""
        a = np.asarray(a, dtype=np.float64)[..., None]
        e, d = self.eps, self.delta
        with np.errstate(over="ignore"):
            t1 = np.exp(-e) * (a - d)
            t2 = 1.0 - d - np.exp(e) * (1.0 - a)
        return np.maximum(np.maximum(t1, t2).max(axis=-1), 0.0)


# --------------------------------------------------------------------------- the mechanism


@dataclass(frozen=True)
class SubsampledGaussian:
    """``steps`` compositions of a Poisson-subsampled Gaussian mechanism.

    Attributes:
        sigma: noise multiplier (noise std / l2 sensitivity), > 0.
        q: Poisson sampling rate in (0, 1] (1 = no subsampling).
        steps: number of compositions, >= 0.
    """

    sigma: float
    q: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma must be finite and > 0, got {self.sigma}")
        if not (0.0 < self.q <= 1.0):
            raise ValueError(f"q must be in (0, 1], got {self.q}")
        if int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {self.steps}")


def _as_events(events) -> tuple[SubsampledGaussian, ...]:
    """Events as SubsampledGaussian: accepts those, (sigma, q, steps) tuples, or objects with
    ``noise_multiplier``, ``sample_rate`` and ``count`` (fl.privacy.accounting.Event)."""
    out = []
    for e in events:
        if isinstance(e, SubsampledGaussian):
            out.append(e)
        elif hasattr(e, "noise_multiplier"):
            out.append(SubsampledGaussian(e.noise_multiplier, e.sample_rate, int(e.count)))
        else:
            sigma, q, steps = e
            out.append(SubsampledGaussian(float(sigma), float(q), int(steps)))
    if not out:
        raise ValueError("need at least one event")
    return tuple(out)


def _pld(events: tuple[SubsampledGaussian, ...], pessimistic: bool, discretization: float):
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    total = None
    for e in events:
        if e.steps == 0:
            continue
        one = pldlib.from_gaussian_mechanism(
            standard_deviation=e.sigma,
            sensitivity=1.0,
            sampling_prob=e.q,
            pessimistic_estimate=pessimistic,
            value_discretization_interval=discretization,
            use_connect_dots=pessimistic,  # connect-the-dots is pessimistic only
        )
        one = one.self_compose(e.steps) if e.steps > 1 else one
        total = one if total is None else total.compose(one)
    return total


@lru_cache(maxsize=256)
def _mechanism_curve(
    events: tuple[SubsampledGaussian, ...], n_grid: int, discretization: float
) -> ProfileCurve:
    pld = _pld(events, pessimistic=True, discretization=discretization)
    if pld is None:  # nothing released: perfectly private, f(x) = 1 - x
        return ProfileCurve(np.array([0.0]), np.array([0.0]))
    # eps range: up to where delta(eps) is negligible (1e-15); a shorter grid is still valid.
    eps_max = min(max(float(pld.get_epsilon_for_delta(1e-15)), 1e-3), 500.0)
    eps = np.linspace(0.0, eps_max, n_grid)
    delta = np.minimum(np.asarray(pld.get_delta_for_epsilon(eps), dtype=np.float64), 1.0)
    return ProfileCurve(eps, delta)


def mechanism_tradeoff(
    events, noise_divisor: float = 1.0, n_grid: int = 400, discretization: float = 1e-3
) -> ProfileCurve:
    """Trade-off curve of the composition of Poisson-subsampled Gaussian events.

    Built from the privacy profile delta(eps) of dp_accounting's pessimistic PLD (add-or-remove
    neighbours, the larger of the two directions) on ``n_grid`` epsilons in [0, eps_max], where
    delta(eps_max) <= 1e-15. The result lies below the exact curve (valid as a hypothesis).

    Args:
        events: SubsampledGaussian events, (sigma, q, steps) tuples or ledger Events.
        noise_divisor: every sigma is divided by this (> 0); 1 = the ledger as claimed.
        n_grid: number of epsilons in the profile grid.
        discretization: PLD value discretization interval.

    Returns:
        A :class:`ProfileCurve`.
    """
    evs = _as_events(events)
    if not noise_divisor > 0:
        raise ValueError(f"noise_divisor must be > 0, got {noise_divisor}")
    scaled = tuple(SubsampledGaussian(e.sigma / noise_divisor, e.q, e.steps) for e in evs)
    return _mechanism_curve(scaled, int(n_grid), float(discretization))


def _mechanism_epsilon(events, noise_divisor: float, delta: float, discretization: float) -> float:
    """eps(delta) of the scaled ledger from the optimistic PLD (a lower bound on the exact)."""
    evs = tuple(SubsampledGaussian(e.sigma / noise_divisor, e.q, e.steps) for e in events)
    pld = _pld(evs, pessimistic=False, discretization=discretization)
    return 0.0 if pld is None else max(float(pld.get_epsilon_for_delta(delta)), 0.0)


@dataclass(frozen=True)
class MechanismFamily:
    """The ledger's own trade-off curves, with every noise multiplier divided by theta.

    theta = 1 is the mechanism as claimed; larger theta is less private. ``fdp_one_run_bound``
    reports the largest theta it rejects (theta_lb) and eps_lb = eps(delta) at that theta.
    """

    events: tuple
    n_grid: int = 400
    discretization: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", _as_events(self.events))

    def curve(self, theta: float) -> ProfileCurve:
        return mechanism_tradeoff(self.events, theta, self.n_grid, self.discretization)

    def epsilon(self, theta: float, delta: float) -> float:
        return _mechanism_epsilon(self.events, theta, delta, self.discretization)
