"""Conformance tests (audit.bounds.conformance): exact calibration where the statistic is an
exact χ², the false-alarm rate under data that depend on the past noise, power against the
planted faults, Holm against a brute-force reference, and bad input."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from audit.bounds.conformance import Block, conformance, holm, implied_noise_factor


def simulate(
    rng,
    n=300,
    T=12,
    rounds=1,
    q=0.3,
    sigma=1.0,
    f=1.0,
    data="drift",
    reuse=False,
    contrib=1.0,
    groups=("A", "B", "head"),
    unnoised=None,
):
    """DP-SGD at n canary coordinates: u_t = D_t + contrib·b·s_t + f·Z_t (units of C).

    data: ``drift`` (a decaying offset plus batch noise), ``none``, ``adversary`` (the data
    gradient is the mean of the track's past residuals: a function of the earlier noise, the
    dependence the validity argument must survive), ``echo`` (the data gradient repeats the
    previous step's noise, the worst case for the freshness test's predictor)."""
    grp = np.array([groups[i % len(groups)] for i in range(n)])
    inc = rng.random(n) < 0.5
    past = np.zeros(n)
    cnt = np.zeros(n)
    theta = rng.normal(0, 0.3, n)
    prev_z = np.zeros(n)
    blocks = []
    for r in range(rounds):
        coins = rng.random((T, n)) < q
        z0 = rng.normal(0, sigma, n)
        u = np.zeros((T, n))
        for t in range(T):
            z = f * (z0 if reuse else rng.normal(0, sigma, n))
            if unnoised is not None:
                z = np.where(grp == unnoised, 0.0, z)
            if data == "drift":
                d = theta + rng.normal(0, 0.1, n)
                theta = theta * 0.95
            elif data == "adversary":
                d = np.where(cnt > 0, past / np.maximum(cnt, 1), 0.0)
            elif data == "echo":
                d = -prev_z
            else:
                d = 0.0
            u[t] = d + contrib * (coins[t] & inc) + z
            past += u[t] - (coins[t] & inc)
            cnt += 1
            prev_z = z
        blocks.append(
            Block(
                u=u,
                tracks=np.arange(n),
                groups=grp,
                sigma=sigma,
                included=inc,
                coins=coins,
                q=q,
                order=(r,),
            )
        )
    return blocks


def _p(res, group, test):
    return next(t for t in res.tests if t.group == group and t.test == test).p_value


def test_one_step_statistic_is_an_exact_chi2():
    """One observation per track and no data: the scale statistic is exactly χ²_N, so its
    p-values are uniform (Kolmogorov–Smirnov over 300 runs)."""
    rng = np.random.default_rng(1)
    ps = []
    for _ in range(300):
        res = conformance(simulate(rng, n=50, T=1, data="none", groups=("A",)))
        ps.append(_p(res, "A", "scale"))
    assert stats.kstest(ps, "uniform").pvalue > 0.01
    # and the same statistic's value, by hand
    b = simulate(np.random.default_rng(2), n=40, T=1, data="none", groups=("A",))[0]
    r = b.u[0] - (b.coins[0] & b.included)
    res = conformance([b])
    t = next(t for t in res.tests if t.test == "scale")
    assert t.statistic == pytest.approx(float(np.sum(r**2)))
    assert t.p_value == pytest.approx(stats.chi2.cdf(np.sum(r**2), 40))


@pytest.mark.parametrize("data", ["adversary", "echo", "drift", "none"])
def test_false_alarms_stay_below_alpha_whatever_the_data(data):
    """200 correct runs per data model (the data gradient a function of the past noise
    included): the family-wise rejections stay at or below α = 0.1 (within three binomial
    standard errors), and every unadjusted scale p-value below 0.1 is as rare."""
    rng = np.random.default_rng(3)
    runs, alpha = 200, 0.1
    rejected = low = 0
    for _ in range(runs):
        res = conformance(simulate(rng, n=60, T=6, rounds=2, data=data), alpha=alpha)
        rejected += not res.passed
        low += _p(res, "A", "scale") < alpha
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    assert rejected / runs <= bound
    assert low / runs <= bound


@pytest.mark.parametrize(
    "fault, test",
    [
        (dict(f=0.5), "scale"),
        (dict(f=0.8), "scale"),
        (dict(reuse=True), "fresh"),
        (dict(contrib=100.0), "clip"),
        (dict(contrib=100.0, q=1.0), "clip"),
        (dict(contrib=100.0, q=0.01, T=100), "clip"),
        (dict(unnoised="head"), "scale"),
    ],
)
def test_planted_faults_are_rejected(fault, test):
    rng = np.random.default_rng(4)
    res = conformance(simulate(rng, n=600, **fault), alpha=0.05)
    assert not res.passed
    assert any(t.test == test for t in res.rejected), [t.to_dict() for t in res.tests]
    if "unnoised" in fault:
        assert {t.group for t in res.rejected} == {"head"}


def test_implied_factor_is_an_upper_bound_near_the_truth():
    """The worst group's upper confidence bound covers the true noise factor and is close
    to it when the data are small."""
    for f in (0.25, 0.5, 0.8):
        res = conformance(simulate(np.random.default_rng(5), n=900, T=12, f=f, data="none"))
        up, group = implied_noise_factor(res)
        assert f <= up <= f * 1.15, (f, up)
        assert group in ("A", "B", "head")
    res = conformance(simulate(np.random.default_rng(6), n=900))
    assert implied_noise_factor(res) == (1.0, None)


def test_holm_matches_the_brute_force_closure():
    """Holm's step-down equals the closed testing procedure with Bonferroni local tests."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        m = int(rng.integers(1, 6))
        p = list(10 ** rng.uniform(-4, 0, m))
        lp = [math.log10(x) for x in p]
        alpha = 0.05
        ref = []
        for i in range(m):
            ok = True
            for k in range(1, m + 1):
                for sub in itertools.combinations(range(m), k):
                    if i in sub and min(p[j] for j in sub) > alpha / len(sub):
                        ok = False
            ref.append(ok)
        assert holm(lp, alpha) == ref


def test_missing_coins_skip_the_clipping_test_and_keep_the_rest():
    b = simulate(np.random.default_rng(8), n=60, T=4)[0]
    nb = Block(u=b.u, tracks=b.tracks, groups=b.groups, sigma=b.sigma, included=b.included)
    res = conformance([nb])
    assert {t.test for t in res.tests} == {"scale", "fresh"}
    assert res.skipped and "coins" in res.skipped[0]
    d = res.to_dict()
    assert d["passed"] is True and d["correction"].startswith("Holm")


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(u=np.zeros(3)), "steps, canaries"),
        (dict(tracks=np.arange(2)), "one entry per canary"),
        (dict(u=np.full((2, 3), np.nan)), "NaN"),
        (dict(sigma=0.0), "positive"),
        (dict(sigma=float("nan")), "positive"),
        (dict(q=0.0), "q must be"),
        (dict(coins=np.zeros((1, 3), bool)), "coins"),
    ],
)
def test_bad_blocks_are_refused_with_the_field_named(kw, msg):
    base = dict(
        u=np.zeros((2, 3)),
        tracks=np.arange(3),
        groups=np.array(["A"] * 3),
        sigma=1.0,
        included=np.ones(3, bool),
    )
    with pytest.raises(ValueError, match=msg):
        Block(**{**base, **kw})


def test_alpha_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        conformance([], alpha=1.5)
