"""Tests for audit.bounds.one_run: Steinke, Nasr & Jagielski's one-run bound against a plain-loop
transcription, its closed form at delta = 0, soundness over repetitions and input validation."""

import math

import numpy as np
import pytest
from scipy import special
from scipy.stats import binom

from audit.bounds.hypothesis import gdp_epsilon
from audit.bounds.one_run import epsilon_one_run, one_run_p_value

DELTA = 1e-5
ALPHA = 0.05
SOUNDNESS_REPS = 100
MAX_SOUNDNESS = int(binom.ppf(0.999, SOUNDNESS_REPS, ALPHA))


def _naive_p_value(m, r, v, eps, delta):
    """Direct transcription of the Steinke-Nasr-Jagielski p-value with plain loops."""
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = binom.pmf(np.arange(r + 1), r, q)
    tail = sum(pmf[j] for j in range(v, r + 1))
    best, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += pmf[v - i]
        best = max(best, acc / i)
    return min(tail + 2 * m * delta * best, 1.0)


def _naive_eps(m, r, v, delta, alpha, step):
    """Largest eps on a grid of the given step with p-value < alpha (0 if none)."""
    eps = 0.0
    if _naive_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    while _naive_p_value(m, r, v, eps + step, delta) < alpha:
        eps += step
    return eps


ONE_RUN_CASES = [
    # (m, r, v, delta)
    (100, 20, 18, 1e-5),
    (100, 50, 50, 1e-5),
    (1000, 100, 90, 1e-5),
    (1000, 200, 160, 1e-3),
    (1000, 100, 100, 1e-4),  # 2*m*delta = 0.2: the correction term matters
    (10_000, 300, 290, 1e-6),
]


@pytest.mark.parametrize("m, r, v, delta", ONE_RUN_CASES)
def test_one_run_matches_naive(m, r, v, delta):
    for eps in (0.0, 0.5, 1.0, 2.0, 4.0):
        assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
            _naive_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-300
        )
    step = 0.005
    naive = _naive_eps(m, r, v, delta, ALPHA, step)
    # Build scores that realise exactly (r, v): k_pos = r guesses "in", v of them right.
    scores = np.arange(m, 0, -1, dtype=float)  # descending, so top r = first r
    is_member = np.zeros(m, dtype=bool)
    is_member[:v] = True
    is_member[r:] = np.arange(m - r) % 2 == 0  # unguessed canaries: irrelevant to the bound
    res = epsilon_one_run(scores, is_member, delta, ALPHA, k_pos=r, k_neg=0)
    assert (res["r"], res["v"], res["m"]) == (r, v, m)
    assert naive <= res["epsilon_lb"] <= naive + step + 1e-9, (naive, res["epsilon_lb"])
    print(f"one-run m={m} r={r} v={v} delta={delta}: eps_lb={res['epsilon_lb']:.4f}")


def test_one_run_delta_zero_is_binomial_tail():
    for r, v, eps in [(50, 40, 1.0), (200, 150, 0.7)]:
        q = 1 / (1 + math.exp(-eps))
        assert one_run_p_value(1000, r, v, eps, 0.0) == pytest.approx(binom.sf(v - 1, r, q))
    # Larger delta can only weaken the bound.
    assert one_run_p_value(1000, 100, 90, 1.0, 1e-3) >= one_run_p_value(1000, 100, 90, 1.0, 0.0)


