"""Client-level events under add/remove of ONE client (fl.privacy.accounting).

References: dp_accounting's accountants composed directly, the GDP closed form (k plain
Gaussians of multiplier s are exactly μ-GDP with μ = √k/s), and a numerical evaluation
of the hockey-stick divergence of a small fixed-count cohort mechanism.
"""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy.stats import norm

from audit.bounds.hypothesis import gdp_delta, gdp_epsilon
from fl.privacy.accounting import (
    FIXED_COUNT_NOTE,
    NEIGHBOURING,
    Event,
    PrivacyError,
    calibrate_client_level,
    calibrate_noise,
    client_level_event,
    epsilon_of_events,
)
from fl.privacy.ledger import Ledger

DELTA = 1e-5


def direct(event: dp_accounting.DpEvent, count: int, acc: str = "pld") -> float:
    a = pld.PLDAccountant() if acc == "pld" else rdp.RdpAccountant()
    a.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return a.get_epsilon(DELTA)


def eps(ev: Event, acc: str = "pld") -> float:
    return epsilon_of_events([ev], DELTA, acc)


#: (σ, releases, cohort m, clients K). σ = 1 with 5 releases, not 20: dp_accounting turns
#: k plain Gaussians into one at σ/√k, whose PLD grid widens with k (σ/2 = 0.5 over 20
#: releases: 2.5 million points, 2.5 s per ε, each computed twice; over 5: 0.9 s). Nothing
#: below depends on the number of releases beyond whether it is one (that case is kept);
#: 50 and 100 still compose many.
CASES = [(1.0, 5, 3, 10), (4.0, 50, 10, 100), (8.0, 100, 1, 2), (2.0, 1, 5, 6)]


@pytest.mark.parametrize("acc", ["pld", "rdp"])
@pytest.mark.parametrize("sigma, count, m, K", CASES)
def test_fixed_count_cohort_is_gaussian_at_half_sigma(sigma, count, m, K, acc):
    ev = client_level_event("uniform", m, K, sigma, count, round=3, stage="agg")
    assert (ev.kind, ev.noise_multiplier, ev.sample_rate, ev.count) == (
        "gaussian",
        sigma / 2,
        1.0,
        count,
    )
    assert (ev.unit, ev.round, ev.stage, ev.note) == ("federation", 3, "agg", FIXED_COUNT_NOTE)
    ref = direct(dp_accounting.GaussianDpEvent(sigma / 2), count, acc)
    assert eps(ev, acc) == pytest.approx(ref, rel=1e-9)
    if acc == "pld":
        # closed form: count Gaussians of multiplier σ/2 are μ-GDP with μ = 2√count/σ;
        # the PLD estimate is pessimistic and tight
        closed = gdp_epsilon(2 * math.sqrt(count) / sigma, DELTA)
        assert closed * (1 - 1e-6) <= eps(ev) <= closed * 1.01


@pytest.mark.parametrize("acc", ["pld", "rdp"])
@pytest.mark.parametrize("sigma, count, m, K", CASES)
def test_poisson_and_all_match_dp_accounting(sigma, count, m, K, acc):
    q = m / K
    ev = client_level_event("poisson", m, K, sigma, count)
    assert (ev.kind, ev.noise_multiplier, ev.sample_rate) == ("poisson_gaussian", sigma, q)
    ref = direct(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count, acc)  # fmt: skip
    assert eps(ev, acc) == pytest.approx(ref, rel=1e-9)
    ev = client_level_event("all", 0, K, sigma, count)
    assert (ev.kind, ev.noise_multiplier, ev.sample_rate, ev.note) == ("gaussian", sigma, 1.0, "")
    ref = direct(dp_accounting.GaussianDpEvent(sigma), count, acc)
    assert eps(ev, acc) == pytest.approx(ref, rel=1e-9)
    if acc == "pld":
        closed = gdp_epsilon(math.sqrt(count) / sigma, DELTA)
        assert closed * (1 - 1e-6) <= eps(ev) <= closed * 1.01


@pytest.mark.parametrize("sigma, count, m, K", CASES)
def test_fixed_count_never_below_all_or_poisson(sigma, count, m, K):
    fixed = eps(client_level_event("uniform", m, K, sigma, count))
    assert fixed > eps(client_level_event("all", m, K, sigma, count))
    assert fixed > eps(client_level_event("poisson", m, K, sigma, count))


def test_whole_federation_cohort_is_all():
    a = client_level_event("all", 0, 7, 1.3, 4, round=1, stage="s", note="n")
    assert client_level_event("uniform", 7, 7, 1.3, 4, round=1, stage="s", note="n") == a
    assert client_level_event("uniform", 7.0, 7, 1.3, 4, round=1, stage="s", note="n") == a
    assert client_level_event("poisson", 7, 7, 1.3, 4, round=1, stage="s", note="n") == a
    # a fixed count keeps the caller's note and states the sensitivity
    ev = client_level_event("uniform", 3, 7, 1.3, 4, note="server noise")
    assert ev.note == f"server noise; {FIXED_COUNT_NOTE}"
    assert "2C" in FIXED_COUNT_NOTE and "add/remove" in FIXED_COUNT_NOTE


def test_zero_noise_and_zero_count():
    assert math.isinf(eps(client_level_event("uniform", 2, 5, 0.0, 3)))
    assert eps(client_level_event("uniform", 2, 5, 1.0, 0)) == 0.0


