"""Gaussian test matrices and what is built on them: FedASK's two-stage sketch
(Y_k = B_k(A_kΩ), Q = orth(ΣY), Ỹ_k = A_kᵀ(B_kᵀQ), refactor) and the non-private
subspace (power) iteration."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fl.linalg.core import Tensor, orth
from fl.linalg.svd import factors_from_svd


def gaussian_sketch(
    n: int,
    width: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Gaussian test matrix Ω (n×width), entries N(0, 1) — FedASK's Ω.

    Drawn in float64 on the CPU from ``torch.Generator().manual_seed(seed)`` and
    then cast/moved, so every process and machine (CPU or GPU, any dtype) that uses
    the same seed gets the same Ω (up to the final cast).
    """
    if n <= 0 or width <= 0:
        raise ValueError(f"sketch shape must be positive, got {n}×{width}")
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    om = torch.randn(n, width, generator=g, dtype=torch.float64, device="cpu")
    return om.to(dtype=dtype, device=device)


def sketch(B: Tensor, A: Tensor, Omega: Tensor) -> Tensor:
    """Client sketch Y_k = B_k (A_k Ω): B (m×r), A (r×n), Ω (n×w) -> m×w."""
    return B @ (A @ Omega)


def sketch_basis(Y: Tensor) -> Tensor:
    """Q (m×w, orthonormal columns) from the reduced QR of the aggregated sketch
    Y = Σ p_k Y_k (m×w). If w > m, Q is m×m."""
    return orth(Y)


def project(B: Tensor, A: Tensor, Q: Tensor) -> Tensor:
    """Client projection Ỹ_k = A_kᵀ (B_kᵀ Q) = (B_k A_k)ᵀ Q: Q (m×w) -> n×w."""
    return A.mT @ (B.mT @ Q)


def refactor(Q: Tensor, Y_tilde: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """FedASK's final server step.

    Ỹ = Σ p_k Ỹ_k (n×w) equals Sᵀ Q, so Ỹᵀ = Qᵀ S (w×n). With the SVD
    Ỹᵀ = U Σ Vᵀ keep the top ``rank`` triplets and return
    B = Q U_r Σ_r^{1/2} (m×r), A = Σ_r^{1/2} V_rᵀ (r×n), so B A is the best rank-r
    approximation of Q Qᵀ S. If fewer than ``rank`` singular values exist the extra
    columns/rows are zero.
    """
    U, s, Vh = torch.linalg.svd(Y_tilde.mT, full_matrices=False)
    return factors_from_svd(Q @ U, s, Vh, rank, "sqrt")


def subspace_iteration(
    matvec: Callable[[Tensor], Tensor],
    rmatvec: Callable[[Tensor], Tensor],
    n: int,
    rank: int,
    iters: int,
    seed: int = 0,
    oversample: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Non-private simultaneous power iteration for the top-``rank`` SVD of an implicit
    W (m×n), given ``matvec`` X ↦ W X (n×k -> m×k) and ``rmatvec`` Y ↦ Wᵀ Y (m×k -> n×k).

    k = rank + oversample columns; X_0 = orth(gaussian_sketch(n, k, seed)); each
    iteration X ← orth(Wᵀ orth(W X)) (iters × (1 matvec + 1 rmatvec)); finally
    Y = W X (one more matvec), SVD Y = U_y Σ Zᵀ, and W ≈ U_y Σ (X Z)ᵀ = W X Xᵀ.
    Returns U (m×rank), S (rank,), Vt (rank×n). The row-space error decays like
    (σ_{k+1}/σ_rank)^{2·iters}. This is the same iteration as
    :func:`fl.privacy.powerdp.powerdp` without noise.
    """
    k = int(rank) + int(oversample)
    X = orth(gaussian_sketch(n, k, seed, dtype=dtype, device=device))
    for _ in range(int(iters)):
        X = orth(rmatvec(orth(matvec(X))))
    Uy, s, Zh = torch.linalg.svd(matvec(X), full_matrices=False)
    Vt = (X @ Zh.mT).mT
    return Uy[:, :rank], s[:rank], Vt[:rank, :]