def test_one_run_pure_dp_closed_form():
    """delta = 0: r guesses all right has p-value q^r, so eps_lb = logit(alpha^(1/r)) exactly."""
    m, r = 400, 60
    scores = np.arange(m, 0, -1, dtype=float)
    is_member = np.zeros(m, dtype=bool)
    is_member[:r] = True
    is_member[r:] = np.arange(m - r) % 2 == 0
    res = epsilon_one_run(scores, is_member, 0.0, ALPHA, k_pos=r)
    assert (res["r"], res["v"], res["delta"]) == (r, r, 0.0)
    assert res["epsilon_lb"] == pytest.approx(special.logit(ALPHA ** (1 / r)), rel=1e-8)
    # Pure DP is the stronger claim, so refuting it needs no more evidence.
    assert (
        res["epsilon_lb"] >= epsilon_one_run(scores, is_member, 1e-5, ALPHA, k_pos=r)["epsilon_lb"]
    )
    # The default guess grid also runs at delta = 0.
    assert epsilon_one_run(scores, is_member, 0.0)["epsilon_lb"] > 0


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_one_run_soundness_over_repetitions(mu):
    """Canaries in with probability 1/2 (the theorem's setting), member scores N(mu, 1)."""
    truth = gdp_epsilon(mu, DELTA)
    rng = np.random.default_rng(31)
    exceed, lbs = 0, []
    for _ in range(SOUNDNESS_REPS):
        member = rng.random(1000) < 0.5
        res = epsilon_one_run(rng.normal(mu * member, 1.0), member, DELTA, ALPHA)
        exceed += res["epsilon_lb"] > truth
        lbs.append(res["epsilon_lb"])
    print(
        f"one-run soundness mu={mu}: {exceed}/{SOUNDNESS_REPS} above the truth {truth:.3f}, "
        f"mean eps_lb {np.mean(lbs):.3f}"
    )
    assert exceed <= MAX_SOUNDNESS and np.mean(lbs) > 0.1 * truth


def test_one_run_counts_positive_and_negative_guesses():
    scores = np.array([9.0, 8.0, 7.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    member = np.array([1, 1, 0, 1, 0, 1, 0, 0], dtype=bool)
    res = epsilon_one_run(scores, member, DELTA, k_pos=3, k_neg=2)
    # top 3: 2 members right; bottom 2 (2.0, 1.0): both non-members right.
    assert (res["r"], res["v"], res["k_pos"], res["k_neg"]) == (5, 4, 3, 2)
    only_pos = epsilon_one_run(scores, member, DELTA, k_pos=3)
    assert (only_pos["r"], only_pos["v"], only_pos["k_neg"]) == (3, 2, 0)


def test_one_run_zero_signal_is_near_zero():
    rng = np.random.default_rng(20)
    lbs = []
    for _ in range(40):
        m = 1000
        member = rng.random(m) < 0.5
        lbs.append(epsilon_one_run(rng.normal(size=m), member, DELTA)["epsilon_lb"])
    print(f"one-run null: {np.count_nonzero(lbs)}/40 positive, max {max(lbs):.3f}")
    assert np.count_nonzero(lbs) <= 6  # level 0.05 -> expect ~2 of 40
    assert max(lbs) < 0.5


def test_one_run_separable_grows_with_m():
    rng = np.random.default_rng(21)
    lbs = []
    for m in (100, 1000, 10_000):
        member = rng.random(m) < 0.5
        scores = member + 0.01 * rng.random(m)  # perfectly separable
        res = epsilon_one_run(scores, member, DELTA)
        # Every guess is right unless k exceeds the (random, ~m/2) number of members.
        assert res["v"] >= 0.95 * res["r"]
        lbs.append(res["epsilon_lb"])
    print("one-run separable eps_lb for m = 100, 1k, 10k:", [round(x, 3) for x in lbs])
    assert 0 < lbs[0] < lbs[1] < lbs[2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scores": [0.1, np.nan, 0.3, 0.4]}, "NaN"),
        ({"scores": [], "is_member": []}, "empty"),
        ({"is_member": [True, False]}, "same length"),
        ({"delta": -1e-5}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 2.0}, "delta"),
        ({"alpha": 1.0}, "alpha"),
        ({"k_pos": 3, "k_neg": 2}, "k_pos \\+ k_neg"),
        ({"k_pos": -1}, "k_pos"),
    ],
)
def test_epsilon_one_run_validation(kwargs, match):
    args = {"scores": [0.1, 0.2, 0.3, 0.4], "is_member": [True, False, True, False], "delta": DELTA}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        epsilon_one_run(**args)
