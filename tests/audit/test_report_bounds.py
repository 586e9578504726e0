"""The report's empirical ε: each attack's member/non-member estimate is computed at α / k
so that their maximum holds at 1 − α jointly (a maximum of k at α each would hold only at
1 − kα); the verdict's certified bound is the one-run canary audit alone."""

from __future__ import annotations

import numpy as np
import pytest

from audit.bounds.hypothesis import epsilon_lower_bound
from audit.report.empirical import best_bound, empirical_bounds


def _row(tmp_path, k: int, shift: float = 1.5):
    rng = np.random.default_rng(0)
    is_member = np.arange(4000) < 2000
    scores = {f"attack{j}": rng.normal(size=is_member.size) + shift * is_member for j in range(k)}
    p = tmp_path / "scores.npz"
    np.savez(p, ids=np.arange(is_member.size).astype(str), is_member=is_member, **scores)
    return {"scores_path": str(p), "delta": 1e-5}, scores, is_member


@pytest.mark.parametrize("k", [1, 3])
def test_each_attack_at_alpha_over_k(tmp_path, k):
    row, scores, m = _row(tmp_path, k)
    bounds = empirical_bounds(row, alpha=0.05)
    assert len(bounds) == 2 * k
    for b in bounds:
        s = scores[b["attack"]]
        ref = epsilon_lower_bound(s[m], s[~m], 1e-5, alpha=0.05 / k, method=b["method"])
        assert b["epsilon_lb"] == ref["epsilon_lb"] and b["alpha"] == pytest.approx(0.05 / k)
        assert b["family_alpha"] == 0.05
    if k > 1:  # the correction costs something: the same scores at α give a larger bound
        s = scores["attack0"]
        naive = epsilon_lower_bound(s[m], s[~m], 1e-5, alpha=0.05)["epsilon_lb"]
        cp0 = next(
            b for b in bounds if b["attack"] == "attack0" and b["method"] == "clopper_pearson"
        )
        assert 0 < cp0["epsilon_lb"] < naive
    # one model's member/non-member scores are not independent trials: however well the
    # attacks separate them (here CP > 0), they never become the certified bound
    row["bounds"] = bounds
    assert max(b["epsilon_lb"] for b in bounds if b["method"] == "clopper_pearson") > 0
    assert best_bound(row) is None


def test_the_certified_bound_is_the_one_run_canary_audit(tmp_path):
    row, _, _ = _row(tmp_path, 2)
    row["bounds"] = empirical_bounds(row, alpha=0.05)
    row["audit"] = {"one_run": {"epsilon_lb": 0.25, "alpha": 0.05, "m": 1000}}
    best = best_bound(row)
    assert max(b["epsilon_lb"] for b in row["bounds"]) > 0.25  # the estimates are larger
    assert best == {
        "epsilon_lb": 0.25,
        "source": "1000 canaries, one run",
        "alpha": 0.05,
        "steinke": 0.25,
        "fdp": None,
    }
    # white-box gradient canaries: Steinke et al.'s and the f-DP bound side by side, the
    # claim tested with the joint one (the larger of the two, each at α/2)
    row["audit"] = {
        "one_run": {
            "epsilon_lb": 0.25,
            "alpha": 0.05,
            "m": 5000,
            "kind": "gradient",
            "fdp": {"epsilon_lb": 0.31},
            "claim_check": {"epsilon": 8.0, "delta": 1e-5, "epsilon_lb": 0.29, "exceeds": False},
        }
    }
    row["audit"]["one_run"]["delta"] = 1e-5
    best = best_bound(row)
    assert (best["epsilon_lb"], best["steinke"], best["fdp"]) == (0.29, 0.25, 0.31)
    assert best["source"] == "5000 gradient canaries, one run" and best["limit"] == 8.0
    from audit.report.verdict_table import empirical_cell as _empirical_cell

    assert _empirical_cell(best) == (
        "[0.29, ∞) at 95% (Steinke 0.25, f-DP 0.31; each at 95%) · 5000 gradient canaries, one run"
    )
    assert best_bound({}) is None
