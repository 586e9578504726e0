"""Tests of fl.linalg: every factored computation against its dense reference (float64)."""

import math

import pytest
import torch

from fl import linalg as L
from fl.methods.fedask import fedask_layer

DT = torch.float64


def clients(K=4, m=40, n=30, r=3, seed=0, shared_A=False, ranks=None):
    g = torch.Generator().manual_seed(seed)
    ranks = ranks or [r] * K
    A0 = torch.randn(ranks[0], n, generator=g, dtype=DT)
    Bs = [torch.randn(m, rk, generator=g, dtype=DT) for rk in ranks]
    As = [A0.clone() if shared_A else torch.randn(rk, n, generator=g, dtype=DT) for rk in ranks]
    w = torch.rand(K, generator=g, dtype=DT) + 0.1
    return Bs, As, (w / w.sum()).tolist()


def rel(a, b):
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def best_rank_error(M, r):
    s = torch.linalg.svdvals(M)
    return float(torch.sqrt((s[r:] ** 2).sum()))


def test_weighted_sum_and_dense_sum():
    Bs, As, w = clients()
    ref = sum(p * B @ A for p, B, A in zip(w, Bs, As))
    assert rel(L.dense_sum(Bs, As, w), ref) < 1e-14
    assert rel(L.weighted_sum(Bs, w), sum(p * B for p, B in zip(w, Bs))) < 1e-15
    assert torch.allclose(L.weighted_sum(Bs, None), sum(Bs) / len(Bs))
    with pytest.raises(ValueError):
        L.weighted_sum(Bs, w[:-1])


def test_factored_norm_inner_and_sum_norm():
    Bs, As, w = clients()
    B1, A1, B2, A2 = Bs[0], As[0], Bs[1], As[1]
    M1, M2 = B1 @ A1, B2 @ A2
    assert abs(float(L.factored_fro_norm(B1, A1)) - float(torch.linalg.norm(M1))) < 1e-12
    assert abs(float(L.factored_fro_inner(B1, A1, B2, A2)) - float((M1 * M2).sum())) < 1e-10
    S = L.dense_sum(Bs, As, w)
    assert abs(float(L.factored_sum_norm(Bs, As, w)) / float(torch.linalg.norm(S)) - 1) < 1e-13
    # rank-deficient / zero update: clamped to exactly 0, never NaN
    z = L.factored_fro_norm(torch.zeros(5, 2, dtype=DT), torch.randn(2, 7, dtype=DT))
    assert float(z) == 0.0


def test_apply_sum_and_transpose():
    Bs, As, w = clients()
    S = L.dense_sum(Bs, As, w)
    X, Y = torch.randn(30, 5, dtype=DT), torch.randn(40, 5, dtype=DT)
    assert rel(L.apply_sum(Bs, As, w, X), S @ X) < 1e-13
    assert rel(L.apply_sum_t(Bs, As, w, Y), S.T @ Y) < 1e-13


def test_truncated_svd_factors_match_dense_svd():
    Bs, As, w = clients(ranks=[2, 3, 4, 1], K=4)
    S = L.dense_sum(Bs, As, w)
    U, s, Vh = torch.linalg.svd(S)
    for r in (1, 3, 6):
        for split in ("sqrt", "left", "right"):
            B, A = L.truncated_svd_factors(Bs, As, w, r, split)
            assert B.shape == (40, r) and A.shape == (r, 30)
            assert rel(B @ A, U[:, :r] * s[:r] @ Vh[:r]) < 1e-10
    Uf, sf, Vhf = L.factored_svd(Bs, As, w)
    assert torch.allclose(sf, s[: sf.shape[0]], atol=1e-12)
    # rank above rank(S) = 10: exact and zero-padded
    B, A = L.truncated_svd_factors(Bs, As, w, 12)
    assert B.shape == (40, 12) and rel(B @ A, S) < 1e-12
    assert float(B[:, 10:].abs().max()) == 0.0


def test_aggregation_error_factored_vs_dense():
    Bs, As, w = clients()
    S = L.dense_sum(Bs, As, w)
    Bg, Ag = L.fedavg_aggregate(Bs, As, w)
    dense = float(torch.linalg.norm(Bg @ Ag - S) / torch.linalg.norm(S))
    assert abs(float(L.aggregation_error(Bg, Ag, Bs, As, w)) - dense) < 1e-12
    Bf, Af = L.flora_stack(Bs, As, w)
    assert float(L.aggregation_error(Bf, Af, Bs, As, w)) < 1e-13


def test_fedavg_cross_term():
    Bs, As, w = clients()
    assert float(L.aggregation_error(*L.fedavg_aggregate(Bs, As, w), Bs, As, w)) > 0.1
    Bs2, As2, w2 = clients(shared_A=True)
    assert float(L.aggregation_error(*L.fedavg_aggregate(Bs2, As2, w2), Bs2, As2, w2)) < 1e-13
    Bsame = [Bs[0].clone() for _ in Bs]  # equal B_k, different A_k: also exact
    assert float(L.aggregation_error(*L.fedavg_aggregate(Bsame, As, w), Bsame, As, w)) < 1e-13


