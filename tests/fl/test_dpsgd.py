import math

import pytest
import torch
from scipy import stats

from fl.privacy.dpsgd import DpSgdParams, clip_and_noise, gaussian_noise, per_sample_norms

DT64 = torch.float64


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

    # a fixed key: the p-value cut-off must not fail at random on a fresh one
    src = NoiseKey(bytes(range(32))).stream("t") if keyed else torch.Generator().manual_seed(0)
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


# ---- the fused step (one norm, one product, one noise vector) ------------------------


def _params_with_nan(seed: int):
    """Three parameters of different shapes with per-sample gradients of mixed scale
    (some examples clipped, some not), one NaN and one Inf entry."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5, 8), (3,)]
    gss = [torch.randn((6, *s), generator=g) * torch.tensor([0.05, 3, 0.2, 5, 1, 0.1]).view(
        -1, *([1] * len(s))) for s in shapes]  # fmt: skip
    gss[0][2, 1, 3] = float("nan")
    gss[2][4, 0] = float("inf")
    return gss


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("b", [0, 6])
def test_fused_step_equals_per_parameter_path(keyed, b):
    """Same noise stream, the same released gradient to 1e-6, the same stats, as the
    per-parameter path it replaced; an empty batch is noise only, bit for bit."""
    from fl.privacy.dpsgd import clip_and_noise_per_parameter
    from fl.privacy.rng import NoiseKey

    key = NoiseKey.generate()

    def source():
        return key.stream("n", 1) if keyed else torch.Generator().manual_seed(5)

    gss = _params_with_nan(0)
    dp = DpSgdParams(noise_multiplier=1.1, clip=1.0, sample_rate=0.2, expected_batch=6.0)
    ps = [_param_with_samples(g.clone()) for g in gss]
    qs = [_param_with_samples(g.clone()) for g in gss]
    st = clip_and_noise(ps, dp, source(), b)
    ref = clip_and_noise_per_parameter(qs, dp, source(), b)
    for p, q in zip(ps, qs):
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad_sample is None
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6)
        if b == 0:
            assert torch.equal(p.grad, q.grad)
    assert {k: float(v) for k, v in st.items()} == pytest.approx(ref, rel=1e-6)
    # the noise alone: zero gradients give (noise / q·n) of the same draws, bit for bit
    zs = [_param_with_samples(torch.zeros_like(g)) for g in gss]
    clip_and_noise(zs, dp, source(), 6)
    s = source()
    for z in zs:
        assert torch.equal(z.grad, gaussian_noise(tuple(z.shape), 1.1, s) / 6.0)


def test_fused_clip_factors_against_per_example_reference():
    """The fused step's per-example clipping, example by example in float64: each
    example's joint norm over all parameters, c_i = min(1, C/(‖g_i‖ + 1e-6)), 0 for a
    non-finite norm; Σ_i c_i g_i / (q·n) with σ = 0."""
    from fl.privacy.dpsgd import device_clip_factors, flat_per_sample

    gss = _params_with_nan(1)
    ps = [_param_with_samples(g.clone()) for g in gss]
    norms = flat_per_sample(ps).square().sum(dim=1).sqrt()
    factor, st = device_clip_factors(norms, 0.9)
    ref_f, ref_n = [], []
    for i in range(6):
        sq = sum(float(g[i].double().pow(2).sum()) for g in gss)
        ref_n.append(math.sqrt(sq))
        ref_f.append(min(1.0, 0.9 / (math.sqrt(sq) + 1e-6)) if math.isfinite(sq) else 0.0)
    assert torch.allclose(factor.double(), torch.tensor(ref_f, dtype=torch.float64), rtol=1e-6)
    fin = [x for x in ref_n if math.isfinite(x)]
    assert float(st["mean_norm"]) == pytest.approx(sum(fin) / len(fin), rel=1e-6)
    assert float(st["frac_clipped"]) == pytest.approx(sum(x > 0.9 for x in fin) / len(fin))
    assert int(st["nonfinite"]) == 2
    dp = DpSgdParams(0.0, 0.9, 0.5, 3.0)
    clip_and_noise(ps, dp, None, 6)
    for p, g in zip(ps, gss):
        ref = sum(f * torch.nan_to_num(g[i].double(), nan=0.0, posinf=0.0, neginf=0.0)
                  for i, f in enumerate(ref_f)) / 3.0  # fmt: skip
        assert torch.allclose(p.grad.double(), ref, rtol=0, atol=1e-6)
    # no finite norm at all: mean NaN, nothing clipped, every example counted
    _, st = device_clip_factors(torch.tensor([float("nan"), float("inf")]), 1.0)
    assert math.isnan(float(st["mean_norm"])) and float(st["frac_clipped"]) == 0.0
    assert int(st["nonfinite"]) == 2


def test_fused_step_accumulates_low_precision_in_float32():
    from fl.privacy.dpsgd import flat_per_sample

    ps = [_param_with_samples(torch.randn(4, 3).bfloat16()), _param_with_samples(torch.randn(4))]
    g = flat_per_sample(ps)
    assert g.dtype == torch.float32 and g.shape == (4, 4)
    assert torch.equal(g[:, :3], ps[0].grad_sample.float())


_SYNCING = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy",
            "nonzero", "masked_select", "unique", "cpu"}  # fmt: skip


def test_fused_step_never_reads_a_device_value():
    """No host synchronization inside the step: no tensor is turned into a Python
    number, branched on, indexed by a boolean mask or moved to the host (checked on the
    CPU with a torch-function mode that sees every tensor call)."""
    from torch.overrides import TorchFunctionMode

    from fl.privacy.dpsgd import DpStats

    calls = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            bool_index = name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:]
            )
            if name in _SYNCING or bool_index:
                calls.append(name)
            return func(*args, **(kwargs or {}))

    dp = DpSgdParams(1.0, 1.0, 0.5, 3.0)
    acc = DpStats()
    for b in (6, 0):
        ps = [_param_with_samples(g.clone()) for g in _params_with_nan(2)]
        gen = torch.Generator().manual_seed(0)
        with Watch():
            st = clip_and_noise(ps, dp, gen, b)
            acc.add(st, b > 0)
        assert calls == [], calls
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in st.values())
        if b:
            full = {k: float(v) for k, v in st.items()}
    # read once, at the end: the non-empty step's stats, the non-finite examples summed
    s = acc.summary()
    assert s["nonfinite"] == 2 and isinstance(s["nonfinite"], int)
    assert s["mean_norm"] == full["mean_norm"] and s["frac_clipped"] == full["frac_clipped"]
    assert 0 < s["frac_clipped"] < 1 and s["mean_norm"] > 0
    assert DpStats().summary() == {"mean_norm": [], "frac_clipped": [], "nonfinite": 0}


def test_head_share_clips_each_group_against_per_example_reference():
    """head_share s: example by example (float64), the head part is clipped to C·√s and
    the rest to C·√(1−s), an example with a non-finite entry anywhere contributes
    nothing; each clipped example lies within C (the sensitivity the noise is calibrated
    to); the noise is the same draw as the joint path's."""
    g = torch.Generator().manual_seed(7)
    lora = torch.randn(8, 3, 4, generator=g) * 4
    head = torch.randn(8, 5, generator=g) * torch.tensor([0.1, 3, 0.2, 5, 1, 0.05, 2, 9])[:, None]
    lora[2, 1, 1] = float("nan")
    C, s = 1.3, 0.7
    dp = DpSgdParams(0.0, C, 0.5, 4.0, head_share=s)
    pl, ph = _param_with_samples(lora.clone()), _param_with_samples(head.clone())
    cols = torch.cat([torch.zeros(12, dtype=torch.bool), torch.ones(5, dtype=torch.bool)])
    st = clip_and_noise([pl, ph], dp, None, batch_size=8, head_cols=cols)
    ref_l, ref_h, clipped = torch.zeros(3, 4, dtype=DT64), torch.zeros(5, dtype=DT64), 0
    for i in range(8):
        a, b = lora[i].double(), head[i].double()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            continue
        na, nb = float(a.norm()), float(b.norm())
        fa = min(1.0, C * math.sqrt(1 - s) / (na + 1e-6))
        fb = min(1.0, C * math.sqrt(s) / (nb + 1e-6))
        assert math.hypot(fa * na, fb * nb) <= C + 1e-9
        clipped += (na > C * math.sqrt(1 - s)) or (nb > C * math.sqrt(s))
        ref_l += fa * a
        ref_h += fb * b
    assert torch.allclose(pl.grad.double(), ref_l / 4.0, atol=1e-6)
    assert torch.allclose(ph.grad.double(), ref_h / 4.0, atol=1e-6)
    assert int(st["nonfinite"]) == 1
    assert float(st["frac_clipped"]) == pytest.approx(clipped / 7)
    # the released noise is the joint path's draw (same σC, same order)
    dpn = DpSgdParams(1.1, C, 0.5, 4.0, head_share=s)
    zs = [_param_with_samples(torch.zeros(8, 3, 4)), _param_with_samples(torch.zeros(8, 5))]
    clip_and_noise(zs, dpn, torch.Generator().manual_seed(3), 8, head_cols=cols)
    src = torch.Generator().manual_seed(3)
    for z in zs:
        assert torch.equal(z.grad, gaussian_noise(tuple(z.shape), 1.1 * C, src) / 4.0)


