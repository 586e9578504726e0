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
the observation rejects (the curves are in :mod:`audit.bounds.tradeoff`):

* ``"gdp"``: mu-GDP, f(x) = Phi(Phi^-1(1 - x) - mu); reports ``mu_lb`` and
  eps_lb = eps(delta) of mu_lb-GDP (exact formula). "Not mu_lb-GDP" holds for any mechanism;
  reading it as "eps(delta) >= eps_lb" assumes the mechanism's trade-off curve is Gaussian.
* ``"dp"``: the (eps, delta)-DP curves at the given delta; eps_lb holds for any mechanism.
* a :class:`audit.bounds.tradeoff.MechanismFamily` (the ledger's Poisson-subsampled Gaussians, with every noise
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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from audit.bounds.hypothesis import gdp_epsilon
from audit.bounds.tradeoff import MechanismFamily, dp_inverse_blowup, gdp_inverse_blowup
from audit.records import Record

__all__ = [
    "min_total_mass",
    "fdp_rejects",
    "fdp_one_run_ideal",
    "fdp_one_run_bound",
    "FdpBound",
    "default_k_grid",
]

# A hypothesis is rejected only if the least total probability exceeds 1 by this much: covers
# the floating-point error of the recursion (a few ulps per step) with a wide margin.
_REJECT_MARGIN = 1e-9


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


@dataclass(frozen=True, kw_only=True, eq=False)
class FdpBound(Record):
    """The result of :func:`fdp_one_run_bound`: the strongest member of a family of
    trade-off curves that the canaries' guesses reject (a read-only dict too, see
    :mod:`audit.records`)."""

    #: μ of μ-GDP (family ``"gdp"``; None otherwise)
    mu_lb: float | None
    #: ε(δ) of the rejected curve (nats)
    epsilon_lb: float
    #: the family's parameter: μ, ε or the noise divisor
    theta_lb: float
    #: the guesses: "in" for the k+ highest scores, "out" for the k- lowest, k in all
    k_plus: int
    k_minus: int
    k: int
    #: correct guesses
    correct: int
    #: canaries
    m: int
    alpha: float
    #: the level each split was tested at (alpha / n_k_tried)
    alpha_per_k: float
    n_k_tried: int
    delta: float
    #: ``"gdp"``, ``"dp"`` or ``"mechanism"``
    family: str
    #: one paragraph, plain words
    explanation: str


def fdp_one_run_bound(
    scores,
    included,
    delta: float,
    alpha: float = 0.05,
    family="gdp",
    k=None,
) -> FdpBound:
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
        an :class:`FdpBound` (a read-only dict too) with ``epsilon_lb`` (nats), ``mu_lb``
        (GDP, else None), ``theta_lb`` (the family's parameter: mu, eps or the noise
        divisor), ``k_plus``, ``k_minus``, ``k``, ``correct``, ``m``, ``alpha``,
        ``alpha_per_k``, ``n_k_tried``, ``delta``, ``family`` and ``explanation`` (one
        paragraph, plain words).

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
    return FdpBound(**best)


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
