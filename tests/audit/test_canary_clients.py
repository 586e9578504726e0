"""The canary-client estimates (audit.canaries.clients): the Gaussian fit on synthetic
scores, and the one-run audit of tiny client-level runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from audit.bounds.hypothesis import gdp_epsilon
from audit.canaries.clients import gaussian_fit
from fl.privacy import rng as R

KEY = R.NoiseKey(bytes(range(1, 33)))


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.0])
def test_gaussian_fit_recovers_mu(mu):
    rng = np.random.default_rng(1)
    n = 20000
    scale, shift = 0.01, 0.002  # cosines: small and shifted, as in a run
    x = np.concatenate([rng.normal(mu, 1, n), rng.normal(0, 1, n)]) * scale + shift
    y = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    fit = gaussian_fit(x, y, 1e-5, n_boot=200)
    se = math.sqrt(2 / n + mu * mu / (4 * n))
    assert abs(fit["mu"] - mu) < 4 * se
    assert fit["mu_se_analytic"] == pytest.approx(se, rel=0.05)
    assert fit["epsilon"] == pytest.approx(gdp_epsilon(fit["mu"], 1e-5))
    lo, hi = fit["mu_interval"]
    assert lo < fit["mu"] < hi and lo < mu + 4 * se and hi > mu - 4 * se
    assert fit["kind"] == "estimate"


def test_gaussian_fit_negative_mu_is_zero_epsilon():
    rng = np.random.default_rng(2)
    x = np.r_[rng.normal(-1, 1, 500), rng.normal(0, 1, 500)]
    y = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    fit = gaussian_fit(x, y, 1e-5, n_boot=50)
    assert fit["mu"] < 0 and fit["epsilon"] == 0.0


def _train(tmp, **kw):
    from fl.run.engine import train
    from fl.testing import tiny_config

    base = dict(
        dp_level="client", clients=3, members=60, local_steps=1, test=20, nonmembers=10, clip=0.5
    )
    return train(tiny_config(**{**base, **kw}), tmp, quiet=True, noise_key=KEY)


def test_honest_run_is_not_flagged_and_one_run_audit_reports_both(tmp_path):
    from audit.bundle.audit import audit_run

    _train(tmp_path, epsilon=8.0, canary_clients=300)
    out = audit_run(tmp_path, one_run=True)
    o = out["one_run"]
    assert o["kind"] == "canary_clients" and o["m"] == 300
    assert 0 <= o["epsilon_lb"] <= out["epsilon_pld"]
    assert not o["claim_check"]["exceeds"]
    assert "empirical_exceeds_claim" not in [f["code"] for f in out["findings"]]
    for name in ("all_iterates", "final_model"):
        st = o["statistics"][name]
        assert st["certified"]["alpha"] == pytest.approx(0.025)
        assert st["estimate"]["kind"] == "estimate"
    assert "not a bound" in o["labels"]["estimate"]


def test_all_iterates_estimate_close_to_ledger(tmp_path):
    """Every client in every round, canaries with disjoint supports: the Gaussian-fit
    estimate is near the ledger's ε (fixed key: deterministic; the
    table in docs/audit.md has more canaries and ε)."""
    from audit.canaries.clients import audit

    m = _train(tmp_path, epsilon=3.0, canary_clients=2000, rounds=2)
    eps = m["privacy"]["epsilon"]["pld"]
    res = audit(tmp_path, m["privacy"]["delta"], 0.05, eps)
    est = res["statistics"]["all_iterates"]["estimate"]
    assert est["epsilon"] == pytest.approx(eps, rel=0.15)
    lo, hi = est["epsilon_interval"]
    assert lo <= eps <= hi
    assert res["epsilon_lb"] <= eps