def test_ffa_and_fedsa():
    Bs, As, w = clients(shared_A=True)
    B, A = L.ffa_aggregate(Bs, As, w)
    assert float(L.aggregation_error(B, A, Bs, As, w)) < 1e-13
    Bs, As, w = clients()
    with pytest.raises(ValueError):
        L.ffa_aggregate(Bs, As, w)
    assert rel(L.fedsa_aggregate(As, w), sum(p * A for p, A in zip(w, As))) < 1e-15


def test_flora_exact_with_heterogeneous_ranks():
    Bs, As, w = clients(ranks=[1, 2, 5], K=3)
    B, A = L.flora_stack(Bs, As, w)
    assert B.shape == (40, 8) and A.shape == (8, 30)
    assert rel(B @ A, L.dense_sum(Bs, As, w)) < 1e-14


def test_flexlora():
    Bs, As, w = clients(ranks=[2, 4, 3], K=3)
    S = L.dense_sum(Bs, As, w)
    B, A = L.flexlora_aggregate(Bs, As, w)  # full rank 9: exact
    assert rel(B @ A, S) < 1e-12
    Bi, Ai = L.flexlora_redistribute(B, A, 2)
    assert Bi.shape == (40, 2)
    err = float(torch.linalg.norm(Bi @ Ai - S))
    assert abs(err - best_rank_error(S, 2)) < 1e-10
    B4, A4 = L.flexlora_aggregate(Bs, As, w, rank=4)
    Bi4, Ai4 = L.flexlora_redistribute(B4, A4, 2)  # top-2 of top-4 == top-2
    assert rel(Bi4 @ Ai4, Bi @ Ai) < 1e-10


def test_hetlora_pad_truncate_aggregate():
    Bs, As, w = clients(ranks=[2, 4, 3], K=3)
    Bp, Ap = L.hetlora_pad(Bs[0], As[0], 6)
    assert Bp.shape == (40, 6) and Ap.shape == (6, 30)
    assert rel(Bp @ Ap, Bs[0] @ As[0]) < 1e-15
    Bt, At = L.hetlora_truncate(Bp, Ap, 2)
    assert torch.equal(Bt, Bs[0]) and torch.equal(At, As[0])
    with pytest.raises(ValueError):
        L.hetlora_pad(Bs[1], As[1], 3)
    hw = L.hetlora_weights(Bs, As)
    norms = torch.stack([torch.linalg.norm(B @ A) for B, A in zip(Bs, As)])
    assert torch.allclose(hw, norms / norms.sum()) and abs(float(hw.sum()) - 1) < 1e-14
    B, A = L.hetlora_aggregate(Bs, As, 4)
    padded = [L.hetlora_pad(b, a, 4) for b, a in zip(Bs, As)]
    assert torch.allclose(B, sum(p * b for p, (b, _) in zip(hw, padded)))
    assert torch.allclose(A, sum(p * a for p, (_, a) in zip(hw, padded)))


def test_fold_unfold_roundtrip():
    g = torch.Generator().manual_seed(3)
    B, A = torch.randn(20, 6, generator=g, dtype=DT), torch.randn(6, 15, generator=g, dtype=DT)
    keep = [4, 1]
    (Bd, Ad), Bk, Ak = L.fold_modules(B, A, keep)
    assert torch.equal(Bk, B[:, [4, 1]]) and torch.equal(Ad, A[[0, 2, 3, 5]])
    dense, _, _ = L.fold_modules(B, A, keep, dense=True)
    assert rel(dense + Bk @ Ak, B @ A) < 1e-14
    B2, A2 = L.unfold_modules(Bk, Ak, keep, Bd, Ad)
    assert torch.equal(B2, B) and torch.equal(A2, A)
    with pytest.raises(ValueError):
        L.fold_modules(B, A, [1, 1])


def test_plora_aggregate_per_module():
    g = torch.Generator().manual_seed(4)
    m, n, R = 10, 8, 4
    GB, GA = torch.randn(m, R, generator=g, dtype=DT), torch.randn(R, n, generator=g, dtype=DT)
    mods = []
    for idx in ([0, 1], [1, 2], [2, 1]):
        mods.append(
            (
                idx,
                torch.randn(m, 2, generator=g, dtype=DT),
                torch.randn(2, n, generator=g, dtype=DT),
            )
        )
    w = [0.5, 0.3, 0.2]
    GB0, GA0 = GB.clone(), GA.clone()
    B, A = L.plora_aggregate(GB, GA, mods, w)
    assert torch.equal(B[:, 0], mods[0][1][:, 0]) and torch.equal(A[0], mods[0][2][0])
    exp_B1 = (0.5 * mods[0][1][:, 1] + 0.3 * mods[1][1][:, 0] + 0.2 * mods[2][1][:, 1]) / 1.0
    assert torch.allclose(B[:, 1], exp_B1)
    exp_A2 = (0.3 * mods[1][2][1] + 0.2 * mods[2][2][0]) / 0.5
    assert torch.allclose(A[2], exp_A2)
    assert torch.equal(B[:, 3], GB[:, 3]) and torch.equal(A[3], GA[3])  # untrained: kept
    assert torch.equal(GB, GB0) and torch.equal(GA, GA0)  # inputs not modified


