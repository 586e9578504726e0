"""One-run empirical lower bounds in the f-DP framework (Mahloujifar, Melis & Chaudhuri 2024).

Setting (the same as :func:`audit.bounds.one_run.epsilon_one_run`): m canaries, each included in the
single training run independently with probability 1/2. The auditor ranks the canaries by score
(higher = more likely included), guesses "in" for the k+ highest and "out" for the k- lowest and
abstains on the rest: k = k+ + k- guesses, c of them correct.

The test. Let N be the number of correct guesses and, for i = 0..k,

    r_i = (1/m) E[#correct guesses * 1{N >= i}],     h_i = (1/m) E[#wrong guesses * 1{N >= i}].

Flipping one canary's inclusion bit turns the event "its guess is right and N >= i + 1" into
"its guess is wrong and N >= i", so if the mechanism is f-DP (with respect to adding or removing
one canary, in both directions) then per canary P[wrong, N >= i] >= B^-1(P[right, N >= i + 1]),
where B(x) = 1 - f(x) is the blow-up function of f; B^-1 is convex, so averaging over canaries
gives h_i >= B^-1(r_{i+1}). Also h_i >= h_{i+1}, r_i - r_{i+1} = i P[N = i] / m and
h_i - h_{i+1} = (k - i) P[N = i] / m, and r_0 + h_0 = k / m. If P[N >= c] >= tau then
r_c >= tau c / m and r_c + h_c >= tau k / m; starting from the least mass that allows
(all of it at N = c) and adding at each i < c only the mass P[N = i] the constraint forces,
one gets the smallest possible r_0 + h_0 (the paper's recursion "audit_rh_with_cap"). If even that
exceeds k / m, no f-DP mechanism gives P[N >= c] >= tau: the hypothesis "f-DP" is rejected at
level tau. :func:`min_total_mass` returns (r_0 + h_0) * m / k, the total probability that this
least-mass distribution needs (> 1 means rejected); the test suite checks it against a linear
program over all distributions of N (for piecewise-linear curves).

Families. The bound is the strongest member of a one-parameter family of trade-off curves that
the observation rejects:

* ``"gdp"``: mu-GDP, f(x) = Phi(Phi^-1(1 - x) - mu); reports ``mu_lb`` and
  eps_lb = eps(delta) of mu_lb-GDP (exact formula). "Not mu_lb-GDP" holds for any mechanism;
  reading it as "eps(delta) >= eps_lb" assumes the mechanism's trade-off curve is Gaussian.
* ``"dp"``: the (eps, delta)-DP curves at the given delta; eps_lb holds for any mechanism.
* a :class:`MechanismFamily` (the ledger's Poisson-subsampled Gaussians, with every noise
  multiplier divided by a factor theta >= 0): reports ``theta_lb`` ("the run is less private than
  the ledger with its noise divided by theta_lb") and eps_lb = the ledger's eps(delta) at that
  noise. The curve is built from the privacy profile delta(eps) of dp_accounting's pessimistic
  PLD (a weaker curve than the exact one, so the test stays valid); eps is read from its
  optimistic PLD (a lower bound).

Conservative numerics: every rejection is made with a margin (``_REJECT_MARGIN``); the reported
parameter is always one at which the test was evaluated and rejected; search grids only ever
stop short of the true boundary.

Choice of guesses: a fixed (k+, k-) is tested at level alpha; a search over a grid of splits
chosen before seeing the data tests each at alpha / (grid size) (union bound), as in
:func:`audit.bounds.one_run.epsilon_one_run`, so the best split's bound still holds at 1 - alpha.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import special

from audit.bounds.hypothesis import gdp_epsilon

__all__ = [
    "gdp_tradeoff",
    "gdp_inverse_blowup",
    "dp_inverse_blowup",
    "ProfileCurve",
    "SubsampledGaussian",
    "MechanismFamily",
    "mechanism_tradeoff",
    "min_total_mass",
    "fdp_rejects",
    "fdp_one_run_ideal",
    "fdp_one_run_bound",
    "default_k_grid",
]

# A hypothesis is rejected only if the least total probability exceeds 1 by this much: covers
# the floating-point error of the recursion (a few ulps per step) with a wide margin.
_REJECT_MARGIN = 1e-9


# --------------------------------------------------------------------------- trade-off curves


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


# --------------------------------------------------------------------------- the test


def min_total_mass(inverse_blowup: Callable, m: int, k: int, c: int, alpha: float) -> np.ndarray:
    """Least total probability a distribution of N needs to give P[N >= c] >= alpha under f-DP.

    Runs the recursion of the module docstring (batched: ``inverse_blowup`` maps an array of
    shape (B,) of r values to B^-1 of each of B hypotheses) and returns (r_0 + h_0) * m / k,
    shape (B,). A value > 1 means no f-DP mechanism makes >= c of k guesses correct with
    probability >= alpha: hypothesis rejected at level alpha. The loop stops early once every
    hypothesis has exceeded 1 (r, h only grow as i falls) or stopped changing.

    Args:
        inverse_blowup: callable r -> B^-1(r), elementwise, increasing and convex.
        m: number of canaries; k: guesses (1 <= k <= m); c: correct guesses (0 <= c <= k).
        alpha: the level (tau in the paper).
    """
    if not (0 <= c <= k <= m) or k < 1:
        raise ValueError(f"need 0 <= c <= k <= m and k >= 1, got m={m}, k={k}, c={c}")
    r0 = np.atleast_1d(np.asarray(inverse_blowup(np.array([0.0])), dtype=np.float64))
    shape = r0.shape
    r = np.full(shape, alpha * c / m)
    h = np.full(shape, alpha * (k - c) / m)
    cap = k / m
    active = np.ones(shape, dtype=bool)
    for i in range(c - 1, -1, -1):
        need = np.asarray(inverse_blowup(r), dtype=np.float64)
        grow = need > h
        active &= grow & (r + h <= cap * (1.0 + 1e-6))  # past that: rejected for good
        if not active.any():
            break
        dh = np.where(active, need - h, 0.0)
        r = r + (i / (k - i)) * dh
        h = h + dh
    return (r + h) / cap


def fdp_rejects(inverse_blowup: Callable, m: int, k: int, c: int, alpha: float) -> np.ndarray:
    """Boolean array: is each hypothesis rejected at level alpha (see :func:`min_total_mass`)."""
    return min_total_mass(inverse_blowup, m, k, c, alpha) > 1.0 + _REJECT_MARGIN


# --------------------------------------------------------------------------- parameter search


def _largest_rejected(
    rejects: Callable[[np.ndarray], np.ndarray], start: float, cap: float, batch: int, rounds: int
) -> float:
    """Largest theta in (0, cap] found rejected, for a family weaker as theta grows.

    ``rejects`` maps an array of thetas to booleans. Brackets by doubling from ``start``, then
    ``rounds`` refinements on ``batch`` equally spaced points; within each refinement the
    answer is the last rejected point before the first accepted one (never past a gap).
    Returns 0.0 if nothing is rejected.
    """
    lo, hi = 0.0, float(start)
    while bool(rejects(np.array([hi]))[0]):
        lo, hi = hi, 2.0 * hi
        if hi > cap:
            return lo
    for _ in range(rounds):
        grid = np.linspace(lo, hi, batch + 2)[1:-1]
        rej = rejects(grid)
        first_acc = int(np.argmin(rej)) if not rej.all() else grid.size
        if first_acc > 0:
            lo = float(grid[first_acc - 1])
        hi = float(grid[first_acc]) if first_acc < grid.size else hi
    return lo


def default_k_grid(m: int) -> list[tuple[int, int]]:
    """Guess splits searched by default: symmetric k+ = k- = round(f m / 2), f in
    {0.02, 0.05, 0.1, 0.2, 0.5, 1} (the grid of :func:`audit.bounds.one_run.epsilon_one_run`)."""
    grid: list[tuple[int, int]] = []
    for frac in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        kk = int(round(frac * m / 2))
        if kk >= 1 and (kk, kk) not in grid and 2 * kk <= m:
            grid.append((kk, kk))
    return grid or [(1, 0)]


def _family_name(family) -> str:
    if isinstance(family, str):
        return family
    if isinstance(family, MechanismFamily):
        return "mechanism"
    raise ValueError(f"family must be 'gdp', 'dp' or a MechanismFamily, got {family!r}")


def _as_family(family):
    if isinstance(family, str):
        if family not in ("gdp", "dp"):
            raise ValueError(f"family must be 'gdp', 'dp' or a MechanismFamily, got {family!r}")
        return family
    if isinstance(family, MechanismFamily):
        return family
    if isinstance(family, (list, tuple)):  # a ledger
        return MechanismFamily(tuple(family))
    raise ValueError(f"family must be 'gdp', 'dp', a MechanismFamily or events, got {family!r}")


def _bound_counts(m: int, k: int, c: int, delta: float, alpha: float, family) -> dict:
    """Strongest rejected member of ``family`` for c of k guesses correct, m canaries."""
    if family == "gdp":

        def rejects(mu):
            return fdp_rejects(lambda r: gdp_inverse_blowup(mu, r), m, k, c, alpha)

        mu = _largest_rejected(rejects, 1.0, 200.0, 32, 4) if c else 0.0
        eps = gdp_epsilon(mu, delta) if mu > 0 else 0.0
        return {"mu_lb": mu, "epsilon_lb": eps, "theta_lb": mu}
    if family == "dp":

        def rejects(e):
            return fdp_rejects(lambda r: dp_inverse_blowup(e, delta, r), m, k, c, alpha)

        eps = _largest_rejected(rejects, 1.0, 200.0, 32, 4) if c else 0.0
        return {"mu_lb": None, "epsilon_lb": eps, "theta_lb": eps}
    fam: MechanismFamily = family

    def rejects(thetas):
        return np.array(
            [
                bool(fdp_rejects(fam.curve(float(t)).inverse_blowup, m, k, c, alpha)[0])
                for t in thetas
            ]
        )

    theta = _largest_rejected(rejects, 1.0, 1e3, 1, 9) if c else 0.0
    eps = fam.epsilon(theta, delta) if theta > 0 else 0.0
    return {"mu_lb": None, "epsilon_lb": eps, "theta_lb": theta}


def fdp_one_run_ideal(
    m: int, k: int, c: int, delta: float, alpha: float = 0.05, family="gdp"
) -> dict:
    """The f-DP one-run bound from counts alone: m canaries, k guesses, c of them correct.

    With c = k = m this is the ceiling of the method under perfect separation.

    Returns:
        dict with ``epsilon_lb``, ``mu_lb`` (GDP only, else None), ``theta_lb`` (the family
        parameter: mu, eps, or the noise divisor), ``m``, ``k``, ``correct``, ``alpha``,
        ``delta``, ``family``.
    """
    m, k, c = int(m), int(k), int(c)
    if not (0 <= c <= k <= m) or k < 1:
        raise ValueError(f"need 0 <= c <= k <= m and k >= 1, got m={m}, k={k}, c={c}")
    fam = _as_family(family)
    out = _bound_counts(m, k, c, float(delta), float(alpha), fam)
    out.update(
        {
            "m": m,
            "k": k,
            "correct": c,
            "alpha": float(alpha),
            "delta": float(delta),
            "family": _family_name(fam),
        }
    )
    return out


def _check_inputs(scores, included) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores must be 1-D and non-empty, got shape {s.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    y = np.asarray(included)
    if y.shape != s.shape:
        raise ValueError(f"included must have the shape of scores, got {y.shape} vs {s.shape}")
    if y.dtype != bool:
        if not np.all(np.isin(np.unique(y), [0, 1])):
            raise ValueError("included must be boolean or 0/1")
        y = y.astype(bool)
    return s, y


def _k_grid(k, m: int) -> list[tuple[int, int]]:
    if k is None or (isinstance(k, str) and k == "search"):
        return default_k_grid(m)
    if isinstance(k, (int, np.integer)):
        grid = [(int(k), int(k))]
    elif isinstance(k, tuple) and len(k) == 2 and all(isinstance(v, (int, np.integer)) for v in k):
        grid = [(int(k[0]), int(k[1]))]
    else:
        grid = [(int(a), int(b)) for a, b in k]
    for kp, kn in grid:
        if kp < 0 or kn < 0 or kp + kn < 1 or kp + kn > m:
            raise ValueError(f"need k+, k- >= 0 and 1 <= k+ + k- <= m={m}, got ({kp}, {kn})")
    if not grid:
        raise ValueError("the k grid is empty")
    return grid


def fdp_one_run_bound(
    scores,
    included,
    delta: float,
    alpha: float = 0.05,
    family="gdp",
    k=None,
) -> dict:
    """One-run f-DP lower bound (Mahloujifar, Melis & Chaudhuri 2024) from canary scores.

    The auditor guesses "in" for the k+ highest scores and "out" for the k- lowest (ties broken
    by input order, which is independent of inclusion), c of the k = k+ + k- guesses are
    correct, and the bound is the strongest member of ``family`` that c correct rejects at
    confidence 1 - alpha (see the module docstring).

    Args:
        scores: shape (m,), finite; higher = more likely included.
        included: shape (m,), bool (or 0/1): was each canary in the run (each independently
            with probability 1/2: the theorem's assumption).
        delta: delta in (0, 1) at which eps_lb is reported (for ``"dp"``, the hypotheses').
        alpha: failure probability in (0, 1).
        family: ``"gdp"`` (default), ``"dp"``, a :class:`MechanismFamily`, or a ledger (a list
            of SubsampledGaussian / (sigma, q, steps) / Event), wrapped in a MechanismFamily.
        k: None or "search": the splits of :func:`default_k_grid`, each at alpha / (grid size)
            (union bound); an int k: k+ = k- = k, at alpha; a pair (k+, k-): that split, at
            alpha; a list of pairs: that grid (fixed before seeing the data), union bound.

    Returns:
        dict with ``epsilon_lb`` (nats), ``mu_lb`` (GDP, else None), ``theta_lb`` (the family's
        parameter: mu, eps or the noise divisor), ``k_plus``, ``k_minus``, ``k``, ``correct``,
        ``m``, ``alpha``, ``alpha_per_k``, ``n_k_tried``, ``delta``, ``family`` and
        ``explanation`` (one paragraph, plain words).

    Raises:
        ValueError: for bad scores/labels, delta or alpha outside (0, 1), a bad k or family.
    """
    s, y = _check_inputs(scores, included)
    delta, alpha = float(delta), float(alpha)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    fam = _as_family(family)
    m = int(s.size)
    grid = _k_grid(k, m)
    a_k = alpha / len(grid)

    order = np.argsort(-s, kind="mergesort")
    ys = y[order]
    top = np.concatenate(([0], np.cumsum(ys)))  # included among the top j
    bottom = np.concatenate(([0], np.cumsum(~ys[::-1])))  # excluded among the bottom j

    best = None
    for kp, kn in grid:
        if kp + kn > m:
            continue
        c = int(top[kp] + bottom[kn])
        res = _bound_counts(m, kp + kn, c, delta, a_k, fam)
        if best is None or res["theta_lb"] > best["theta_lb"]:
            best = {**res, "k_plus": kp, "k_minus": kn, "k": kp + kn, "correct": c}
    name = _family_name(fam)
    best.update(
        {
            "m": m,
            "alpha": alpha,
            "alpha_per_k": a_k,
            "n_k_tried": len(grid),
            "delta": delta,
            "family": name,
        }
    )
    best["explanation"] = _explain(best)
    return best


def _explain(b: dict) -> str:
    what = {
        "gdp": f"mu-GDP for mu <= {b['theta_lb']:.4g} is rejected; the eps({b['delta']:g}) of "
        f"{b['theta_lb']:.4g}-GDP is {b['epsilon_lb']:.4g} (a bound on the run's eps only if "
        "its trade-off curve is Gaussian)",
        "dp": f"({b['epsilon_lb']:.4g}, {b['delta']:g})-DP is rejected (no assumption on the "
        "mechanism's shape)",
        "mechanism": f"the ledger's own trade-off curve with every noise multiplier divided by "
        f"{b['theta_lb']:.4g} is rejected; at that noise the ledger's eps({b['delta']:g}) is "
        f"{b['epsilon_lb']:.4g} (a divisor above 1 contradicts the claimed ledger)",
    }[b["family"]]
    split = (
        f"the best of {b['n_k_tried']} guess splits fixed in advance, each at alpha/"
        f"{b['n_k_tried']} (union bound)"
        if b["n_k_tried"] > 1
        else "a split fixed in advance"
    )
    return (
        f"{b['m']} canaries; guessed 'in' for the {b['k_plus']} highest scores and 'out' for "
        f"the {b['k_minus']} lowest ({split}); {b['correct']} of {b['k']} guesses correct. "
        f"At confidence {1 - b['alpha']:g} (Mahloujifar, Melis & Chaudhuri 2024): {what}."
    )
