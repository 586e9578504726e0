"""Conformance tests: does what a run released carry at least the claimed Gaussian noise,
fresh at every step, and do its canaries add at most C?

The one-run ε lower bound (:mod:`audit.bounds.one_run`, :mod:`audit.bounds.fdp`) is weak at
the sampling rates DP-SGD really uses. A white-box auditor sees more: at every step the
privatized sum at each canary's coordinate (or W-space slot, or a canary client's
direction),

    x_t = D_t + a·v_t + Z_t,        Z_t ~ N(0, σ²C²) fresh,

where D_t is the data's own (clipped) contribution, v_t ∈ {0, 1} whether the canary entered
the step (its inclusion bit times its Poisson coin) and a = C for a correctly clipped canary.
Work in units of C (u = x / C, so the noise is N(0, σ²) and a correct canary adds 1).

What is conditioned on (the validity argument, proved in docs/audit.md): let F be everything
released before step t (earlier steps of this local training, earlier rounds, other
clients' trainings). D_t depends on F (the model is a function of earlier noise) and on the
step's data batch, drawn by fresh coins; v_t on the canary's fresh coin. Given F, the fresh
noise Z_t is independent of (D_t, v_t). So for any predictor m_t computed from F alone, the
innovation e_t = u_t − v_t − m_t = Z_t/C + W_t with W_t independent of Z_t given F, and
e_t² ≥_st σ²·χ²₁ given F whatever the data do. Summed over steps and coordinates (the noise
is independent across coordinates), Q = Σ e²/σ² stochastically dominates χ²_N: a small Q
(too little variation) is evidence that the noise is smaller than claimed, or not fresh
(a reused draw is predictable from the past), for ANY data gradient. No test here assumes
the data gradient small, smooth or independent of the noise.

Three tests per parameter group (``A``, ``B``, ``head``; W-space slots are B's):

(a) **scale**: m_t = λ·(mean of the track's earlier residuals u − v), λ ∈ [0, 1] a shrinkage
    computed from the past only (the group's earlier means against their standard error);
    p = P(χ²_N ≤ Q).
(b) **freshness**: m_t = the track's previous residual in the same local training; a noise
    draw reused at the next step cancels exactly. p = P(χ²_N ≤ Q_b). (Under the claim Q_b/N
    is about 2.)
(c) **clipping**: given F and e_t, the fresh coin v_t is still Bernoulli (the innovation does
    not depend on it when a = 1), so S = Σ e_t (v_t − E v_t) is a martingale with increments
    conditionally sub-Gaussian with variance proxy e_t²/4 (Hoeffding's lemma, range |e_t|);
    a contribution a > 1 makes S grow like (a − 1)·Σ Var(v). The p-value is Ville's
    inequality on the normal-mixture supermartingale (Robbins): p = sqrt((V+ρ)/ρ)·
    exp(−S₊²/(2(V+ρ))), V = Σ e²/4, ρ = σ²/4 fixed in advance. Needs the coins (the
    run's own audit re-derives them from the key); skipped without them. H0 here is
    "a = 1 exactly", which is what a correct clip gives the canaries (their pre-clip
    gradient is K·C, K = 100).

The family (every test of every group) is corrected by Holm's step-down, which keeps the
family-wise false-alarm rate at α under any dependence between the tests. Two levels: the
verdict's :data:`ALPHA` = 0.001 (a rejection there is the error ``mechanism_mismatch``: at
most one correct run in a thousand is called broken, so a job of five DP runs raises a false
alarm at most once in 200 jobs) and :data:`ALPHA_WARN` = 0.05 (a test rejected there but not
at ALPHA is ``weak``: reported as a warning, the verdict unchanged). The faults this audit is
for are flagged at p < 10⁻³⁰⁰; the smaller verdict level costs power only within a few
percent of the claimed noise (benchmarks/results/faults: every ×0.95 point flagged 10/10 at
both levels).

The **observed/claimed noise ratio** of a group is ρ̂ = sqrt(Q/N) with the interval
[sqrt(Q/χ²_{N,1−α/2}), sqrt(Q/χ²_{N,α/2})] at α = :data:`ALPHA_WARN` (a 95 % interval); its upper end is a valid upper confidence bound
for the scale f of a Gaussian noise N(0, f²σ²C²) (Q ≥_st f²χ²_N), conservative because the
data's part only adds to Q. The noise-implied ε (:func:`implied_noise_factor`) uses the
worst group's upper bound at α/G.

numpy and scipy only: the inputs are arrays, whoever made them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

__all__ = [
    "ALPHA",
    "ALPHA_WARN",
    "Block",
    "ConformanceResult",
    "GroupTest",
    "TESTS",
    "conformance",
    "holm",
    "implied_noise_factor",
]

#: the family-wise level of the verdict: a test rejected here is a ``mechanism_mismatch``
ALPHA = 0.001
#: the family-wise level of the warning (``weak``), and of the ratio intervals (95 %)
ALPHA_WARN = 0.05

#: the tests, in the order they are reported
TESTS = {
    "scale": "the noise at each observed coordinate is at least N(0, σ²C²) given the past",
    "fresh": "the noise is drawn afresh at every step (the previous step does not predict it)",
    "clip": "a canary adds at most C (its coin does not pull the innovation up)",
}


@dataclass(frozen=True)
class Block:
    """One local training's (or one round's) observations of some canaries, in step order.

    ``u``: (T, n) privatized sums at the canaries' coordinates in units of C (x / C);
    ``tracks``: (n,) canary ids (the same id in two blocks is the same coordinate, one track);
    ``groups``: (n,) the parameter group of each column; ``sigma``: the claimed noise
    multiplier of this block (noise std σ·C, so σ in units of C); ``included``: (n,) the
    canaries' inclusion bits; ``coins``: (T, n) bool, whether each canary's Poisson coin came
    up at each step, or None when unknown (the clipping test is then skipped and the
    canaries' contributions are left in the residuals, which only adds variation); ``q``: the
    coins' rate; ``p_include``: the probability of an inclusion bit (½); ``order``: where the
    block falls in time (blocks are processed in this order: a block's predictor uses every
    block before it)."""

    u: np.ndarray
    tracks: np.ndarray
    groups: np.ndarray
    sigma: float
    included: np.ndarray
    coins: np.ndarray | None = None
    q: float = 1.0
    p_include: float = 0.5
    order: tuple = ()

    def __post_init__(self) -> None:
        u = np.asarray(self.u, dtype=np.float64)
        if u.ndim != 2:
            raise ValueError(f"Block.u must be (steps, canaries), got shape {u.shape}")
        n = u.shape[1]
        for name in ("tracks", "groups", "included"):
            if np.asarray(getattr(self, name)).shape != (n,):
                raise ValueError(
                    f"Block.{name} must have one entry per canary ({n}), got shape "
                    f"{np.asarray(getattr(self, name)).shape}"
                )
        if self.coins is not None and np.asarray(self.coins).shape != u.shape:
            raise ValueError(
                f"Block.coins must have the observations' shape {u.shape}, got "
                f"{np.asarray(self.coins).shape}"
            )
        if not np.isfinite(u).all():
            raise ValueError("Block.u holds NaN or Inf observations")
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"Block.sigma must be a positive number, got {self.sigma}")
        if not 0 < self.q <= 1:
            raise ValueError(f"Block.q must be in (0, 1], got {self.q}")


@dataclass(frozen=True)
class GroupTest:
    """One test of one group: its statistic, degrees of freedom (terms), p-value (log10 kept
    for the tiny ones), and for ``scale``/``fresh`` the observed/claimed ratio with its
    interval and upper confidence bound."""

    group: str
    test: str
    terms: int
    statistic: float
    log10_p: float
    ratio: float | None = None
    ratio_ci: tuple[float, float] | None = None
    ratio_upper: float | None = None  # one-sided, at the level the implied ε uses
    rejected: bool = False
    #: rejected at the warning level (Holm at ALPHA_WARN) but not at the verdict's
    weak: bool = False
    note: str = ""

    @property
    def p_value(self) -> float:
        return 10.0**self.log10_p

    def evidence(self) -> str:
        """The p-value and what the test saw, for a reader (findings' messages)."""
        p = f"p < 1e{MIN_LOG10_P:.0f}" if self.log10_p <= MIN_LOG10_P else f"p = {self.p_value:.3g}"
        if self.ratio is not None and self.ratio_ci is not None:
            lo, hi = self.ratio_ci
            return f"{p}; observed/claimed noise {self.ratio:.3g} [{lo:.3g}, {hi:.3g}]"
        if self.test == "clip":
            return (
                f"{p}; the canaries' coins pull the innovations up (statistic "
                f"{self.statistic:.4g} over {self.terms} terms)"
            )
        return f"{p}; {self.note}" if self.note else p

    def to_dict(self) -> dict:
        d = {
            "group": self.group,
            "test": self.test,
            "terms": self.terms,
            "statistic": self.statistic,
            "p_value": self.p_value,
            "log10_p": self.log10_p,
            "rejected": self.rejected,
        }
        if self.weak:
            d["weak"] = True
        if self.ratio is not None:
            d["observed_over_claimed"] = self.ratio
            d["ratio_ci"] = list(self.ratio_ci) if self.ratio_ci else None
            d["ratio_upper"] = self.ratio_upper
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class ConformanceResult:
    """Every test of every group, Holm-corrected at ``alpha`` (``rejected``) and at
    ``warn_alpha`` (``weak``: rejected there, not at ``alpha``)."""

    alpha: float
    tests: tuple[GroupTest, ...]
    skipped: tuple[str, ...] = field(default_factory=tuple)
    warn_alpha: float | None = None

    @property
    def passed(self) -> bool:
        return not any(t.rejected for t in self.tests)

    @property
    def rejected(self) -> tuple[GroupTest, ...]:
        return tuple(t for t in self.tests if t.rejected)

    @property
    def weak(self) -> tuple[GroupTest, ...]:
        """The tests rejected at ``warn_alpha`` but not at ``alpha``."""
        return tuple(t for t in self.tests if t.weak)

    def noise_ratio(self) -> dict[str, float]:
        """Per group: the scale test's observed/claimed ratio."""
        return {t.group: t.ratio for t in self.tests if t.test == "scale" and t.ratio is not None}

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "warn_alpha": self.warn_alpha,
            "passed": self.passed,
            "tests": [t.to_dict() for t in self.tests],
            "rejected": [f"{t.group}:{t.test}" for t in self.rejected],
            "weak": [f"{t.group}:{t.test}" for t in self.weak],
            "skipped": list(self.skipped),
            "correction": "Holm step-down over every test of every group (family-wise α)",
        }


def holm(log10_p: list[float], alpha: float) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected at family-wise level ``alpha``."""
    m = len(log10_p)
    order = sorted(range(m), key=lambda i: log10_p[i])
    out = [False] * m
    for rank, i in enumerate(order):
        if log10_p[i] <= math.log10(alpha / (m - rank)):
            out[i] = True
        else:
            break
    return out


#: p-values below 10^-300 are reported as 10^-300 (the JSON documents hold no -inf)
MIN_LOG10_P = -300.0


def _chi2_lower_log10(q: float, n: int) -> float:
    """log10 P(χ²_n ≤ q), at least :data:`MIN_LOG10_P`."""
    return max(float(stats.chi2.logcdf(q, n)) / math.log(10), MIN_LOG10_P)


def _ratio_summary(q: float, n: int, alpha: float, alpha_upper: float):
    lo = math.sqrt(q / stats.chi2.ppf(1 - alpha / 2, n))
    hi = math.sqrt(q / stats.chi2.ppf(alpha / 2, n))
    up = math.sqrt(q / stats.chi2.ppf(alpha_upper, n))
    return math.sqrt(q / n), (lo, hi), up


class _Acc:
    """Running sums of one group."""

    def __init__(self) -> None:
        self.q_scale = 0.0
        self.n_scale = 0
        self.q_fresh = 0.0
        self.n_fresh = 0
        self.s_clip = 0.0
        self.v_clip = 0.0
        self.n_clip = 0


def conformance(
    blocks: list[Block],
    alpha: float = ALPHA,
    shrink: bool = True,
    extra: tuple[GroupTest, ...] = (),
    warn_alpha: float | None = ALPHA_WARN,
) -> ConformanceResult:
    """Run the scale, freshness and clipping tests per group over ``blocks`` (module doc).

    ``shrink=False`` predicts with the plain mean of the past (λ = 1; used by tests).
    ``extra``: other valid tests of the same run (e.g. the sampler canaries' permutation
    test, :mod:`audit.bounds.sampling`) to correct together with these.
    Returns a :class:`ConformanceResult`; ``alpha`` is the family-wise level of the verdict
    (``rejected``), ``warn_alpha`` that of the warning (``weak``; raised to ``alpha`` when
    below it; None: no warning level); the ratio intervals are at the warning level."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if warn_alpha is not None:
        if not 0 < warn_alpha < 1:
            raise ValueError(f"warn_alpha must be in (0, 1), got {warn_alpha}")
        warn_alpha = max(warn_alpha, alpha)
    ci_alpha = alpha if warn_alpha is None else warn_alpha
    acc: dict[str, _Acc] = {}
    # per track: the sum and count of its earlier residuals
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    sigma_min: dict[str, float] = {}
    skipped: set[str] = set()
    for b in sorted(blocks, key=lambda b: b.order):
        u = np.asarray(b.u, dtype=np.float64)
        T, n = u.shape
        if T == 0 or n == 0:
            continue
        tracks = np.asarray(b.tracks, dtype=np.int64)
        groups = np.asarray(b.groups).astype(str)
        inc = np.asarray(b.included, dtype=bool)
        coins = None if b.coins is None else np.asarray(b.coins, dtype=bool)
        if coins is None:
            skipped.add("clip (the canaries' coins are unknown)")
        # residual: the observation less the claimed canary contribution (1 per entry)
        v = (coins & inc[None, :]).astype(np.float64) if coins is not None else None
        r = u - v if v is not None else u
        s = np.array([sums.get(int(j), 0.0) for j in tracks])
        c = np.array([counts.get(int(j), 0) for j in tracks], dtype=np.float64)
        sig2 = b.sigma**2
        for g in np.unique(groups):
            sigma_min[g] = min(sigma_min.get(g, math.inf), b.sigma)
        for t in range(T):
            seen = c > 0
            mean = np.where(seen, s / np.maximum(c, 1), 0.0)
            lam = np.ones(n)
            if shrink:
                # per group: λ = 1 − (noise variance of the means)/(mean square of the means),
                # clipped to [0, 1]; every input is from before this step
                for g in np.unique(groups):
                    sel = (groups == g) & seen
                    if sel.any():
                        ms = float(np.mean(mean[sel] ** 2))
                        nv = float(np.mean(sig2 / c[sel]))
                        lam[groups == g] = 0.0 if ms <= 0 else min(1.0, max(0.0, 1.0 - nv / ms))
            e = r[t] - lam * mean
            # the clipping test's fresh randomness: the bit×coin at a track's first sight
            # (mean p·q), the coin afterwards for an included canary (mean q)
            if coins is not None:
                first = ~seen
                vt = np.where(first, (coins[t] & inc).astype(np.float64), coins[t].astype(float))
                ev = np.where(first, b.p_include * b.q, b.q)
                has = np.where(first, True, inc) & (ev > 0) & (ev < 1)
            for g in np.unique(groups):
                sel = groups == g
                a = acc.setdefault(str(g), _Acc())
                a.q_scale += float(np.sum(e[sel] ** 2)) / sig2
                a.n_scale += int(sel.sum())
                if t > 0:
                    d = r[t, sel] - r[t - 1, sel]
                    a.q_fresh += float(np.sum(d**2)) / sig2
                    a.n_fresh += int(sel.sum())
                if coins is not None:
                    h = sel & has
                    a.s_clip += float(np.sum(e[h] * (vt[h] - ev[h])))
                    a.v_clip += float(np.sum(e[h] ** 2)) / 4
                    a.n_clip += int(h.sum())
            s = s + r[t]
            c = c + 1
        for k, j in enumerate(tracks):
            sums[int(j)] = float(s[k])
            counts[int(j)] = int(c[k])
    groups_seen = sorted(acc)
    g_count = max(1, len(groups_seen))
    raw: list[GroupTest] = []
    for g in groups_seen:
        a = acc[g]
        if a.n_scale:
            ratio, ci, up = _ratio_summary(a.q_scale, a.n_scale, ci_alpha, ci_alpha / (2 * g_count))
            raw.append(
                GroupTest(
                    g,
                    "scale",
                    a.n_scale,
                    a.q_scale,
                    _chi2_lower_log10(a.q_scale, a.n_scale),
                    ratio,
                    ci,
                    up,
                )
            )
        if a.n_fresh:
            ratio, ci, up = _ratio_summary(a.q_fresh, a.n_fresh, ci_alpha, ci_alpha / (2 * g_count))
            raw.append(
                GroupTest(
                    g,
                    "fresh",
                    a.n_fresh,
                    a.q_fresh,
                    _chi2_lower_log10(a.q_fresh, a.n_fresh),
                    ratio,
                    ci,
                    up,
                    note="under the claim about sqrt(2): consecutive steps' noises add",
                )
            )
        if a.n_clip:
            rho = sigma_min[g] ** 2 / 4
            sp = max(a.s_clip, 0.0)
            log_m = 0.5 * math.log(rho / (a.v_clip + rho)) + sp**2 / (2 * (a.v_clip + rho))
            raw.append(
                GroupTest(
                    g,
                    "clip",
                    a.n_clip,
                    a.s_clip,
                    max(MIN_LOG10_P, min(0.0, -log_m / math.log(10))),
                    note="normal-mixture martingale bound (Ville), variance proxy e²/4",
                )
            )
    raw += list(extra)
    logs = [t.log10_p for t in raw]
    rej = holm(logs, alpha)
    warn = holm(logs, warn_alpha) if warn_alpha is not None else rej
    tests = tuple(
        GroupTest(**{**t.__dict__, "rejected": bool(x), "weak": bool(w and not x)})
        for t, x, w in zip(raw, rej, warn)
    )
    return ConformanceResult(
        alpha=alpha, tests=tests, skipped=tuple(sorted(skipped)), warn_alpha=warn_alpha
    )


def implied_noise_factor(result: ConformanceResult) -> tuple[float, str | None]:
    """(f, group): the smallest upper confidence bound over the groups of the noise's scale
    relative to the claim, from the scale and freshness tests (each a valid upper bound on
    f under "the noise is N(0, f²σ²C²)"; the freshness test's by a factor sqrt(2) less
    tight), capped at 1; the group it came from (None when nothing is below 1). Each
    group's bound is at α/(2G), α the level of the ratio intervals (``warn_alpha``, 0.05,
    unless None): jointly they hold at 1 − α."""
    best, who = 1.0, None
    for t in result.tests:
        if t.ratio_upper is not None and t.ratio_upper < best:
            best, who = t.ratio_upper, t.group
    return best, who
