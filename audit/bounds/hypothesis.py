"""Empirical lower bounds on the privacy parameter epsilon from membership-inference scores.

Convention: a *higher* score means "more likely a member" (the canary was IN the training set).
All score arrays are 1-D floats; epsilon is in nats (natural log); delta and alpha are
probabilities in (0, 1). Every bound returned holds with probability >= 1 - alpha over the
randomness of the audit (the sampling of scores / canary inclusion), under the stated model.

:func:`epsilon_lower_bound` is the many-run (or many-canary) hypothesis-testing audit from
samples of IN and OUT scores: Clopper-Pearson bounds on FPR/FNR of threshold tests at the
vertices of the empirical ROC's concave hull, turned into an (eps, delta) bound directly or via
the tightest Gaussian-DP curve (Nasr et al. 2023). The one-training-run audit of Steinke, Nasr &
Jagielski (2023) is :func:`audit.bounds.one_run.epsilon_one_run`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from scipy import optimize, special, stats

from audit.records import Record

__all__ = [
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "epsilon_lower_bound",
    "ThresholdBound",
    "check_prob",
    "check_scores",
    "error_counts",
    "eps_from_rates",
    "gdp_mu_from_rates",
    "roc_hull_thresholds",
]


@dataclass(frozen=True, kw_only=True, eq=False)
class ThresholdBound(Record):
    """The result of :func:`epsilon_lower_bound`: an ε lower bound from one threshold
    membership test, with the test's rates and sample sizes (a read-only dict too, see
    :mod:`audit.records`)."""

    optional_keys: ClassVar[frozenset[str]] = frozenset({"mu_lb"})

    #: ``"clopper_pearson"`` or ``"gdp"``
    method: str
    #: ``"split"`` or ``"bonferroni"``
    threshold_selection: str
    #: ``"hull"`` or ``"quantiles"``
    candidates: str
    alpha: float
    delta: float
    #: the chosen t of the test "member iff score >= t"
    threshold: float
    #: Clopper–Pearson upper bounds on the rates at t, on the evaluation data
    fpr_ub: float
    fnr_ub: float
    #: the empirical rates at t
    fpr_hat: float
    fnr_hat: float
    #: the inputs' sizes
    n_in: int
    n_out: int
    #: the samples the bound was computed on
    n_in_eval: int
    n_out_eval: int
    #: K, the thresholds the bound is made simultaneous over (1 for a split)
    n_candidates: int
    #: each rate bound's failure probability
    alpha_fpr_bound: float
    alpha_fnr_bound: float
    #: the smallest consistent μ of μ-GDP (``method="gdp"`` only; not in the dict otherwise)
    mu_lb: float | None = None
    #: the bound (nats)
    epsilon_lb: float


# --------------------------------------------------------------------------- validation helpers


def check_prob(name: str, value: float) -> float:
    """``value`` as a float in the open interval (0, 1), else ValueError naming ``name``."""
    v = float(value)
    if not (0.0 < v < 1.0) or math.isnan(v):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value}")
    return v


def check_scores(name: str, x) -> np.ndarray:
    """``x`` as a finite, non-empty 1-D float64 array, else ValueError naming ``name``."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    if n_nan or n_inf:
        raise ValueError(f"{name} must be finite: found {n_nan} NaN and {n_inf} Inf values")
    return a


# --------------------------------------------------------------------------- Clopper-Pearson


