"""The noise-implied ε never raises on what was observed (audit.claims.implied): a noise
factor of 0 (noise never added), a factor that is not a number (a release with NaN or
Inf) and an effective σ so small that ε leaves the float range all give ε = ∞; the
findings' codes for the first two exist (audit.findings)."""

import math

import pytest

from audit.claims.implied import epsilon_of_scaled_claim, epsilon_of_scaled_events, noise_finding
from audit.claims.mistakes import Mech
from audit.findings import Code, Severity
from fl.privacy.accounting import Event

POISSON, PLAIN = Mech(True, 0.1, 10), Mech(False, 1.0, 10)


@pytest.mark.parametrize("mech", [POISSON, PLAIN], ids=["poisson", "plain"])
@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan, math.inf, None])
def test_claim_at_a_factor_without_noise_is_infinite(mech, factor):
    assert epsilon_of_scaled_claim(mech, 1.0, factor, 1e-5) == (math.inf, False)


def test_claim_at_a_tiny_sigma_is_infinite_not_an_error():
    # σ·factor = 1e-300: the μ-GDP solver would overflow; the PLD grid would too
    assert epsilon_of_scaled_claim(PLAIN, 1e-300, 1.0, 1e-5) == (math.inf, False)
    assert epsilon_of_scaled_claim(PLAIN, 1.0, 5e-324, 1e-5) == (math.inf, False)
    assert epsilon_of_scaled_claim(POISSON, 1e-300, 1.0, 1e-5)[0] == math.inf
    # an ordinary factor still gives the claim's figure (finite, ε falls as σ grows)
    e1, _ = epsilon_of_scaled_claim(PLAIN, 1.0, 1.0, 1e-5)
    e2, _ = epsilon_of_scaled_claim(PLAIN, 1.0, 0.5, 1e-5)
    assert 0 < e1 < e2 < math.inf


@pytest.mark.parametrize("factor", [0.0, math.nan, math.inf])
def test_events_at_a_factor_without_noise_are_infinite(factor):
    ev = Event("poisson_gaussian", 1.0, 0.1, 10, "c0")
    assert epsilon_of_scaled_events([[ev]], factor, 1e-5) == (math.inf, False)


def test_events_whose_sigma_underflows_are_infinite():
    ev = Event("gaussian", 1e-300, 1.0, 10, "c0")
    eps, _ = epsilon_of_scaled_events([[ev]], 0.5, 1e-5)
    assert eps == math.inf


def test_noise_finding_names_the_two_cases():
    assert noise_finding(0.0)[0] == "noise_absent"
    assert noise_finding(math.nan)[0] == "release_nonfinite"
    assert noise_finding(math.inf)[0] == "release_nonfinite"
    assert noise_finding(0.3) is None and noise_finding(1.0) is None
    for code in ("noise_absent", "release_nonfinite", "sensitivity_exceeded",
                 "data_dependent_release", "replay_empty"):  # fmt: skip
        assert Code(code).severity is Severity.ERROR and not Code(code).tampering


def test_gdp_epsilon_or_inf_never_raises():
    """μ = 2/(σ·f) at f → 0 (Flower's LocalDpMod implied ε): ∞, not ZeroDivisionError or the
    solver's ValueError; an ordinary μ gives gdp_epsilon's value."""
    from audit.bounds.hypothesis import gdp_epsilon
    from audit.claims.implied import gdp_epsilon_or_inf

    for mu in (math.inf, math.nan, 2e300, 1e151, "x"):
        assert gdp_epsilon_or_inf(mu, 1e-5) == math.inf
    assert gdp_epsilon_or_inf(1.5, 1e-5) == gdp_epsilon(1.5, 1e-5)
