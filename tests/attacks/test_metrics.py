"""Tests for attacks.metrics: ROC against sklearn, known-answer TPR@FPR, bootstrap, plotting."""

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score, roc_curve

from attacks.metrics import plot_roc, roc_curve_np, roc_metrics


def _gaussian_data(rng, n, mu):
    """Half members N(mu, 1), half non-members N(0, 1); returns (scores, is_member)."""
    y = np.zeros(n, dtype=bool)
    y[: n // 2] = True
    s = rng.normal(size=n) + mu * y
    return s, y


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n_levels", [3, 20, None])
def test_roc_matches_sklearn_with_ties(seed, n_levels):
    rng = np.random.default_rng(seed)
    n = 400 + 100 * seed
    y = rng.random(n) < 0.3 + 0.1 * seed
    # Integer scores force many ties; None = continuous scores (no ties).
    s = rng.integers(0, n_levels, n).astype(float) if n_levels else rng.normal(size=n)
    s = s + 0.7 * y  # some signal so the curve is not trivial

    fpr, tpr, thr = roc_curve_np(s, y)
    fpr_sk, tpr_sk, thr_sk = roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, fpr_sk, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tpr, tpr_sk, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(thr[1:], thr_sk[1:])  # [0] is +inf (ours) vs max+1 or inf

    res = roc_metrics(s, y, n_bootstrap=0)
    assert res["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert res["advantage"] == pytest.approx(np.max(tpr_sk - fpr_sk), abs=1e-12)
    assert res["balanced_accuracy"] == pytest.approx(np.max((tpr_sk + 1 - fpr_sk) / 2), abs=1e-12)
    assert res["n_members"] == int(y.sum()) and res["n_nonmembers"] == int((~y).sum())
    assert "ci" not in res


def test_tpr_at_fpr_is_conservative_on_hand_example():
    # Sorted: 4(m) 3(n) 2(m) 1(n) -> ROC points (0,0) (0,.5) (.5,.5) (.5,1) (1,1).
    s = np.array([4.0, 3.0, 2.0, 1.0])
    y = np.array([1, 0, 1, 0])
    res = roc_metrics(s, y, fprs=(0.0, 0.49, 0.5, 1.0), n_bootstrap=0)
    tpr = res["tpr_at_fpr"]
    assert tpr["0.0"] == 0.5 and tpr["0.49"] == 0.5  # no interpolation towards (0.5, 1)
    assert tpr["0.5"] == 1.0 and tpr["1.0"] == 1.0
    assert tpr["0.001"] == 0.5 and tpr["0.01"] == 0.5  # defaults always present
    assert res["auc"] == pytest.approx(0.75)
    assert res["advantage"] == pytest.approx(0.5)
    assert res["balanced_accuracy"] == pytest.approx(0.75)


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_tpr_at_fpr_matches_gaussian_theory(mu):
    rng = np.random.default_rng(42)
    n = 400_000  # 200k per class
    s, y = _gaussian_data(rng, n, mu)
    res = roc_metrics(s, y, fprs=(0.001, 0.01, 0.1), n_bootstrap=0)
    n_pos = n_neg = n // 2
    for f in (0.001, 0.01, 0.1):
        z = norm.ppf(1 - f)
        truth = 1 - norm.cdf(z - mu)  # TPR of the Neyman-Pearson threshold at FPR f
        # Tolerance: delta-method standard error of the empirical TPR at an estimated FPR
        # quantile, sqrt(TPR(1-TPR)/n_pos + slope^2 f(1-f)/n_neg) with slope = dTPR/dFPR =
        # exp(mu z - mu^2/2), times 5, plus the conservative (<= 1 non-member step) bias.
        slope = np.exp(mu * z - mu**2 / 2)
        se = np.sqrt(truth * (1 - truth) / n_pos + slope**2 * f * (1 - f) / n_neg)
        tol = 5 * se + slope / n_neg
        assert abs(res["tpr_at_fpr"][str(f)] - truth) < tol, (f, res["tpr_at_fpr"], truth, tol)
    # Closed forms too: AUC = Phi(mu / sqrt 2), advantage = 2 Phi(mu / 2) - 1.
    assert res["auc"] == pytest.approx(norm.cdf(mu / np.sqrt(2)), abs=5e-3)
    assert res["advantage"] == pytest.approx(2 * norm.cdf(mu / 2) - 1, abs=1e-2)


def test_perfect_separation():
    rng = np.random.default_rng(1)
    y = rng.random(1000) < 0.5
    s = np.where(y, 10 + rng.random(1000), rng.random(1000))
    res = roc_metrics(s, y, fprs=(0.0,), n_bootstrap=50)
    assert res["auc"] == 1.0
    assert res["advantage"] == 1.0 and res["balanced_accuracy"] == 1.0
    assert all(v == 1.0 for v in res["tpr_at_fpr"].values())
    assert res["ci"]["auc"] == pytest.approx([1.0, 1.0], abs=1e-12)
    # Reversing the scores gives the mirror image.
    assert roc_metrics(-s, y, n_bootstrap=0)["auc"] == 0.0


def test_identical_distributions_give_chance_auc():
    rng = np.random.default_rng(2)
    n1 = n2 = 20_000
    s = rng.normal(size=n1 + n2)
    y = np.arange(n1 + n2) < n1
    res = roc_metrics(s, y, n_bootstrap=0)
    sd = np.sqrt((n1 + n2 + 1) / (12 * n1 * n2))  # null sd of the Mann-Whitney AUC
    assert abs(res["auc"] - 0.5) < 5 * sd
    assert res["tpr_at_fpr"]["0.01"] == pytest.approx(0.01, abs=0.005)


def test_bootstrap_ci_contains_point_and_is_reproducible():
    rng = np.random.default_rng(3)
    s, y = _gaussian_data(rng, 20_000, 1.0)
    res = roc_metrics(s, y, fprs=(0.05,), n_bootstrap=200, seed=7, alpha=0.1)
    ci = res["ci"]
    lo, hi = ci["auc"]
    assert lo <= res["auc"] <= hi and hi - lo < 0.03
    lo, hi = ci["advantage"]
    assert lo <= res["advantage"] <= hi
    assert set(ci["tpr_at_fpr"]) == {"0.001", "0.01", "0.05"}
    for k, (lo, hi) in ci["tpr_at_fpr"].items():
        assert lo <= res["tpr_at_fpr"][k] <= hi, k
    again = roc_metrics(s, y, fprs=(0.05,), n_bootstrap=200, seed=7, alpha=0.1)
    assert again["ci"] == ci
    # A narrower interval at a larger alpha.
    wide = roc_metrics(s, y, fprs=(0.05,), n_bootstrap=200, seed=7, alpha=0.01)["ci"]["auc"]
    assert wide[0] <= ci["auc"][0] and wide[1] >= ci["auc"][1]


def test_roc_is_downsampled_and_keeps_endpoints():
    rng = np.random.default_rng(4)
    s, y = _gaussian_data(rng, 50_000, 0.5)
    roc = roc_metrics(s, y, n_bootstrap=0)["roc"]
    f, t = np.array(roc["fpr"]), np.array(roc["tpr"])
    assert 100 < f.size <= 2000 and f.size == t.size
    assert (f[0], t[0]) == (0.0, 0.0) and (f[-1], t[-1]) == (1.0, 1.0)
    assert np.all(np.diff(f) >= 0) and np.all(np.diff(t) >= 0)
    assert np.sum(f < 1e-3) >= 20  # low-FPR region kept in detail


@pytest.mark.parametrize(
    "scores, labels, match",
    [
        ([0.1, np.nan, 0.3], [1, 0, 1], "NaN"),
        ([0.1, np.inf, 0.3], [1, 0, 1], "Inf"),
        ([0.1, 0.2], [1, 0, 1], "same length"),
        ([[0.1, 0.2]], [[1, 0]], "1-D"),
        ([], [], "empty"),
        ([0.1, 0.2, 0.3], [1, 1, 1], "both classes"),
        ([0.1, 0.2, 0.3], [0, 0, 0], "both classes"),
        ([0.1, 0.2, 0.3], [0, 2, 1], "0/1"),
    ],
)
def test_input_validation(scores, labels, match):
    with pytest.raises(ValueError, match=match):
        roc_metrics(scores, labels, n_bootstrap=0)


def test_parameter_validation():
    s, y = [0.1, 0.2, 0.3], [0, 1, 1]
    with pytest.raises(ValueError, match="alpha"):
        roc_metrics(s, y, alpha=1.0)
    with pytest.raises(ValueError, match="fprs"):
        roc_metrics(s, y, fprs=(1.5,))
    with pytest.raises(ValueError, match="n_bootstrap"):
        roc_metrics(s, y, n_bootstrap=-1)


def test_plot_roc_writes_png_and_svg(tmp_path):
    rng = np.random.default_rng(5)
    results = {}
    for name, mu in [("loss", 0.3), ("lira", 1.0), ("perfect", 20.0)]:
        s, y = _gaussian_data(rng, 4000, mu)
        results[name] = roc_metrics(s, y, n_bootstrap=0)
    png, svg = plot_roc(results, tmp_path / "figs" / "roc", title="test")
    assert png == tmp_path / "figs" / "roc.png" and svg == tmp_path / "figs" / "roc.svg"
    assert png.stat().st_size > 1000 and svg.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert "<svg" in text and "TPR@1%FPR" in text and "AUC=" in text
    with pytest.raises(ValueError, match="empty"):
        plot_roc({}, tmp_path / "x")
