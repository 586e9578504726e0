"""Language-model membership signals against slow, obvious references (Python loops over
tokens and over the vocabulary) on random logits."""

import math
import zlib

import numpy as np
import pytest

from attacks import lm_signals as lm


def _random_case(seed=0, n=5, t=9, v=13, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, t, v)) * scale
    targets = rng.integers(0, v, size=(n, t))
    mask = rng.random((n, t)) < 0.7
    mask[:, 0] = True  # every sequence has a scored token
    mask[1, 1:] = False  # one sequence with a single scored token
    return logits, targets, mask


def _slow_token(logits_row, target):
    """log p(target), μ and σ of one position by loops over the vocabulary."""
    mx = max(logits_row)
    lse = mx + math.log(sum(math.exp(z - mx) for z in logits_row))
    lps = [z - lse for z in logits_row]
    mu = sum(math.exp(lp) * lp for lp in lps)
    var = sum(math.exp(lp) * (lp - mu) ** 2 for lp in lps)
    return lps[target], mu, math.sqrt(var)


def _slow_sequences(logits, targets, mask, k):
    out = {"loss": [], "min_k": [], "min_k_pp": []}
    for i in range(len(logits)):
        lps, zs = [], []
        for t in range(len(logits[i])):
            if not mask[i][t]:
                continue
            lp, mu, sd = _slow_token(list(logits[i][t]), int(targets[i][t]))
            lps.append(lp)
            zs.append((lp - mu) / sd)
        take = max(1, math.ceil(k * len(lps) - 1e-9))
        out["loss"].append(-sum(lps) / len(lps))
        out["min_k"].append(sum(sorted(lps)[:take]) / take)
        out["min_k_pp"].append(sum(sorted(zs)[:take]) / take)
    return {key: np.asarray(v) for key, v in out.items()}


@pytest.mark.parametrize("k", [0.2, 0.5, 1.0, 0.05])
def test_signals_match_the_slow_reference(k):
    logits, targets, mask = _random_case()
    stats = lm.token_stats(logits.astype(np.float32), targets, mask, chunk_rows=7)
    ref = _slow_sequences(logits.astype(np.float32).astype(float), targets, mask, k)
    np.testing.assert_allclose(lm.sequence_loss(stats.logp, stats.mask), ref["loss"], rtol=1e-9)
    np.testing.assert_allclose(lm.min_k_prob(stats.logp, stats.mask, k), ref["min_k"], rtol=1e-9)
    np.testing.assert_allclose(lm.min_k_plus_plus(stats, k), ref["min_k_pp"], rtol=1e-8)
    np.testing.assert_allclose(lm.perplexity(ref["loss"]), np.exp(ref["loss"]), rtol=1e-12)


def test_token_stats_are_those_of_the_distribution():
    logits, targets, mask = _random_case(seed=3, n=2, t=4, v=6)
    s = lm.token_stats(logits, targets, mask)
    for i, t in zip(*np.nonzero(mask)):
        lp, mu, sd = _slow_token(list(logits[i, t]), int(targets[i, t]))
        assert s.logp[i, t] == pytest.approx(lp, rel=1e-12)
        assert s.mu[i, t] == pytest.approx(mu, rel=1e-12)
        assert s.sigma[i, t] == pytest.approx(sd, rel=1e-10)
    assert (s.logp[~mask] == 0).all()  # padding carries nothing


def test_min_k_takes_the_ceiling_of_k_T():
    logp = np.array([[-1.0, -5.0, -3.0, -2.0, -4.0, 0.0]])
    mask = np.array([[True] * 5 + [False]])  # the 0.0 at a padded position is never read
    assert lm.min_k_prob(logp, mask, 0.2)[0] == -5.0  # ⌈0.2·5⌉ = 1
    assert lm.min_k_prob(logp, mask, 0.3)[0] == -4.5  # ⌈1.5⌉ = 2
    assert lm.min_k_prob(logp, mask, 1.0)[0] == -3.0
    with pytest.raises(ValueError, match="fraction"):
        lm.min_k_prob(logp, mask, 0.0)


def test_a_certain_prediction_has_zero_standardized_surprise():
    logits = np.array([[[50.0, -50.0, -50.0], [1.0, 2.0, 3.0]]])
    s = lm.token_stats(logits, np.array([[0, 1]]), np.array([[True, True]]))
    z = lm.standardized_logp(s)
    assert z[0, 0] == 0.0 and np.isfinite(z).all()


