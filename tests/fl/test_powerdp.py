"""Tests of fl.privacy.powerdp (float64): exactness at σ=0, clipping, sensitivity, noise scale."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fl import linalg as L
from fl.privacy import powerdp as P
from fl.privacy.accounting import calibrate_noise

DT = torch.float64


def gapped_clients(K=4, m=40, n=30, r=3, seed=0):
    """K rank-r clients whose average W̄ (weights 1/K) has singular values
    [10, 8, 6] then a gap to [1 .. 0.1]: the top-3 subspace is well separated."""
    g = torch.Generator().manual_seed(seed)
    d = K * r
    U0 = torch.linalg.qr(torch.randn(m, d, generator=g, dtype=DT))[0]
    V0 = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=DT))[0]
    R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))[0]
    sv = torch.cat(
        [torch.tensor([10.0, 8.0, 6.0], dtype=DT), torch.linspace(1.0, 0.1, d - 3, dtype=DT)]
    )
    Bc, Ac = (U0 * sv) @ R, R.T @ V0.T
    w = [1.0 / K] * K
    Bs = [Bc[:, k * r : (k + 1) * r] * K for k in range(K)]
    As = [Ac[k * r : (k + 1) * r] for k in range(K)]
    return Bs, As, w


def tsvd(M, r):
    U, s, Vh = torch.linalg.svd(M)
    return U[:, :r], s[:r], Vh[:r]


def best_rank_error(M, r):
    s = torch.linalg.svdvals(M)
    return float(torch.sqrt((s[r:] ** 2).sum()))


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("dense", [False, True])
def test_powerdp_sigma0_equals_truncated_svd(dense):
    Bs, As, w = gapped_clients()
    W = L.dense_sum(Bs, As, w)
    U, s, Vh = tsvd(W, 3)
    B, A, rec = P.powerdp(
        Bs, As, w, rank=3, iters=8, noise_multiplier=0.0, clip=1e6, dense=dense, seed=3
    )
    assert B.shape == (40, 3) and A.shape == (3, 30)
    assert torch.allclose(A @ A.T, torch.eye(3, dtype=DT), atol=1e-12)  # orthonormal rows
    G = B.T @ B
    assert torch.allclose(G, torch.diag(torch.diagonal(G)), atol=1e-10)  # orthogonal columns
    assert float(L.largest_principal_angle(B, U)) < 1e-6
    assert float(L.rowspace_angle(A, Vh)) < 1e-6
    err = float(torch.linalg.norm(B @ A - W))
    assert abs(err - best_rank_error(W, 3)) < 1e-8
    assert torch.allclose(torch.linalg.norm(B, dim=0), s, rtol=1e-10)
    assert len(rec) == P.releases_per_round(8) == 17
    assert all(r["noise_std"] == 0.0 for r in rec) and rec[-1].get("final")


def test_powerdp_dense_and_factored_agree_with_noise():
    Bs, As, w = gapped_clients()
    out = []
    for dense in (False, True):
        g = torch.Generator().manual_seed(42)
        out.append(
            P.powerdp(
                Bs, As, w, 3, 2, noise_multiplier=0.5, clip=5.0, generator=g, dense=dense, seed=1
            )
        )
    assert torch.allclose(out[0][0] @ out[0][1], out[1][0] @ out[1][1], atol=1e-10)
    assert out[0][2] == out[1][2]
    rec = out[0][2]
    assert len(rec) == 5 and [r["side"] for r in rec] == ["W", "Wt", "W", "Wt", "W"]
    for r in rec:
        assert r["what"] == "projection" and r["sensitivity"] == pytest.approx(5.0 / 4)
        assert r["noise_std"] == pytest.approx(0.5 * 5.0 / 4) and r["noise_multiplier"] == 0.5


def test_powerdp_argument_checks():
    Bs, As, w = gapped_clients()
    with pytest.raises(ValueError):
        P.powerdp(Bs, As, w, 3, 1, noise_multiplier=1.0, clip=1.0, generator=None)
    with pytest.raises(ValueError):
        P.powerdp(Bs, As, w, 3, 1, noise_multiplier=1.0, clip=math.inf, generator=torch.Generator())


def test_comparison_mechanisms_sigma0():
    Bs, As, w = gapped_clients()
    W = L.dense_sum(Bs, As, w)
    U, s, Vh = tsvd(W, 3)
    ref = U * s @ Vh
    for fn in (P.input_perturbation, P.output_perturbation):
        B, A, rec = fn(Bs, As, w, 3, noise_multiplier=0.0, clip=1e6)
        assert torch.linalg.norm(B @ A - ref) / torch.linalg.norm(ref) < 1e-10
        assert all(r["noise_std"] == 0.0 for r in rec)
    B, A, rec = P.no_perturbation(Bs, As, w, 3)
    assert torch.linalg.norm(B @ A - ref) / torch.linalg.norm(ref) < 1e-10 and rec == []


def test_output_perturbation_calibrations():
    Bs, As, w = gapped_clients()
    g = torch.Generator().manual_seed(0)
    B, A, rec = P.output_perturbation(Bs, As, w, 3, noise_multiplier=1.0, clip=2.0, generator=g)
    assert [r["what"] for r in rec] == ["factor_B", "factor_A"]
    assert rec[0]["sensitivity"] == pytest.approx(4.0)  # 2·C_B, C_B = C
    assert rec[1]["sensitivity"] == pytest.approx(2 * math.sqrt(3))  # 2√r
    _, _, rec = P.output_perturbation(Bs, As, w, 3, 1.0, 2.0, g, calibration="heuristic")
    assert all(r["heuristic"] and r["sensitivity"] == pytest.approx(0.5) for r in rec)


# ---------------------------------------------------------------------------- clipping


def test_clip_factored_bounds_norm():
    g = torch.Generator().manual_seed(1)
    B, A = torch.randn(20, 3, generator=g, dtype=DT), torch.randn(3, 15, generator=g, dtype=DT)
    true = float(torch.linalg.norm(B @ A))
    Bc, Ac, norm, f = P.clip_factored(B, A, 1.0)
    assert float(norm) == pytest.approx(true, rel=1e-12)
    assert float(torch.linalg.norm(Bc @ Ac)) == pytest.approx(1.0, rel=1e-12)
    assert torch.equal(Ac, A) and float(f) == pytest.approx(1.0 / true)
    Bc, Ac, _, f = P.clip_factored(B, A, 2 * true)  # under the bound: untouched
    assert float(f) == 1.0 and torch.equal(Bc, B)


@pytest.mark.parametrize("bad", ["nan_B", "inf_A"])
def test_clip_factored_zeroes_nonfinite(bad):
    """The one policy (fl.privacy.clipping): a non-finite update contributes zero."""
    B, A = torch.ones(4, 2, dtype=DT), torch.ones(2, 5, dtype=DT)
    if bad == "nan_B":
        B[1, 1] = float("nan")
    else:
        A[0, 3] = float("inf")
    Bc, Ac, norm, f = P.clip_factored(B, A, 1.0)
    assert not math.isfinite(float(norm)) and float(f) == 0.0
    assert float(Bc.abs().sum()) == 0.0 and float(Ac.abs().sum()) == 0.0


def test_clip_factored_norm_in_float64_does_not_overflow():
    # finite float32 factors whose norm overflows float32: clipped, not rejected
    B, A = torch.full((4, 2), 1e20), torch.full((2, 5), 1e20)
    Bc, Ac, norm, f = P.clip_factored(B, A, 1.0)
    assert math.isfinite(float(norm)) and 0.0 < float(f) < 1.0
    assert float(torch.linalg.matrix_norm(Bc.double() @ Ac.double())) == pytest.approx(1.0)


# -------------------------------------------------------------------------- sensitivity


@settings(max_examples=25, deadline=None)
@given(
    K=st.integers(1, 6),
    r=st.integers(1, 3),
    k=st.integers(1, 4),
    scale=st.floats(0.01, 100.0),
    clip=st.floats(0.1, 10.0),
    k_expected=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
    add=st.booleans(),
)
def test_projection_sensitivity_never_exceeded(K, r, k, scale, clip, k_expected, seed, add):
    """For a neighbouring pair (one client added/removed) the actual change of W̄X and
    W̄ᵀP never exceeds Δ = C/K_expected."""
    g = torch.Generator().manual_seed(seed)
    m, n = 12, 9
    Bs = [scale * torch.randn(m, r, generator=g, dtype=DT) for _ in range(K + 1)]
    As = [torch.randn(r, n, generator=g, dtype=DT) for _ in range(K + 1)]
    Bs, As, _ = P.clip_clients(Bs, As, clip)
    p = 1.0 / k_expected
    small = (Bs[:K], As[:K])  # S
    big = (Bs, As)  # S ∪ {j}
    if not add:  # remove a random member instead (same pair, other direction)
        big, small = (Bs[:K], As[:K]), (Bs[1:K], As[1:K]) if K > 1 else None
    X = L.orth(torch.randn(n, k, generator=g, dtype=DT))
    Pm = L.orth(torch.randn(m, k, generator=g, dtype=DT))
    bound = P.projection_sensitivity(clip, p)

    def proj(cl, M, t):
        if cl is None or not cl[0]:
            return torch.zeros(n if t else m, k, dtype=DT)
        f = L.apply_sum_t if t else L.apply_sum
        return f(cl[0], cl[1], [p] * len(cl[0]), M)

    d1 = float(torch.linalg.norm(proj(big, X, False) - proj(small, X, False)))
    d2 = float(torch.linalg.norm(proj(big, Pm, True) - proj(small, Pm, True)))
    assert d1 <= bound * (1 + 1e-9) and d2 <= bound * (1 + 1e-9)


# ------------------------------------------------------------------------ noise scale


def test_powerdp_noise_injected_at_stated_scale():
    """iters=0: B A X_0 = W̄ X_0 + G exactly, so the residual is the noise itself."""
    Bs, As, w = gapped_clients()
    sigma, clip = 0.7, 3.0
    Bc, Ac, _ = P.clip_clients(Bs, As, clip)
    X0 = P.initial_basis(30, 3, seed=5)
    exact = L.apply_sum(Bc, Ac, w, X0)
    g = torch.Generator().manual_seed(123)
    res = []
    for _ in range(200):
        B, A, rec = P.powerdp(Bs, As, w, 3, 0, sigma, clip, generator=g, seed=5)
        res.append(B @ (A @ X0) - exact)
    res = torch.stack(res)
    stated = rec[0]["noise_std"]
    assert stated == pytest.approx(sigma * clip / 4)
    assert abs(float(res.mean())) < 0.05 * stated
    assert float(res.std()) == pytest.approx(stated, rel=0.03)


def test_noisy_projection_transpose_and_input_perturbation_scale():
    Bs, As, w = gapped_clients()
    g = torch.Generator().manual_seed(7)
    Pm = L.orth(torch.randn(40, 3, dtype=DT, generator=g))
    exact = L.apply_sum_t(Bs, As, w, Pm)
    res = torch.stack(
        [P.noisy_projection(Bs, As, w, Pm, 0.25, g, transpose=True) - exact for _ in range(200)]
    )
    assert float(res.std()) == pytest.approx(0.25, rel=0.03)
    # input perturbation at full rank: B A = W̄ + G exactly
    Bc, Ac, _ = P.clip_clients(Bs, As, 2.0)
    W = L.dense_sum(Bc, Ac, w)
    B, A, rec = P.input_perturbation(Bs, As, w, 30, noise_multiplier=2.0, clip=2.0, generator=g)
    assert rec[0]["noise_std"] == pytest.approx(1.0)
    assert float((B @ A - W).std()) == pytest.approx(1.0, rel=0.05)


# --------------------------------------------------------------------------- accounting


def test_releases_and_calibration():
    assert [P.releases_per_round(i) for i in range(4)] == [1, 3, 5, 7]
    # q = 1: the same as calibrating rounds × releases plain Gaussian releases
    s = P.calibrate_powerdp_sigma(2.0, 1e-5, rounds=5, iters=2, client_rate=1.0)
    s_flat = calibrate_noise(2.0, 1.0, 25, 1e-5)
    assert s == pytest.approx(s_flat, rel=5e-3)
    assert P.powerdp_epsilon(s, 1e-5, 5, 2, 1.0) <= 2.0
    # q < 1: the achieved ε meets the target
    s = P.calibrate_powerdp_sigma(2.0, 1e-5, rounds=10, iters=1, client_rate=0.2)
    eps = P.powerdp_epsilon(s, 1e-5, 10, 1, 0.2)
    assert eps <= 2.0 and eps > 1.9


def test_data_dependent_denominator_breaks_the_bound():
    """Why the weight is fixed: with p = 1/|S| one added client moves W̄X by 2C/(|S|+1),
    twice the C/(|S|+1) a naive calibration would use."""
    g = torch.Generator().manual_seed(0)
    B = torch.randn(12, 1, generator=g, dtype=DT)
    A = torch.randn(1, 9, generator=g, dtype=DT)
    (B,), (A,), _ = P.clip_clients([B], [A], 1.0)
    X = torch.eye(9, dtype=DT)  # orthonormal columns
    before = L.apply_sum([B], [A], [1.0], X)  # |S| = 1, p = 1
    after = L.apply_sum([B, -B], [A, A], [0.5, 0.5], X)  # |S'| = 2, p = 1/2
    change = float(torch.linalg.norm(after - before))
    assert change == pytest.approx(1.0) and change > P.projection_sensitivity(1.0, 0.5) * 1.5


def test_sigma0_without_clipping_is_allowed():
    Bs, As, w = gapped_clients()
    ref = P.no_perturbation(Bs, As, w, 3)
    for fn in (P.input_perturbation, P.output_perturbation):
        B, A, rec = fn(Bs, As, w, 3, noise_multiplier=0.0, clip=math.inf)
        assert torch.allclose(B @ A, ref[0] @ ref[1], atol=1e-10)
        assert all(r["noise_std"] == 0.0 for r in rec)
    B, A, rec = P.powerdp(Bs, As, w, 3, 8, noise_multiplier=0.0, clip=math.inf)
    assert torch.allclose(B @ A, ref[0] @ ref[1], atol=1e-8)
    assert all(r["noise_std"] == 0.0 for r in rec)


@pytest.mark.parametrize("ranks", [(3, 3, 3, 3), (1, 4, 2, 3)])
@pytest.mark.parametrize("C", [0.5, 2.0, math.inf])
def test_clip_scales_equal_clip_factored_per_client(ranks, C):
    g = torch.Generator().manual_seed(7)
    Bs = [torch.randn(9, r, generator=g, dtype=torch.float64) for r in ranks]
    As = [torch.randn(r, 6, generator=g, dtype=torch.float64) / 3 for r in ranks]
    Bs[1] = torch.zeros_like(Bs[1])  # a zero update: factor 1, no division by zero
    scales = P.clip_scales(Bs, As, C)
    ref = torch.stack([P.clip_factored(B, A, C)[3] for B, A in zip(Bs, As)])
    assert torch.allclose(scales, ref, rtol=1e-12, atol=0)
    assert float(scales[1]) == 1.0
    if not math.isinf(C):  # the clipped updates have norm min(C, norm)
        for B, A, f in zip(Bs, As, scales):
            dense = torch.linalg.matrix_norm(f * B @ A)
            assert float(dense) <= C * (1 + 1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clip_scales_zero_non_finite_like_clip_factored(bad):
    Bs = [torch.ones(4, 2), torch.ones(4, 2)]
    As = [torch.ones(2, 3), torch.ones(2, 3)]
    As[1][0, 1] = bad
    scales = P.clip_scales(Bs, As, 1.0)
    assert float(scales[1]) == 0.0 and 0.0 < float(scales[0]) < 1.0
    assert float(P.clip_factored(Bs[1], As[1], 1.0)[3]) == 0.0


def test_powerdp_nonfinite_client_contributes_zero():
    Bs, As, w = gapped_clients()
    bad_B, bad_A = Bs[1].clone(), As[1].clone()
    bad_A[0, 0] = math.nan
    zero = [Bs[0], torch.zeros_like(Bs[1]), *Bs[2:]], [As[0], torch.zeros_like(As[1]), *As[2:]]
    for dense in (False, True):
        B, A, _ = P.powerdp([Bs[0], bad_B, *Bs[2:]], [As[0], bad_A, *As[2:]], w, 3, 4, 0.0, 5.0,
                            dense=dense)  # fmt: skip
        Bz, Az, _ = P.powerdp(*zero, w, 3, 4, 0.0, 5.0, dense=dense)
        assert bool(torch.isfinite(B).all()) and torch.allclose(B @ A, Bz @ Az, atol=1e-12)


def test_stacked_projection_equals_the_per_client_sum():
    g = torch.Generator().manual_seed(3)
    ranks = (2, 5, 1)
    Bs = [torch.randn(11, r, generator=g, dtype=torch.float64) for r in ranks]
    As = [torch.randn(r, 8, generator=g, dtype=torch.float64) for r in ranks]
    w = [0.2, 0.5, 0.3]
    X = torch.randn(8, 4, generator=g, dtype=torch.float64)
    Y = torch.randn(11, 4, generator=g, dtype=torch.float64)
    for weights in (w, torch.tensor(w, dtype=torch.float64)):
        st_ = L.stack_factors(Bs, As, weights)
        assert torch.allclose(L.apply_stacked(*st_, X), L.apply_sum(Bs, As, w, X), atol=1e-12)
        assert torch.allclose(
            L.apply_stacked(*st_, Y, transpose=True), L.apply_sum_t(Bs, As, w, Y), atol=1e-12
        )
        dense = L.dense_sum(Bs, As, w)
        assert torch.allclose(L.apply_stacked(*st_, X), dense @ X, atol=1e-12)


def _reference_powerdp(Bs, As, w, rank, iters, sigma, clip, gen, seed, noise_like):
    """The literal PowerDP in float64: every client's ΔW_k = B_k A_k formed, clipped by
    its dense Frobenius norm (a non-finite one contributes zero), W̄ = Σ p_k ΔW_k formed,
    then the noisy power iteration with noise drawn as powerdp draws it (the dtype of
    ``noise_like``) and Householder QR with diag(R) >= 0."""
    W = torch.zeros(Bs[0].shape[0], As[0].shape[1], dtype=DT)
    for p, B, A in zip(w, Bs, As):
        D = B.double() @ A.double()
        norm = float(torch.linalg.matrix_norm(D))
        if not math.isfinite(norm):
            continue
        W += p * min(1.0, clip / norm) * D if norm > 0 else p * D
    std = sigma * clip * max(abs(p) for p in w)

    def noise(shape):
        return P.gaussian_noise(shape, std, gen, noise_like).double() if sigma > 0 else 0.0

    def orth(M):
        Q, R = torch.linalg.qr(M)
        s = torch.sign(torch.diagonal(R))
        return Q * torch.where(s == 0, torch.ones_like(s), s)

    X = orth(L.gaussian_sketch(W.shape[1], rank, seed, dtype=DT))
    for _ in range(iters):
        Pm = orth(W @ X + noise((W.shape[0], rank)))
        X = orth(W.T @ Pm + noise((W.shape[1], rank)))
    Y = W @ X + noise((W.shape[0], rank))
    U, s, Zh = torch.linalg.svd(Y, full_matrices=False)
    return U[:, :rank] * s[:rank], (X @ Zh[:rank].T).T


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ranks", [(3, 3, 3, 3, 3), (1, 4, 2, 3, 2)])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_powerdp_matches_the_literal_reference(dtype, ranks, dense, bad):
    """The optimized path (stacked factors, batched Gram norms, two GEMMs a projection)
    against the slow literal one on small random clients, some clipped, one possibly
    non-finite; float32 to float32 rounding, float64 to 1e-9."""
    g = torch.Generator().manual_seed(11)
    Bs = [torch.randn(30, r, generator=g, dtype=DT) * (1 + k) for k, r in enumerate(ranks)]
    As = [torch.randn(r, 20, generator=g, dtype=DT) / 4 for r in ranks]
    if bad:
        Bs[2][1, 0] = math.nan
    Bs, As = [B.to(dtype) for B in Bs], [A.to(dtype) for A in As]
    w = [0.2] * len(ranks)
    clip, rank, iters, sigma = 1.5, 3, 3, 0.05
    B, A, rec = P.powerdp(
        Bs, As, w, rank, iters, sigma, clip, torch.Generator().manual_seed(5), dense, seed=2
    )
    Br, Ar = _reference_powerdp(
        Bs, As, w, rank, iters, sigma, clip, torch.Generator().manual_seed(5), 2, Bs[0]
    )
    assert B.dtype == dtype and len(rec) == P.releases_per_round(iters)
    M, Mr = (B @ A).double(), Br @ Ar
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    assert float(torch.linalg.matrix_norm(M - Mr)) <= tol * float(torch.linalg.matrix_norm(Mr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_client_fro_norms_equal_the_dense_norms(dtype):
    """linalg.client_fro_norms (float64 Grams, no m×n matrix) against ‖B_k A_k‖_F formed
    densely in float64, for mixed ranks, a zero client, a huge float32 one (its Gram
    would overflow in float32) and a NaN one."""
    g = torch.Generator().manual_seed(4)
    ranks = (2, 5, 1, 3, 2)
    Bs = [torch.randn(12, r, generator=g, dtype=DT) for r in ranks]
    As = [torch.randn(r, 7, generator=g, dtype=DT) for r in ranks]
    Bs[1] = torch.zeros_like(Bs[1])
    Bs[3] = Bs[3] * 1e30
    Bs[4][0, 0] = math.nan
    Bs, As = [B.to(dtype) for B in Bs], [A.to(dtype) for A in As]
    got = L.client_fro_norms(Bs, As)
    ref = torch.stack([torch.linalg.matrix_norm(B.double() @ A.double()) for B, A in zip(Bs, As)])
    assert got.dtype == torch.float64 and math.isnan(float(got[4]))
    assert torch.allclose(got[:4], ref[:4], rtol=1e-12, atol=0) and float(got[1]) == 0.0
    assert math.isfinite(float(got[3]))
