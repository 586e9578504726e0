"""The one-training-run epsilon lower bound of Steinke, Nasr & Jagielski (2023).

m canaries, each included independently with probability 1/2 before a single training run; the
auditor guesses in/out for the highest/lowest scores and the count of correct guesses is tested
against (eps, delta)-DP (:func:`one_run_p_value`), which :func:`epsilon_one_run` inverts.
Conventions (higher score = more likely member, eps in nats) as in :mod:`audit.bounds.hypothesis`;
delta may be 0 here (pure DP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

from audit.bounds.hypothesis import check_prob, check_scores
from audit.records import Record

__all__ = ["one_run_p_value", "epsilon_one_run", "OneRunBound", "epsilon_from_guesses"]


@dataclass(frozen=True, kw_only=True, eq=False)
class OneRunBound(Record):
    """The result of :func:`epsilon_one_run`: the one-run ε lower bound of Steinke, Nasr &
    Jagielski (2023) at its best guess split (a read-only dict too, see
    :mod:`audit.records`)."""

    #: the bound (nats)
    epsilon_lb: float
    #: guesses made and correct
    r: int
    v: int
    #: "in" for the k_pos highest scores, "out" for the k_neg lowest
    k_pos: int
    k_neg: int
    #: canaries
    m: int
    alpha: float
    delta: float
    #: the level each split was tested at (alpha / n_k_tried)
    alpha_per_k: float
    n_k_tried: int


def _check_delta_one_run(value: float) -> float:
    """delta of the one-run audit: [0, 1); 0 is the theorem's pure-DP case."""
    v = float(value)
    if not (0.0 <= v < 1.0) or math.isnan(v):
        raise ValueError(f"delta must be in [0, 1), got {value}")
    return v


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """p-value of >= v correct guesses out of r under (eps, delta)-DP, m canaries.

    Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run", Thm 3.1 /
    their reference code: with q = e^eps / (1 + e^eps) and B ~ Binomial(r, q),

        p = P[B >= v] + 2 m delta * max_{i = 1..v} P[v - i <= B < v] / i,

    capped at 1. For delta = 0 this is exactly the Binomial(r, q) upper tail (the guesses are
    stochastically dominated by randomized response); the second term is the paper's delta
    correction, which charges 2*m*delta spread over the cheapest way of "buying" i extra
    correct guesses.

    Args:
        m: number of canaries (each included independently with probability 1/2).
        r: number of guesses made (abstentions excluded), 0 <= r <= m.
        v: number of correct guesses, 0 <= v <= r.
        eps: epsilon (nats, >= 0) of the null hypothesis.
        delta: delta in [0, 1] of the null hypothesis.

    Returns:
        p-value in [0, 1].
    """
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    q = special.expit(eps)  # accuracy of eps-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # P[B >= v]
    corr = 0.0
    if delta > 0 and v > 0:
        # cumsum over i of pmf(v - i) is P[v - i <= B < v]; divide by i, take the max.
        pm = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
        corr = float(np.max(np.cumsum(pm) / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * corr, 1.0)


def epsilon_from_guesses(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """The bound of one guess split: the largest eps with p-value < alpha, i.e.
    sup{eps : P_eps[>= v correct] < alpha} (>= 0), for m canaries, r guesses, v correct.

    The p-value is continuous and non-decreasing in eps, so bracket then root-find.
    """
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    hi = 1.0
    while one_run_p_value(m, r, v, hi, delta) < alpha:
        hi *= 2.0
        if hi > 1e4:  # p never reaches alpha (cannot happen for v <= r); guard anyway
            return float("inf")
    return float(
        optimize.brentq(lambda e: one_run_p_value(m, r, v, e, delta) - alpha, 0.0, hi, xtol=1e-10)
    )


def _default_k_grid(m: int) -> list[tuple[int, int]]:
    """Symmetric (k_pos = k_neg) guess counts covering 2%..100% of the canaries."""
    grid = []
    for frac in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0):
        k = int(round(frac * m / 2))
        if k >= 1 and (k, k) not in grid and 2 * k <= m:
            grid.append((k, k))
    return grid or [(1, 0)]


def epsilon_one_run(
    scores,
    is_member,
    delta: float,
    alpha: float = 0.05,
    k_pos: int | None = None,
    k_neg: int | None = None,
) -> OneRunBound:
    """One-run epsilon lower bound (Steinke, Nasr & Jagielski 2023, Algorithm 1 + Thm 3.1).

    Setting: m canaries, each inserted independently with probability 1/2 before the single
    training run. The auditor guesses "in" for the k_pos highest scores and "out" for the k_neg
    lowest (abstaining on the rest); r = k_pos + k_neg guesses, v of them correct. The bound is
    the largest eps such that P[>= v correct | (eps, delta)-DP] (see :func:`one_run_p_value`,
    the paper's bound including its 2*m*delta correction term) is still < alpha.

    k selection: if k_pos and/or k_neg are given (a missing one defaults to 0), that single
    choice is used at level alpha. If both are None, a small grid of symmetric choices
    k_pos = k_neg = round(f*m/2), f in {0.02, 0.05, 0.1, 0.2, 0.5, 1} is searched and each is
    evaluated at alpha / (grid size) (union bound), so the max stays a valid 1 - alpha bound.
    Ties in scores are broken by input order, which is independent of membership.

    Args:
        scores: shape (m,), finite scores; higher = more likely member.
        is_member: shape (m,), bool ground truth inclusion of each canary.
        delta: delta in [0, 1) of the hypothesis being tested; 0 tests pure eps-DP (the
            p-value is then the plain Binomial tail).
        alpha: failure probability in (0, 1).
        k_pos, k_neg: numbers of positive / negative guesses, k_pos + k_neg <= m.

    Returns:
        a :class:`OneRunBound` (a read-only dict too) with ``epsilon_lb`` (nats), ``r``,
        ``v``, ``k_pos``, ``k_neg``, ``m``, ``alpha``, ``delta``, ``alpha_per_k`` and
        ``n_k_tried``.

    Raises:
        ValueError: naming the problem, for bad scores/labels, delta outside [0, 1), alpha
            outside (0, 1), negative k or k_pos + k_neg > m.
    """
    s = check_scores("scores", scores)
    y = np.asarray(is_member)
    if y.ndim != 1 or y.shape[0] != s.shape[0]:
        raise ValueError(
            f"is_member must be 1-D with the same length as scores, got {y.shape} vs {s.shape}"
        )
    if y.dtype != bool:
        if not np.all(np.isin(np.unique(y), [0, 1])):
            raise ValueError("is_member must be boolean or 0/1")
        y = y.astype(bool)
    delta = _check_delta_one_run(delta)
    alpha = check_prob("alpha", alpha)
    m = int(s.size)

    if k_pos is None and k_neg is None:
        grid = _default_k_grid(m)
    else:
        kp, kn = int(k_pos or 0), int(k_neg or 0)
        if kp < 0 or kn < 0:
            raise ValueError(f"k_pos and k_neg must be >= 0, got {kp}, {kn}")
        if kp + kn > m:
            raise ValueError(f"k_pos + k_neg must be <= m={m}, got {kp} + {kn}")
        grid = [(kp, kn)]
    a_k = alpha / len(grid)

    order = np.argsort(-s, kind="mergesort")  # descending, ties by input order
    y_sorted = y[order]
    correct_top = np.concatenate(([0], np.cumsum(y_sorted)))  # members among top k
    correct_bot = np.concatenate(([0], np.cumsum(~y_sorted[::-1])))  # non-members among bottom k

    best = None
    for kp, kn in grid:
        r = kp + kn
        v = int(correct_top[kp] + correct_bot[kn])
        eps = epsilon_from_guesses(m, r, v, delta, a_k)
        if best is None or eps > best["epsilon_lb"]:
            best = {"epsilon_lb": eps, "r": r, "v": v, "k_pos": kp, "k_neg": kn}
    best.update(
        {"m": m, "alpha": alpha, "delta": delta, "alpha_per_k": a_k, "n_k_tried": len(grid)}
    )
    return OneRunBound(**best)
