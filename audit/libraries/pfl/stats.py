"""The statistics the pfl audit (:mod:`audit.libraries.pfl`) needs beyond :mod:`audit.bounds`.

pfl's samplers do not draw Poisson cohorts (``get_user_sampler('random')`` draws a fixed
count of users WITH replacement, ``'minimize_reuse'`` cycles through the users in a fixed
order), so the conformance family's clipping test, which needs fresh Bernoulli(q) coins, does
not apply; pfl's Laplace mechanism is not Gaussian, so neither do the scale and freshness
tests. What replaces them, each valid for the sampler that ran because the auditor reads the
sampler's decisions (the count k of times each canary user entered each round) and the
canary block is isolated (no real user's update touches it):

**The contribution test** (:func:`contribution_test`, both mechanisms). In units of the
claimed clip C, canary j's coordinate of the noised sum at round t is
``u = a·k + Z`` (a = 1 when pfl clipped each canary update to C and summed it once per
draw; Z the round's fresh noise, independent of the counts). The residuals r = u − k have
slope a − 1 on k. Regression through the origin: with ``S = Σ k·r``, ``K = Σ k²`` and
``R = Σ r²`` over every (round, canary) entry (the excluded canaries' entries, k = 0, add
only to R), ``t = (S/√K) / √((R − S²/K)/(N − 1))`` is exactly Student's t with N − 1
degrees of freedom when Z is Gaussian of ANY scale (S/√K ~ N(0, s²) and the orthogonal
rest ~ s²χ²_{N−1}, independent), so the test holds whether the noise is right or not; for
Laplace noise it holds asymptotically (N is hundreds here). One-sided: a > 1 (a canary
user added more than C: weighting after the clipping, a clip above the claim, a user drawn
twice counted once) makes t large. The estimate â = 1 + S/K is reported with its interval.

**The Laplace scale and freshness tests** (:func:`laplace_tests`). For Z symmetric and
unimodal and W independent of Z, ``|Z + W| ≥_st |Z|`` (Anderson's inequality in one
dimension: P(|Z + w| ≤ c) ≤ P(|Z| ≤ c) for every w). With the residual e = r − m, m a
predictor from earlier rounds only (m = 0: scale; m = the previous round's residual:
freshness, which a reused draw cancels), each |e|/b given the past stochastically dominates
Exp(1) when the noise is Laplace(b) fresh at every round, and the rounds' and coordinates'
noises are independent, so ``Σ|e|/b ≥_st Gamma(N, 1)`` (sequential coupling, as for the
Gaussian family's χ² tests): p = P(Gamma(N, 1) ≤ Σ|e|/b), one-sided, valid for any data
term independent of the fresh noise. The observed/claimed scale ratio is Σ|e|/(N·b) with
the Gamma interval; its upper end bounds the scale of a Laplace noise (the implied ε).

:func:`laplace_epsilon` recomputes ε(δ) of T compositions of the Laplace mechanism with
dp-accounting's PLD (the toolkit's claim check, :func:`audit.claims.check.check_claim`, is
Gaussian only).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from audit.bounds.conformance import MIN_LOG10_P, GroupTest

__all__ = ["contribution_test", "laplace_epsilon", "laplace_tests"]


def _log10(p: float) -> float:
    return max(MIN_LOG10_P, math.log10(p) if p > 0 else MIN_LOG10_P)


def sign_flip_p(k: np.ndarray, r: np.ndarray, flips: int = 19_999, seed=None) -> float:
    """The exact one-sided p of S = Σ k·r under "the noise r is symmetric and independent of
    the draws k" (Laplace or Gaussian): S against its distribution when each entry's sign is
    flipped at random, (1 + #{S* ≥ S})/(1 + flips). Only the drawn entries (k > 0) count."""
    sel = k > 0
    kr = (k[sel] * r[sel]).astype(np.float64)
    S = float(kr.sum())
    a = np.abs(kr)
    rng = np.random.default_rng(seed)
    hits, chunk = 0, max(1, int(2e7 // max(1, a.size)))
    for s0 in range(0, flips, chunk):
        n = min(chunk, flips - s0)
        signs = rng.integers(0, 2, size=(n, a.size), dtype=np.int8) * 2 - 1
        hits += int(np.sum(signs @ a >= S - 1e-12 * max(1.0, abs(S))))
    return (1 + hits) / (1 + flips)


def contribution_test(
    u: np.ndarray, counts: np.ndarray, alpha: float = 0.05, symmetric_exact: bool = False
) -> tuple:
    """(GroupTest, estimate): the one-sided t-test of "each draw of a canary user adds at
    most C" (module doc). ``u``: (T, M) observations in units of C; ``counts``: (T, M) how
    many times each canary user was in each round's cohort (0 for the excluded ones).
    ``estimate``: {"contribution": â, "ci": [lo, hi] at 1 − α, "draws": Σk}; None when no
    canary was drawn (then the GroupTest is None too)."""
    u = np.asarray(u, dtype=np.float64)
    k = np.asarray(counts, dtype=np.float64)
    if u.shape != k.shape or u.ndim != 2:
        raise ValueError(f"observations {u.shape} and counts {k.shape} must be (T, M) alike")
    K = float(np.sum(k * k))
    n = u.size
    if K == 0 or n < 3:
        return None, None
    r = u - k
    S = float(np.sum(k * r))
    R = float(np.sum(r * r))
    rest = max(R - S * S / K, 1e-300)
    s = math.sqrt(rest / (n - 1))
    t = (S / math.sqrt(K)) / s
    p = float(stats.t.sf(t, n - 1))
    if symmetric_exact:
        # Laplace noise with few draws: the t-test's tails are too light (a sum of a few
        # Laplace terms); the sign-flip test is exact for any symmetric noise
        p = sign_flip_p(k, r)
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * s / math.sqrt(K)
    a = 1.0 + S / K
    test = GroupTest(
        group="canary",
        test="contribution",
        terms=int(n),
        statistic=t,
        log10_p=_log10(p),
        note=f"t-test of a canary draw's contribution (â = {a:.4g} C) against C",
    )
    return test, {"contribution": a, "ci": [a - half, a + half], "draws": float(np.sum(k))}


def _gamma_test(total: float, n: int, alpha: float, alpha_upper: float, test: str, note: str):
    ratio = total / n
    lo = total / float(stats.gamma.ppf(1 - alpha / 2, n))
    hi = total / float(stats.gamma.ppf(alpha / 2, n))
    up = total / float(stats.gamma.ppf(alpha_upper, n))
    return GroupTest(
        group="laplace",
        test=test,
        terms=int(n),
        statistic=total,
        log10_p=max(MIN_LOG10_P, float(stats.gamma.logcdf(total, n)) / math.log(10)),
        ratio=ratio,
        ratio_ci=(lo, hi),
        ratio_upper=up,
        note=note,
    )


def laplace_tests(r: np.ndarray, scale: float, alpha: float = 0.05) -> list[GroupTest]:
    """The Laplace scale and freshness tests (module doc) on residuals ``r`` (T, M) in
    units of C (the observations less the canaries' claimed contributions), against the
    claimed scale ``scale`` = b / C. Ratios are observed/claimed b; upper bounds at α/2."""
    r = np.asarray(r, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] < 2:
        raise ValueError(f"residuals must be (rounds >= 2, canaries), got {r.shape}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"the claimed Laplace scale must be positive, got {scale}")
    if not np.isfinite(r).all():
        raise ValueError("the residuals hold NaN or Inf")
    s_scale = float(np.sum(np.abs(r))) / scale
    d = r[1:] - r[:-1]
    s_fresh = float(np.sum(np.abs(d))) / scale
    return [
        _gamma_test(
            s_scale, r.size, alpha, alpha / 2, "scale", "Σ|e|/b against Gamma(N, 1) (Anderson)"
        ),
        _gamma_test(
            s_fresh,
            d.size,
            alpha,
            alpha / 2,
            "fresh",
            "Σ|e_t − e_{t−1}|/b against Gamma(N, 1); under the claim the ratio is about 1.5",
        ),
    ]


def laplace_epsilon(scale: float, rounds: int, delta: float, sens: int = 1, q: float = 1.0):
    """ε(δ) of ``rounds`` compositions of the Laplace mechanism of scale ``scale`` (b / C)
    and ℓ1 sensitivity ``sens`` × C, Poisson-subsampled at ``q`` when q < 1 (dp-accounting's
    PLD, pessimistic, add/remove). ∞ when the scale is 0."""
    if scale <= 0:
        return math.inf
    from dp_accounting.pld import privacy_loss_distribution as pld

    one = pld.from_laplace_mechanism(
        parameter=scale,
        sensitivity=sens,
        pessimistic_estimate=True,
        sampling_prob=q,
        value_discretization_interval=1e-4,
    )
    return float(one.self_compose(int(rounds)).get_epsilon_for_delta(delta))