def clopper_pearson_upper(k, n, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper confidence bound for a binomial proportion.

    Args:
        k: successes, int or array of ints with 0 <= k <= n.
        n: trials (> 0), int or broadcastable array.
        alpha: one-sided error; P(p > bound) <= alpha for every true p.

    Returns:
        Upper bound(s) in [0, 1], same shape as broadcast(k, n); 1 where k == n.
    """
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ub = stats.beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, ub)


# --------------------------------------------------------------------------- Gaussian DP


def gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP (Dong, Roth & Su 2019, Cor. 2.13).

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps * Phi(-eps/mu - mu/2), evaluated in log space for
    the second term so large eps does not overflow.

    Args:
        mu: GDP parameter (>= 0).
        eps: epsilon in nats (>= 0).

    Returns:
        delta in [0, 1].
    """
    mu, eps = float(mu), float(eps)
    if mu < 0 or eps < 0 or math.isnan(mu) or math.isnan(eps):
        raise ValueError(f"mu and eps must be >= 0, got mu={mu}, eps={eps}")
    if mu == 0.0:
        return 0.0
    if math.isinf(eps) or math.isinf(mu):
        return 0.0 if math.isinf(eps) else 1.0
    a = stats.norm.cdf(-eps / mu + mu / 2)
    # e^eps·Φ(−eps/mu − mu/2) <= Φ(−eps/mu + mu/2) <= 1, so its log is <= 0 up to rounding:
    # clamped before exp (a huge mu or eps once overflowed here)
    log_b = eps + float(stats.norm.logcdf(-eps / mu - mu / 2))
    b = math.exp(min(log_b, 0.0)) if math.isfinite(log_b) else 0.0
    return float(min(max(a - b, 0.0), 1.0))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest eps such that mu-GDP implies (eps, delta)-DP (inverse of :func:`gdp_delta`).

    delta(eps) is strictly decreasing in eps, so the root is bracketed by doubling an upper
    end and refined with a bracketing solver (Brent's method = safeguarded bisection).

    Args:
        mu: GDP parameter (>= 0).
        delta: target delta in (0, 1).

    Returns:
        eps in nats (0.0 if delta(0) <= delta already).
    """
    delta = check_prob("delta", delta)
    mu = float(mu)
    if mu < 0 or math.isnan(mu):
        raise ValueError(f"mu must be >= 0, got {mu}")
    if mu == 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = max(1.0, mu)
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    return float(
        optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12)
    )


def gdp_mu_from_rates(fpr_ub: np.ndarray, fnr_ub: np.ndarray) -> np.ndarray:
    """Smallest mu whose trade-off curve passes through/below the point (fpr_ub, fnr_ub).

    mu-GDP requires FNR >= f_mu(FPR) = Phi(Phi^-1(1 - FPR) - mu) for every test. f_mu is
    decreasing in both FPR and mu, so from FPR <= fpr_ub and FNR <= fnr_ub we get
    f_mu(fpr_ub) <= fnr_ub, i.e. mu >= Phi^-1(1 - fpr_ub) + Phi^-1(1 - fnr_ub) (closed form; the
    curve is symmetric so the other tail gives the same value). Clipped at 0.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = special.ndtri(1.0 - fpr_ub) + special.ndtri(1.0 - fnr_ub)
    return np.nan_to_num(np.maximum(mu, 0.0), nan=0.0, posinf=0.0)


# --------------------------------------------------------------------------- threshold audit


def error_counts(in_sorted: np.ndarray, out_sorted: np.ndarray, thr: np.ndarray):
    """False-positive and false-negative counts of the test "member iff score >= thr"."""
    fp = out_sorted.size - np.searchsorted(out_sorted, thr, side="left")  # out >= t
    fn = np.searchsorted(in_sorted, thr, side="left")  # in < t
    return fp, fn


def eps_from_rates(fpr_ub: np.ndarray, fnr_ub: np.ndarray, delta: float) -> np.ndarray:
    """(eps, delta)-DP implies FPR + e^eps FNR >= 1 - delta and FNR + e^eps FPR >= 1 - delta.

    Both left-hand sides grow with FPR and FNR, so plugging in upper bounds stays valid.
    Returns max(0, both tails), shape of broadcast input.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log((1.0 - delta - fnr_ub) / fpr_ub)
        e2 = np.log((1.0 - delta - fpr_ub) / fnr_ub)
    e = np.fmax(np.nan_to_num(e1, nan=0.0, posinf=0.0), np.nan_to_num(e2, nan=0.0, posinf=0.0))
    return np.maximum(e, 0.0)


def roc_hull_thresholds(in_sorted: np.ndarray, out_sorted: np.ndarray) -> np.ndarray:
    """Thresholds at the vertices of the empirical ROC's upper concave hull, both ends excluded.

    ROC points are (FP(t), TP(t)) counts of "member iff score >= t" over every distinct score t
    (plus +inf). Both inequalities of :func:`eps_from_rates` and the GDP mu of
    :func:`gdp_mu_from_rates` are maximised over a set of (FPR, TPR) points at a vertex of its
    upper hull: a point under a hull chord is dominated by one of the chord's ends, because the
    region where each criterion is <= c is convex (a half-plane through a fixed point for
    eps; the region under a concave Gaussian trade-off curve for mu). The two ends, (0, 0) at
    t = +inf and (n_out, n_in) at the lowest score, certify nothing (TPR = 0 or FPR = 1 there),
    so they are not candidates and cost no share of alpha.

    Returns:
        ascending thresholds, shape (K,) with K >= 0; each is the lowest score with its FP count.
    """
    thr = np.append(np.unique(np.concatenate((in_sorted, out_sorted))), np.inf)
    fp, fn = error_counts(in_sorted, out_sorted, thr)
    # Walk from t = +inf down: FP and TP both grow. Among equal FP keep the largest TP (the
    # lowest t), the only one of them that can be a vertex.
    fp, tp, thr = fp[::-1], (in_sorted.size - fn)[::-1], thr[::-1]
    last = np.append(fp[1:] != fp[:-1], True)
    x, y, thr = fp[last].tolist(), tp[last].tolist(), thr[last]
    hull: list[int] = []  # indices of the upper hull, left to right (Andrew's monotone chain)
    for i in range(len(x)):
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            # pop a unless o -> a -> i turns clockwise (a strictly above the chord o -> i)
            if (x[a] - x[o]) * (y[i] - y[o]) - (y[a] - y[o]) * (x[i] - x[o]) < 0:
                break
            hull.pop()
        hull.append(i)
    inner = [i for i in hull if x[i] != 0 or y[i] != 0]
    inner = [i for i in inner if not (x[i] == out_sorted.size and y[i] == in_sorted.size)]
    return np.sort(thr[inner])


def _threshold_grid(pooled: np.ndarray, n_thresholds: int) -> np.ndarray:
    """Candidate thresholds: pooled-score order statistics at a bounded set of quantile levels.

    Half the levels are linear, the rest log-spaced into each tail, because tight epsilon bounds
    come from extreme thresholds (tiny FPR or FNR). Returns <= n_thresholds unique values.
    The ``candidates="quantiles"`` alternative to the ROC hull.
    """
    s = np.sort(pooled)
    n = s.size
    n_lin = max(n_thresholds // 2, 2)
    n_tail = max((n_thresholds - n_lin) // 2, 1)
    tail = np.geomspace(1.0 / n, 0.5, n_tail)
    levels = np.concatenate((np.linspace(0.0, 1.0, n_lin), tail, 1.0 - tail))
    idx = np.clip(np.round(levels * (n - 1)).astype(np.intp), 0, n - 1)
    return np.unique(s[idx])


def _candidates(in_sorted, out_sorted, candidates: str, n_thresholds: int) -> np.ndarray:
    """The thresholds a bound is computed at (never empty: a lone +inf certifies nothing)."""
    if candidates == "hull":
        cand = roc_hull_thresholds(in_sorted, out_sorted)
    else:
        cand = _threshold_grid(np.concatenate((in_sorted, out_sorted)), n_thresholds)
    return cand if cand.size else np.array([np.inf])


def _bound_at(in_sorted, out_sorted, thr, delta, a_rates, method):
    """Per-threshold bound: returns (value to maximise, eps, fpr_ub, fnr_ub, mu).
    ``a_rates``: the failure probability of each FPR and each FNR upper bound."""
    a_fpr, a_fnr = a_rates
    fp, fn = error_counts(in_sorted, out_sorted, thr)
    fpr_ub = clopper_pearson_upper(fp, out_sorted.size, a_fpr)
    fnr_ub = clopper_pearson_upper(fn, in_sorted.size, a_fnr)
    if method == "gdp":
        mu = gdp_mu_from_rates(fpr_ub, fnr_ub)
        return mu, None, fpr_ub, fnr_ub, mu
    eps = eps_from_rates(fpr_ub, fnr_ub, delta)
    return eps, eps, fpr_ub, fnr_ub, None


def epsilon_lower_bound(
    in_scores,
    out_scores,
    delta: float,
    alpha: float = 0.05,
    method: str = "clopper_pearson",
    threshold_selection: str = "split",
    seed: int = 0,
    n_thresholds: int = 100,
    candidates: str = "hull",
) -> ThresholdBound:
    """Empirical epsilon lower bound from a threshold membership test.

    The test says "member" iff score >= t. For a DP mechanism, FPR(t) = P(out >= t) and
    FNR(t) = P(in < t) must satisfy FPR + e^eps FNR >= 1 - delta and FNR + e^eps FPR >= 1 - delta.
    One-sided Clopper-Pearson upper bounds FPR_hi, FNR_hi (each at level alpha/2, or
    simultaneous over all thresholds with Bonferroni, below) then give, with probability
    >= 1 - alpha,

        eps >= max(ln((1 - delta - FNR_hi) / FPR_hi), ln((1 - delta - FPR_hi) / FNR_hi), 0).

    ``method="gdp"`` instead converts (FPR_hi, FNR_hi) to the smallest consistent mu of mu-GDP,
    mu_lb = Phi^-1(1 - FPR_hi) + Phi^-1(1 - FNR_hi), and reports eps_lb = gdp_epsilon(mu_lb, delta)
    (Nasr et al. 2023, "Tight auditing of DP-SGD"). This is a valid bound on eps(delta) *if the
    mechanism's privacy profile is Gaussian* (e.g. the Gaussian mechanism / DP-SGD in the
    final-model threat model is well approximated by it); for arbitrary mechanisms it is a
    heuristic, while ``clopper_pearson`` assumes nothing about the mechanism. Both assume
    that the scores are independent trials: each from its own run of the mechanism on one
    fixed neighbouring pair (the in/out runs of a multi-run audit). One model's scores of
    its members and non-members are not; for one run use
    :func:`audit.bounds.one_run.epsilon_one_run`.

    Candidate thresholds (``candidates``): ``"hull"`` (default) takes the vertices of the
    empirical ROC's upper concave hull (without its two ends), which contain the maximiser of
    both inequalities and of mu (see :func:`roc_hull_thresholds`); ``"quantiles"`` takes
    <= n_thresholds pooled-score quantiles, dense in both tails.

    Threshold choice is data-dependent, so it is corrected:
      * ``"split"``: the in/out samples are each randomly halved; t maximises the bound over
        the candidates of the first half, and the bound is evaluated on the second
        (independent) half at alpha/2 per rate bound.
      * ``"bonferroni"``: the candidates are evaluated on the full data with the rate bounds
        made simultaneous over every threshold: a threshold with j false positives has
        FPR ≤ P(out > (j+1)-th largest out-score), a Beta(j+1, n_out − j) variable whose
        1 − a quantile is exactly the Clopper–Pearson bound at count j, so a union over the
        n_out + 1 possible counts (a = alpha/(2(n_out + 1))), and likewise for FNR
        (alpha/(2(n_in + 1))), holds for any threshold, however the data chose it. (A union
        over only the K candidates tried, alpha/(2K), is not valid: the candidates are
        chosen from the same data.)

    Args:
        in_scores: shape (n_in,), scores of canaries that were in the training set.
        out_scores: shape (n_out,), scores of canaries that were not.
        delta: target delta in (0, 1).
        alpha: the bound fails with probability <= alpha; in (0, 1).
        method: "clopper_pearson" or "gdp".
        threshold_selection: "split" or "bonferroni".
        seed: seed of the Generator used by "split".
        n_thresholds: size of the quantile grid (>= 1), used by ``candidates="quantiles"``.
        candidates: "hull" or "quantiles".

    Returns:
        a :class:`ThresholdBound` (a read-only dict too) with ``epsilon_lb`` (nats),
        ``method``, ``threshold_selection``, ``candidates``, ``alpha``, ``delta``,
        ``threshold`` (chosen t), ``fpr_ub``, ``fnr_ub`` (Clopper-Pearson upper bounds at t on
        the evaluation data), ``fpr_hat``, ``fnr_hat`` (empirical rates there), ``n_in``,
        ``n_out`` (inputs), ``n_in_eval``, ``n_out_eval`` (samples the bound was computed on),
        ``n_candidates`` (K), ``alpha_fpr_bound``, ``alpha_fnr_bound`` (each rate bound's
        failure probability), and for gdp ``mu_lb``.

    Raises:
        ValueError: naming the problem, for NaN/Inf/empty/non-1-D scores, delta or alpha outside
            (0, 1), unknown method/threshold_selection/candidates, split with fewer than 2
            scores per class.
    """
    x_in = check_scores("in_scores", in_scores)
    x_out = check_scores("out_scores", out_scores)
    delta = check_prob("delta", delta)
    alpha = check_prob("alpha", alpha)
    if method not in ("clopper_pearson", "gdp"):
        raise ValueError(f"method must be 'clopper_pearson' or 'gdp', got {method!r}")
    if threshold_selection not in ("split", "bonferroni"):
        raise ValueError(
            f"threshold_selection must be 'split' or 'bonferroni', got {threshold_selection!r}"
        )
    if candidates not in ("hull", "quantiles"):
        raise ValueError(f"candidates must be 'hull' or 'quantiles', got {candidates!r}")
    if int(n_thresholds) < 1:
        raise ValueError(f"n_thresholds must be >= 1, got {n_thresholds}")

    if threshold_selection == "split":
        if x_in.size < 2 or x_out.size < 2:
            raise ValueError(
                "split threshold selection needs at least 2 in_scores and 2 out_scores"
            )
        rng = np.random.default_rng(seed)
        p_in, p_out = rng.permutation(x_in), rng.permutation(x_out)
        sel_in, ev_in = np.sort(p_in[: x_in.size // 2]), np.sort(p_in[x_in.size // 2 :])
        sel_out, ev_out = np.sort(p_out[: x_out.size // 2]), np.sort(p_out[x_out.size // 2 :])
        cand = _candidates(sel_in, sel_out, candidates, int(n_thresholds))
        # Selection half: any rule is valid since evaluation data is independent; use the
        # same bound so the chosen t is the one most likely to certify on fresh data.
        crit, *_ = _bound_at(sel_in, sel_out, cand, delta, (alpha / 2, alpha / 2), method)
        cand = cand[[int(np.argmax(crit))]]
        a_rates = (alpha / 2, alpha / 2)
    else:
        ev_in, ev_out = np.sort(x_in), np.sort(x_out)
        cand = _candidates(ev_in, ev_out, candidates, int(n_thresholds))
        a_rates = (alpha / (2 * (ev_out.size + 1)), alpha / (2 * (ev_in.size + 1)))

    crit, eps, fpr_ub, fnr_ub, mu = _bound_at(ev_in, ev_out, cand, delta, a_rates, method)
    j = int(np.argmax(crit))
    fp, fn = error_counts(ev_in, ev_out, cand[j : j + 1])
    out = {
        "method": method,
        "threshold_selection": threshold_selection,
        "candidates": candidates,
        "alpha": alpha,
        "delta": delta,
        "threshold": float(cand[j]),
        "fpr_ub": float(fpr_ub[j]),
        "fnr_ub": float(fnr_ub[j]),
        "fpr_hat": float(fp[0] / ev_out.size),
        "fnr_hat": float(fn[0] / ev_in.size),
        "n_in": int(x_in.size),
        "n_out": int(x_out.size),
        "n_in_eval": int(ev_in.size),
        "n_out_eval": int(ev_out.size),
        "n_candidates": int(cand.size) if threshold_selection == "bonferroni" else 1,
        "alpha_fpr_bound": float(a_rates[0]),
        "alpha_fnr_bound": float(a_rates[1]),
    }
    if method == "gdp":
        out["mu_lb"] = float(mu[j])
        out["epsilon_lb"] = gdp_epsilon(float(mu[j]), delta) if mu[j] > 0 else 0.0
    else:
        out["epsilon_lb"] = float(eps[j])
    return ThresholdBound(**out)
