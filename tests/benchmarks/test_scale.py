"""benchmarks.perf.scale: the fits recover known coefficients from synthetic numbers, the
held-out error is measured on the largest model, and the tables format every row."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.perf import scale


def _grid():
    n = np.repeat([1.1e7, 3.8e7, 2.1e8, 6.4e8], 4)
    t = np.tile([128, 512, 128, 512], 4)
    return n, t


def test_the_time_fit_recovers_known_coefficients():
    n, t = _grid()
    y = 0.05 + 2.5e-10 * n * t
    rep = scale.fit_report(n, t, y, scale.time_features)
    np.testing.assert_allclose(rep["coef"], [0.05, 2.5e-10], rtol=1e-8)
    assert rep["max_rel_error"] < 1e-9 and rep["holdout_largest_rel_error"] < 1e-9
    assert scale.predict(rep, scale.time_features, 7e9, 512) == pytest.approx(
        0.05 + 2.5e-10 * 7e9 * 512
    )


def test_the_memory_fit_recovers_known_coefficients_under_noise():
    n, t = _grid()
    true = np.array([6e8, 4.2, 30.0])
    y = scale.memory_features(n, t) @ true
    rng = np.random.default_rng(0)
    rep = scale.fit_report(
        n, t, y * (1 + 0.01 * rng.standard_normal(len(y))), scale.memory_features
    )
    np.testing.assert_allclose(rep["coef"], true, rtol=0.1)
    assert 0.001 < rep["max_rel_error"] < 0.05


def test_a_negative_coefficient_is_dropped_and_the_rest_refitted():
    n, t = _grid()
    y = 3.0 + 0.0 * n + 1e-9 * n * t  # no per-parameter term
    x = np.stack([np.ones_like(n), n, n * t], axis=1)
    y = y * (1 - 1e-3 * (n / n.max()))  # a slight shrink that a free fit meets with m1 < 0
    c = scale.fit_linear(x, y)
    assert (c >= 0).all() and c[1] == 0


def test_the_tables_format_every_row_and_every_prediction():
    rows = []
    for n, hidden, layers in ((1.1e7, 256, 4), (6.4e8, 1536, 24)):
        for seq in (32, 128):
            rows.append(
                dict(
                    kind="llama",
                    hidden=hidden,
                    layers=layers,
                    parameters=int(n),
                    rank=8,
                    adapter_parameters=26624,
                    seq=seq,
                    batch=4,
                    tokens=4 * seq,
                    s_nodp=0.5,
                    s_dp=0.6,
                    mem_nodp=2**30,
                    mem_dp=1.5 * 2**30,
                    mem_rise_nodp=2**20,
                    mem_rise_dp=3 * 2**20,
                    grad_sample_bytes=4 * 26624 * 4,
                    base_grad_sample_bytes=int(4 * n * 4),
                )
            )
    md = scale.format_table(rows)
    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    assert "| 11.0 M | 256 × 4 | fp32 | 8 (26,624) | 128 (4 × 32) | 0.500 | 0.600 | 1.20 |" in md
    assert "1.00 GiB" in md and "1.50 GiB" in md and "416.0 KiB" in md
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    fits = {
        "s_nodp": {
            "coef": [0.1, 1e-10],
            "max_rel_error": 0.05,
            "rms_rel_error": 0.02,
            "holdout_largest_rel_error": 0.1,
        },
        "peak_memory": {
            "coef": [6e8, 4.0, 0.0],
            "max_rel_error": 0.01,
            "rms_rel_error": 0.01,
            "holdout_largest_rel_error": None,
        },
    }
    out = scale.format_fits(fits, [128, 512])
    assert "7B at T=512" in out and "| — |" in out and "10.0%" in out
    # 7 B parameters in fp32 at 4 bytes each plus 0.6 GB: 26.6 GiB
    assert f"{(6e8 + 4 * 6.74e9) / 2**30:.1f} GiB" in out


def test_the_texts_fill_every_batch_and_length_the_scripts_use():
    """Every example fills its L tokens (no padding: T = b × L exactly), also at the GPU
    script's batch 8 × 512 (a short corpus once left the last examples of a batch short)."""
    from fl.data.lm import LmTokenizedData
    from fl.models.pretrain import train_tokenizer

    tok = train_tokenizer(scale._texts(64, 32), 1024)
    for batch, seq in ((4, 32), (4, 128), (8, 128), (8, 512)):
        data = LmTokenizedData(scale._texts(batch, seq), tok, seq)
        assert int(data.lengths.min()) == seq
