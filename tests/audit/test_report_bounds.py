"""The report's empirical ε lower bound is the largest over the run's attacks, so each
attack's bound is computed at α / k and the maximum holds at 1 − α jointly (a maximum of
k bounds at α each would hold only at 1 − kα)."""

from __future__ import annotations

import numpy as np
import pytest

from audit.empirical import epsilon_lower_bound
from audit.report_empirical import best_bound, empirical_bounds


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
    row["bounds"] = bounds
    best = best_bound(row)
    cps = [b["epsilon_lb"] for b in bounds if b["method"] == "clopper_pearson"]
    assert best["epsilon_lb"] == max(cps) and best["alpha"] == pytest.approx(0.05)


def test_a_one_run_bound_beside_the_attacks_adds_its_alpha(tmp_path):
    row, _, _ = _row(tmp_path, 2)
    row["bounds"] = empirical_bounds(row, alpha=0.05)
    row["audit"] = {"one_run": {"epsilon_lb": 99.0, "alpha": 0.05, "m": 1000}}
    best = best_bound(row)
    assert best == {"epsilon_lb": 99.0, "source": "1000 canaries, one run", "alpha": 0.1}
    del row["bounds"]
    assert best_bound(row)["alpha"] == pytest.approx(0.05)  # the one-run bound alone
    assert best_bound({}) is None