def test_head_share_with_one_group_is_the_joint_clip():
    """With only head (or only non-head) coordinates trained, or s = 0, the step is the
    joint clip to C (a split would only shrink the sensitivity the noise assumes)."""
    from fl.privacy.dpsgd import split_bounds

    g = torch.Generator().manual_seed(8)
    gs = torch.randn(5, 6, generator=g) * 3
    for cols in (torch.ones(6, dtype=torch.bool), torch.zeros(6, dtype=torch.bool), None):
        p, q = _param_with_samples(gs.clone()), _param_with_samples(gs.clone())
        clip_and_noise([p], DpSgdParams(0.0, 1.0, 0.5, 2.0, head_share=0.5), None, 5, cols)
        clip_and_noise([q], DpSgdParams(0.0, 1.0, 0.5, 2.0), None, 5)
        assert torch.equal(p.grad, q.grad)
    half = torch.tensor([True, False] * 3)
    assert split_bounds(DpSgdParams(1.0, 2.0, 0.5, 2.0), half) is None
    hb, rb = split_bounds(DpSgdParams(1.0, 2.0, 0.5, 2.0, head_share=0.36), half)
    assert (hb, rb) == pytest.approx((1.2, 1.6))
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="head clip share"):
            DpSgdParams(1.0, 1.0, 0.5, 2.0, head_share=bad)