@pytest.mark.parametrize(
    "args, match",
    [
        (("random", 2, 5, 1.0, 1), "scheme"),
        (("uniform", 2, 5, -1.0, 1), "noise multiplier"),
        (("uniform", 2, 5, float("nan"), 1), "noise multiplier"),
        (("uniform", 0, 5, 1.0, 1), "clients_per_round"),
        (("poisson", 6, 5, 1.0, 1), "clients_per_round"),
        (("poisson", float("inf"), 5, 1.0, 1), "clients_per_round"),
        (("uniform", True, 5, 1.0, 1), "clients_per_round"),
        (("uniform", 2.5, 5, 1.0, 1), "whole number"),
        (("all", 0, 0, 1.0, 1), "total_clients"),
        (("all", 0, 5.0, 1.0, 1), "total_clients"),
        (("uniform", 2, 5, 1.0, -1), "count"),
    ],
)
def test_invalid_client_level_input(args, match):
    with pytest.raises(PrivacyError, match=match):
        client_level_event(*args)


def _hockey_stick(p, q, e, z):
    return np.trapezoid(np.maximum(0.0, p - math.exp(e) * q), z)


def test_fixed_count_cohort_needs_sensitivity_2c():
    """The derivation, checked numerically on the smallest case: D holds two clients whose
    clipped updates are -C, the cohort is m = 1 of K; x contributes +C (C = 1, σ = 1).
    M(D) = N(-1, 1); M(D ∪ {x}) = ⅔ N(-1, 1) + ⅓ N(+1, 1) (x is drawn w.p. m/(K+1) and
    displaces the other). Its privacy profile (both directions) stays below the Gaussian
    of multiplier σ/2 (μ = 2) and exceeds the sensitivity-C Gaussian (μ = 1) — so
    accounting it at σ would understate ε."""
    z = np.linspace(-40.0, 40.0, 400_001)
    p = norm.pdf(z, -1.0, 1.0)
    q = (2 / 3) * norm.pdf(z, -1.0, 1.0) + (1 / 3) * norm.pdf(z, 1.0, 1.0)
    exceeded = False
    for e in np.linspace(0.0, 8.0, 33):
        d = max(_hockey_stick(q, p, e, z), _hockey_stick(p, q, e, z))
        assert d <= gdp_delta(2.0, e) + 1e-9
        exceeded |= d > 2 * gdp_delta(1.0, e)
    assert exceeded


@pytest.mark.parametrize("acc", ["pld", "rdp"])
@pytest.mark.parametrize(
    "scheme, m, K, target",
    [("uniform", 3, 10, 2.0), ("uniform", 1, 2, 8.0), ("poisson", 3, 10, 2.0), ("all", 0, 10, 2.0)],
)
def test_calibrate_client_level(scheme, m, K, target, acc):
    releases = 30
    sigma = calibrate_client_level(target, scheme, m, K, releases, DELTA, acc)
    achieved = eps(client_level_event(scheme, m, K, sigma, releases), acc)
    assert achieved <= target
    assert achieved >= 0.99 * target
    if scheme == "uniform":
        assert sigma == 2.0 * calibrate_noise(target, 1.0, releases, DELTA, acc)
        # ... and the plain-Gaussian calibration (sensitivity C) would overshoot the target
        assert eps(client_level_event("uniform", m, K, sigma / 2, releases), acc) > target


def test_calibrate_client_level_rejects_bad_input():
    with pytest.raises(PrivacyError, match="scheme"):
        calibrate_client_level(1.0, "shuffle", 2, 5, 10, DELTA)
    with pytest.raises(PrivacyError, match="target epsilon"):
        calibrate_client_level(0.0, "uniform", 2, 5, 10, DELTA)
    with pytest.raises(PrivacyError, match="steps"):
        calibrate_client_level(1.0, "uniform", 2, 5, 0, DELTA)


def test_ledger_states_the_neighbouring_relation():
    assert NEIGHBOURING == {"sample": "add/remove one example", "client": "add/remove one client"}
    for level in ("sample", "client"):
        led = Ledger(level, DELTA)
        # σ = 4 (three Gaussians at σ/2 = 2), not 1: the ε compared below is the same
        # either way, and its PLD at σ/2 = 0.5 took most of this test
        led.record(client_level_event("uniform", 2, 5, 4.0, 3, round=0))
        d = led.state_dict()
        assert d["neighbouring"] == NEIGHBOURING[level] == led.neighbouring
        back = Ledger.from_state_dict(d)
        assert back.events == led.events and back.neighbouring == NEIGHBOURING[level]
        # a ledger written before the field existed still loads (same version)
        old = {k: v for k, v in d.items() if k != "neighbouring"}
        assert old["version"] == 1
        assert Ledger.from_state_dict(old).epsilon() == led.epsilon()
    assert Ledger("none", DELTA).state_dict()["neighbouring"] is None
    d = Ledger("sample", DELTA).state_dict()
    with pytest.raises(PrivacyError, match="neighbouring"):
        Ledger.from_state_dict(dict(d, neighbouring="replace one example"))
    with pytest.raises(PrivacyError, match="neighbouring"):
        Ledger.from_state_dict(dict(d, neighbouring=NEIGHBOURING["client"]))