def test_zlib_lowercase_and_reference():
    texts = ["aaaa aaaa aaaa aaaa", "The Quick Brown Fox, 42!", "ünïcödé ✓"]
    loss = np.array([2.0, 3.0, 4.0])
    zb = np.array([len(zlib.compress(t.encode("utf-8"))) for t in texts], float)
    np.testing.assert_array_equal(lm.zlib_bytes(texts), zb)
    np.testing.assert_allclose(lm.zlib_ratio(loss, texts), loss / zb)
    np.testing.assert_allclose(lm.lowercase_ratio(loss, [1.0, 2.0, 8.0]), [2.0, 1.5, 0.5])
    np.testing.assert_allclose(lm.reference_difference(loss, [1.0, 4.0, 4.0]), [1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="> 0"):
        lm.lowercase_ratio(loss, [1.0, 0.0, 1.0])


def test_scores_have_member_sign_and_subset():
    logits, targets, mask = _random_case(seed=1)
    stats = lm.token_stats(logits, targets, mask)
    texts = [f"text number {i}" for i in range(5)]
    sig = lm.LMSignals.from_stats(stats, texts, 0.2, lower=stats, base=stats.subset(range(5)))
    loss = lm.sequence_loss(stats.logp, stats.mask)
    np.testing.assert_allclose(lm.SCORES["lm_loss"](sig), -loss)
    np.testing.assert_allclose(lm.SCORES["lm_perplexity"](sig), -np.exp(loss))
    np.testing.assert_allclose(lm.SCORES["lm_reference"](sig), 0.0)
    np.testing.assert_allclose(lm.SCORES["lm_lowercase"](sig), -1.0)
    np.testing.assert_allclose(lm.SCORES["lm_zlib"](sig), -lm.zlib_ratio(loss, texts))
    np.testing.assert_allclose(lm.SCORES["lm_min_k"](sig), sig.min_k)
    np.testing.assert_allclose(sig.phi, -loss)
    np.testing.assert_allclose(sig.p_true, np.exp(-loss))
    sub = sig.subset([4, 0])
    np.testing.assert_array_equal(sub.loss, loss[[4, 0]])
    np.testing.assert_array_equal(sub.loss_lower, loss[[4, 0]])


def test_concat_pads_batches():
    a = lm.token_stats(*_random_case(seed=2, n=2, t=3))
    b = lm.token_stats(*_random_case(seed=4, n=3, t=6))
    c = lm.TokenStats.concat([a, b])
    assert c.mask.shape == (5, 6)
    np.testing.assert_array_equal(
        lm.sequence_loss(c.logp, c.mask),
        np.concatenate([lm.sequence_loss(x.logp, x.mask) for x in (a, b)]),
    )


def test_bad_input_is_named():
    logits, targets, mask = _random_case()
    with pytest.raises(ValueError, match=r"\(n, T, V\)"):
        lm.token_stats(logits[0], targets, mask)
    bad = targets.copy()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="targets must lie"):
        lm.token_stats(logits, bad, mask)
    empty = mask.copy()
    empty[2] = False
    with pytest.raises(ValueError, match="no scored token"):
        lm.token_stats(logits, targets, empty)
    nan = logits.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        lm.token_stats(nan, targets, mask)


def test_next_token_targets_shift_and_loss_mask():
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0]])
    att = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    tgt, m = lm.next_token_targets(ids, att)
    np.testing.assert_array_equal(tgt, [[6, 7, 0], [9, 0, 0]])
    np.testing.assert_array_equal(m, [[1, 1, 0], [1, 0, 0]])
    resp = np.array([[0, 0, 1, 1], [0, 1, 1, 1]])  # response tokens only (padding dropped)
    _, m2 = lm.next_token_targets(ids, att, resp)
    np.testing.assert_array_equal(m2, [[0, 1, 0], [1, 0, 0]])


def test_perplexities_are_token_weighted():
    logits, targets, mask = _random_case(seed=5, n=6)
    stats = lm.token_stats(logits, targets, mask)
    base = lm.token_stats(logits * 0.5, targets, mask)
    sig = lm.LMSignals.from_stats(stats, ["t"] * 6, base=base)
    role = np.array(["member", "member", "test", "member", "test", "test"])
    got = lm.perplexities(sig, role)
    for r in ("member", "test"):
        rows = [i for i in range(6) if role[i] == r]
        for key, st in (("adapter", stats), ("base", base)):
            lps = [st.logp[i, t] for i in rows for t in range(mask.shape[1]) if mask[i, t]]
            assert got[r][key] == pytest.approx(math.exp(-sum(lps) / len(lps)), rel=1e-12)
        assert got[r]["tokens"] == int(mask[rows].sum()) and got[r]["sequences"] == 3
