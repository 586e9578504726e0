import math

import pytest
import torch
from scipy import stats

from fl.privacy.dpsgd import DpSgdParams, clip_and_noise, gaussian_noise, per_sample_norms


def _param_with_samples(gs):
    p = torch.nn.Parameter(torch.zeros(gs.shape[1:]))
    p.grad_sample = gs
    return p


def test_clipping_matches_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 3, 4, generator=g) * 3
    b = torch.randn(6, 5, generator=g) * 3
    pa, pb = _param_with_samples(a.clone()), _param_with_samples(b.clone())
    dp = DpSgdParams(noise_multiplier=0.0, clip=1.5, sample_rate=0.5, expected_batch=4.0)
    clip_and_noise([pa, pb], dp, None, batch_size=6)
    # slow obvious reference: per example, flatten, clip jointly, sum, divide.
    ref_a, ref_b = torch.zeros(3, 4), torch.zeros(5)
    for i in range(6):
        norm = math.sqrt(float(a[i].pow(2).sum() + b[i].pow(2).sum()))
        f = min(1.0, 1.5 / (norm + 1e-6))
        ref_a += f * a[i]
        ref_b += f * b[i]
    assert torch.allclose(pa.grad, ref_a / 4.0, atol=1e-6)
    assert torch.allclose(pb.grad, ref_b / 4.0, atol=1e-6)
    assert pa.grad_sample is None


def test_nan_gradient_does_not_pass_as_small():
    gs = torch.ones(3, 4)
    gs[1, 2] = float("nan")
    gs[2, 0] = float("inf")
    p = _param_with_samples(gs)
    dp = DpSgdParams(0.0, 10.0, 0.5, 1.0)
    st = clip_and_noise([p], dp, None, batch_size=3)
    assert st["nonfinite"] == 2
    assert torch.isfinite(p.grad).all()
    assert torch.allclose(p.grad, torch.ones(4))  # only example 0 contributes


def test_zero_gradient_model_drifts_by_sigma_c_lr_over_batch():
    """SGD on a loss with zero gradient: after T steps each coordinate is
    N(0, T·(lr·σ·C/B)²) — the noise is really added, at the stated scale."""
    sigma, C, lr, B, T, d = 1.3, 0.7, 0.05, 8.0, 25, 20000
    p = torch.nn.Parameter(torch.zeros(d))
    opt = torch.optim.SGD([p], lr=lr)
    gen = torch.Generator().manual_seed(1)
    dp = DpSgdParams(sigma, C, 0.1, B)
    for _ in range(T):
        p.grad_sample = torch.zeros(5, d)
        clip_and_noise([p], dp, gen, batch_size=5)
        opt.step()
    expected = math.sqrt(T) * lr * sigma * C / B
    x = p.detach().numpy() / expected
    assert abs(x.std() - 1.0) < 0.03
    assert abs(x.mean()) < 0.03
    assert stats.kstest(x, "norm").pvalue > 1e-3


@pytest.mark.parametrize("keyed", [False, True])
def test_noise_distribution(keyed):
    from fl.privacy.rng import NoiseKey

    src = NoiseKey.generate().stream("t") if keyed else torch.Generator().manual_seed(0)
    z = gaussian_noise((50000,), 2.0, src).numpy()
    assert abs(z.mean()) < 0.05 and abs(z.std() - 2.0) < 0.05
    assert stats.kstest(z / 2.0, "norm").pvalue > 1e-3


def test_per_sample_norms():
    gs1, gs2 = torch.randn(4, 3), torch.randn(4, 2, 2)
    p1, p2 = _param_with_samples(gs1), _param_with_samples(gs2)
    ref = torch.sqrt((gs1**2).sum(1) + (gs2**2).sum((1, 2)))
    assert torch.allclose(per_sample_norms([p1, p2]), ref, atol=1e-6)


def test_invalid_params():
    for bad in (dict(noise_multiplier=-1), dict(clip=0), dict(sample_rate=0)):
        kw = dict(noise_multiplier=1.0, clip=1.0, sample_rate=0.1, expected_batch=1.0)
        kw.update(bad)
        with pytest.raises(ValueError):
            DpSgdParams(**kw)


def test_clip_factors_and_clipped_sum_match_reference():
    """The shared helpers of clip_and_noise and W-space clipping, example by example."""
    from fl.privacy.dpsgd import clip_factors, clipped_sum

    norms = torch.tensor([0.5, 2.0, float("nan"), 4.0, float("inf")])
    factor, st = clip_factors(norms, 1.0)
    ref = [min(1.0, 1.0 / (float(x) + 1e-6)) if math.isfinite(float(x)) else 0.0 for x in norms]
    assert torch.allclose(factor, torch.tensor(ref), atol=0, rtol=1e-6)
    assert st == {
        "mean_norm": pytest.approx(6.5 / 3),
        "frac_clipped": pytest.approx(2 / 3),
        "nonfinite": 2,
    }
    gs = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    gs[1, 2] = float("nan")
    p = _param_with_samples(gs)
    expect = sum(ref[i] * torch.nan_to_num(gs[i], nan=0.0) for i in range(5))
    assert torch.allclose(clipped_sum(p, factor), expect, atol=1e-6)
    assert torch.equal(clipped_sum(p, None), torch.zeros(3))
