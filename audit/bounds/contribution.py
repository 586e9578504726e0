"""Two-sided clip tests: does a drawn canary add EXACTLY C, not only at most C?

A mechanism that clips each example makes a canary whose pre-clip gradient is K·C (K ≫ 1)
add exactly C; one that clips the batch sum instead gives it less (it shares a clip with
other records), one that counts a record twice gives more. The one-sided clip test of
:func:`audit.bounds.conformance.conformance` ("at most C") passes both. Two tests, each a
member of the conformance family through ``conformance(..., extra=...)``:

* :func:`contribution_test` — a pooled two-sample t test, where the data add exactly 0 at
  the canaries' coordinates (a canary block of their own: the library audits);
* :func:`clip_contribution_test` — on the clip test's innovations, a mixture of exact
  Bernoulli martingales (Ville's inequality), valid whatever the data add (gradient
  canaries on model coordinates: the engine's runs and trainings done elsewhere).

numpy and scipy only.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from audit.bounds.conformance import MIN_LOG10_P, Block, GroupTest

__all__ = ["CONTRIBUTION_GRID", "clip_contribution_test", "contribution_test"]


def contribution_test(
    u: np.ndarray, drawn: np.ndarray, *, group: str = "canary", expected: float = 1.0
) -> GroupTest | None:
    """Two-sided: does each drawn canary add EXACTLY ``expected`` (units of C), not only at
    most? For a mechanism that clips each example, a canary whose pre-clip gradient is K·C
    (K ≫ 1) adds exactly C; one that shares a clip with other records (the batch sum clipped
    instead of each example) adds less, one counted twice more.

    ``u``: (T, n) the release at the canaries' coordinates in units of C; ``drawn``: (T, n)
    bool, the canary entered that step (inclusion bit and coin). Valid where the data add
    exactly 0 at these coordinates (coordinates of the canaries' own, e.g. a canary block)
    and the noise is i.i.d. over steps and coordinates: then the drawn entries are
    N(expected, s²) and the others N(0, s²) with s unknown, and the pooled two-sample t
    statistic of mean(drawn) − mean(others) − expected has Student's t law (n_d + n_o − 2
    degrees of freedom) whatever s is, so noise larger than claimed does not make it reject.
    ``statistic`` is the estimated contribution; None when fewer than one drawn or two
    other entries (nothing to test). Not part of :func:`conformance` (whose ``clip`` test is
    one-sided and needs no zero data): pass it in ``extra``."""
    u = np.asarray(u, dtype=np.float64)
    d = np.asarray(drawn, dtype=bool)
    if u.shape != d.shape:
        raise ValueError(f"u {u.shape} and drawn {d.shape} must have one shape")
    x, y = u[d], u[~d]
    nx, ny = x.size, y.size
    if nx < 1 or ny < 2 or nx + ny < 3:
        return None
    a = float(x.mean() - y.mean())
    ss = float(((x - x.mean()) ** 2).sum() + ((y - y.mean()) ** 2).sum())
    dof = nx + ny - 2
    se = math.sqrt(ss / dof * (1 / nx + 1 / ny)) if ss > 0 else 0.0
    if se == 0:
        t_stat = 0.0 if a == expected else math.copysign(math.inf, a - expected)
        log10_p = 0.0 if a == expected else MIN_LOG10_P
    else:
        t_stat = (a - expected) / se
        log10_p = (float(stats.t.logsf(abs(t_stat), dof)) + math.log(2)) / math.log(10)
        log10_p = max(MIN_LOG10_P, min(0.0, log10_p))
    return GroupTest(
        group=group,
        test="contribution",
        terms=int(nx),
        statistic=a,
        log10_p=log10_p,
        note=(
            f"a drawn canary adds {a:.4g} C (expected exactly {expected:g}; {nx} draws, "
            f"{ny} noise-only entries, t = {t_stat:.3g}): two-sided pooled t test"
        ),
    )


#: the two-sided clip test's mixture: η = ±10^(k/4), k = −12 … 8 (10⁻³ … 100, per unit of
#: noise std), each sign and size weighted alike; fixed in advance
CONTRIBUTION_GRID = np.array([s * 10 ** (k / 4) for s in (-1.0, 1.0) for k in range(-12, 9)])


def _log_bernoulli_mgf(mu: np.ndarray, p: np.ndarray) -> np.ndarray:
    """ψ_p(μ) = log E exp(μ(v − p)), v ~ Bernoulli(p), elementwise (stable for large |μ|)."""
    return np.logaddexp(np.log1p(-p), np.log(p) + mu) - mu * p


def clip_contribution_test(blocks: list[Block], shrink: bool = True) -> tuple[GroupTest, ...]:
    """Two-sided, for ANY data gradient: does each drawn canary add EXACTLY C (not only at
    most)? Per group, one test ``contribution`` for :func:`conformance`'s ``extra``.

    The clipping test's innovations (module doc, (c)), e_t = u_t − v_t − λ_t·m_t with the
    same predictor from the past, in units of the block's noise std (ẽ = e/σ), and the
    fresh coin v_t (the bit×coin at a track's first sight, mean p = p_include·q; the coin
    afterwards for an included canary, mean p = q). Assumption (H0): given the past, the
    data's contribution at a canary's coordinate does not depend on that canary's coin, and
    a drawn canary adds exactly 1 (units of C) — what a mechanism that clips EACH example
    gives a canary whose pre-clip gradient is K·C, K ≥ 1, beside records sampled
    independently of its coin. Then e_t does not depend on v_t given the past, so for every
    fixed η the product over terms of exp(η ẽ (v − p) − ψ_p(η ẽ)), ψ_p(μ) = log(1 − p + p
    e^μ) − μp the Bernoulli's exact log-mgf, is a nonnegative martingale of mean 1 (the
    coins of one step are independent given the past and the step's innovations), and so
    is the mixture M over η ∈ :data:`CONTRIBUTION_GRID` (both signs, weights equal, fixed in
    advance). Ville: P(M ≥ 1/p) ≤ p, p = min(1, 1/M), whatever the data add at the
    coordinates (they only enter e_t; the pooled t test :func:`contribution_test` needs
    them 0). A contribution a ≠ 1 moves the drawn terms' innovations by (a − 1)/σ: a > 1
    (a skipped clip) as the one-sided test sees it, a < 1 too — a clip of the batch sum
    (the canaries share one clip: each adds about C/√(canaries drawn)), a clip at a smaller
    C, a division of the canaries' part. The exact mgf (variance p(1 − p)·ẽ² for small η)
    is what gives this test its power at small q, where Hoeffding's range bound ẽ²/4 (the
    one-sided test's) is 1/(4q) times too wide.

    ``statistic``: the estimated contribution â = 1 + S/W, S = Σ e (v − p), W = Σ p(1 − p)
    over the terms (E S = (a − 1)·W when the data do not move with the coin). Empty when the
    coins are unknown (every block's ``coins`` None) or no term has a random coin."""
    grid = CONTRIBUTION_GRID
    acc: dict[str, dict] = {}  # group -> log M per η, S, W, terms
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for b in sorted(blocks, key=lambda b: b.order):
        u = np.asarray(b.u, dtype=np.float64)
        T, n = u.shape
        if T == 0 or n == 0 or b.coins is None:
            continue
        tracks = np.asarray(b.tracks, dtype=np.int64)
        groups = np.asarray(b.groups).astype(str)
        inc = np.asarray(b.included, dtype=bool)
        coins = np.asarray(b.coins, dtype=bool)
        r = u - (coins & inc[None, :]).astype(np.float64)
        s = np.array([sums.get(int(j), 0.0) for j in tracks])
        c = np.array([counts.get(int(j), 0) for j in tracks], dtype=np.float64)
        sig2 = b.sigma**2
        ug = np.unique(groups)
        for t in range(T):
            seen = c > 0
            mean = np.where(seen, s / np.maximum(c, 1), 0.0)
            lam = np.ones(n)
            if shrink:  # as conformance(): from before this step only
                for g in ug:
                    sel = (groups == g) & seen
                    if sel.any():
                        ms = float(np.mean(mean[sel] ** 2))
                        nv = float(np.mean(sig2 / c[sel]))
                        lam[groups == g] = 0.0 if ms <= 0 else min(1.0, max(0.0, 1.0 - nv / ms))
            e = r[t] - lam * mean
            first = ~seen
            vt = np.where(first, (coins[t] & inc).astype(np.float64), coins[t].astype(float))
            ev = np.where(first, b.p_include * b.q, b.q)
            has = np.where(first, True, inc) & (ev > 0) & (ev < 1)
            for g in ug:
                h = (groups == g) & has
                if h.any():
                    a = acc.setdefault(str(g), {"log": np.zeros(grid.size), "S": 0.0, "W": 0.0})
                    et, pt, xt = e[h] / b.sigma, ev[h], vt[h] - ev[h]
                    mu = grid[:, None] * et[None, :]
                    a["log"] += (mu * xt[None, :] - _log_bernoulli_mgf(mu, pt[None, :])).sum(1)
                    a["S"] += float(np.sum(e[h] * xt))
                    a["W"] += float(np.sum(pt * (1 - pt)))
                    a["n"] = a.get("n", 0) + int(h.sum())
            s = s + r[t]
            c = c + 1
        for k, j in enumerate(tracks):
            sums[int(j)] = float(s[k])
            counts[int(j)] = int(c[k])
    out = []
    for g in sorted(acc):
        a = acc[g]
        log_m = float(np.logaddexp.reduce(a["log"])) - math.log(grid.size)
        a_hat = 1.0 + a["S"] / a["W"] if a["W"] > 0 else 1.0
        out.append(
            GroupTest(
                group=g,
                test="contribution",
                terms=int(a["n"]),
                statistic=a_hat,
                log10_p=max(MIN_LOG10_P, min(0.0, -log_m / math.log(10))),
                note=f"a drawn canary adds {a_hat:.4g} C (expected exactly 1; {a['n']} terms): "
                "two-sided mixture of exact Bernoulli martingales (Ville), valid for any data "
                "gradient",
            )
        )
    return tuple(out)