def test_gaussian_sketch_deterministic_any_dtype():
    a = L.gaussian_sketch(30, 5, seed=7, dtype=DT)
    b = L.gaussian_sketch(30, 5, seed=7, dtype=DT)
    c = L.gaussian_sketch(30, 5, seed=7, dtype=torch.float32)
    assert torch.equal(a, b) and torch.allclose(a.float(), c)
    assert not torch.equal(a, L.gaussian_sketch(30, 5, seed=8, dtype=DT))


def test_fedask_exact_with_shared_A():
    Bs, As, w = clients(shared_A=True, r=3)
    B, A = fedask_layer(Bs, As, w, rank=3, oversketch=0, seed=1)
    assert float(L.aggregation_error(B, A, Bs, As, w)) < 1e-10
    Y = L.weighted_sum([L.sketch(b, a, L.gaussian_sketch(30, 3, 1, DT)) for b, a in zip(Bs, As)], w)
    Q = L.sketch_basis(Y)
    assert torch.allclose(Q.T @ Q, torch.eye(3, dtype=DT), atol=1e-13)
    Yt = L.weighted_sum([L.project(b, a, Q) for b, a in zip(Bs, As)], w)
    assert rel(Yt, L.dense_sum(Bs, As, w).T @ Q) < 1e-13


@pytest.mark.parametrize("K,r", [(3, 2), (4, 3)])
def test_fedask_exactness_width_independent_A(K, r):
    """Measured condition: exact iff width >= rank(S) = K r (independent clients)."""
    Bs, As, w = clients(K=K, r=r, seed=11)
    S = L.dense_sum(Bs, As, w)
    d = K * r
    assert int(torch.linalg.matrix_rank(S)) == d
    U, s, Vh = torch.linalg.svd(S)
    best_r = U[:, :r] * s[:r] @ Vh[:r]

    def err_vs_tsvd(width, rank):
        B, A = fedask_layer(Bs, As, w, rank=rank, oversketch=width - rank, seed=5)
        ref = U[:, :rank] * s[:rank] @ Vh[:rank]
        return rel(B @ A, ref)

    assert err_vs_tsvd(r, r) > 1e-3  # width r: far from exact
    assert err_vs_tsvd(d - 1, r) > 1e-4  # one short: still inexact
    assert err_vs_tsvd(d, r) < 1e-10  # width = rank(S): rank-r truncated SVD exactly
    B, A = fedask_layer(Bs, As, w, rank=d, oversketch=0, seed=5)
    assert float(L.aggregation_error(B, A, Bs, As, w)) < 1e-10  # rank = width = d: S itself
    assert (
        rel(
            L.truncated_svd_factors(Bs, As, w, r)[0] @ L.truncated_svd_factors(Bs, As, w, r)[1],
            best_r,
        )
        < 1e-10
    )


def test_principal_angles_known_rotation():
    d = 12
    Q = torch.linalg.qr(torch.randn(d, d, dtype=DT, generator=torch.Generator().manual_seed(0)))[0]
    angles = torch.tensor([1e-7, 0.3, 1.2], dtype=DT)
    U = Q[:, :3]
    V = Q[:, :3] * torch.cos(angles) + Q[:, 3:6] * torch.sin(angles)
    got = L.principal_angles(U, V @ torch.randn(3, 3, dtype=DT))  # non-orthonormal basis
    assert torch.allclose(got, angles, rtol=1e-8, atol=1e-14)
    assert abs(float(L.largest_principal_angle(U, V)) - 1.2) < 1e-12
    assert float(L.largest_principal_angle(U, U)) < 1e-14
    assert abs(float(L.largest_principal_angle(U, Q[:, 3:6])) - math.pi / 2) < 1e-12
    assert abs(float(L.rowspace_angle(U.T, V.T)) - 1.2) < 1e-12
    # different dimensions: min(p, q) angles
    assert L.principal_angles(Q[:, :2], Q[:, :5]).shape == (2,)


def test_subspace_iteration_converges():
    g = torch.Generator().manual_seed(9)
    m, n, r = 50, 40, 4
    U0 = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=DT))[0]
    V0 = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))[0]
    sv = torch.cat(
        [torch.tensor([10.0, 8.0, 6.0, 5.0], dtype=DT), torch.logspace(0, -2, 36, dtype=DT)]
    )
    W = U0[:, :40] * sv @ V0.T
    U, S, Vt = L.subspace_iteration(lambda X: W @ X, lambda Y: W.T @ Y, n, r, iters=12, seed=2)
    assert U.shape == (m, r) and S.shape == (r,) and Vt.shape == (r, n)
    assert float(L.largest_principal_angle(U, U0[:, :r])) < 1e-6
    assert float(L.rowspace_angle(Vt, V0[:, :r].T)) < 1e-6
    assert torch.allclose(S, sv[:r], rtol=1e-10)
    err = float(torch.linalg.norm(W - U * S @ Vt))
    assert abs(err - best_rank_error(W, r)) < 1e-9
