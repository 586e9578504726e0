"""Truncated SVD of a factored sum, never forming the m×n matrix."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fl.linalg.core import Tensor, Weights, weighted_concat


def factors_from_svd(
    U: Tensor, s: Tensor, Vh: Tensor, rank: int, split: str
) -> tuple[Tensor, Tensor]:
    """Rank-``rank`` factors from an SVD U diag(s) Vh (zero-padded if short)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    k = min(rank, s.shape[0])
    U, s, Vh = U[:, :k], s[:k], Vh[:k, :]
    if split == "sqrt":
        r = torch.sqrt(torch.clamp(s, min=0.0))
        B, A = U * r, r[:, None] * Vh
    elif split == "left":  # B = U Σ, A = Vᵀ
        B, A = U * s, Vh
    elif split == "right":  # B = U, A = Σ Vᵀ
        B, A = U, s[:, None] * Vh
    else:
        raise ValueError(f"split must be 'sqrt', 'left' or 'right', got {split!r}")
    if k < rank:
        B = torch.cat([B, B.new_zeros(B.shape[0], rank - k)], dim=1)
        A = torch.cat([A, A.new_zeros(rank - k, A.shape[1])], dim=0)
    return B, A


def factored_svd(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD of S = Σ p_k B_k A_k without forming S.

    S = B_cat A_cat (see module doc); B_cat = Q_1 R_1, A_catᵀ = Q_2 R_2 (reduced QR);
    SVD of the small core R_1 R_2ᵀ = U_c Σ V_cᵀ gives S = (Q_1 U_c) Σ (Q_2 V_c)ᵀ.
    Returns U (m×q), s (q, descending), Vh (q×n) with q = min(m, n, Σ r_k).
    Cost O((m+n)(Σr)²).
    """
    Bc, Ac = weighted_concat(Bs, As, weights)
    Q1, R1 = torch.linalg.qr(Bc, mode="reduced")
    Q2, R2 = torch.linalg.qr(Ac.mT, mode="reduced")
    Uc, s, Vch = torch.linalg.svd(R1 @ R2.mT, full_matrices=False)
    return Q1 @ Uc, s, Vch @ Q2.mT


def truncated_svd_factors(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights: Weights,
    rank: int,
    split: str = "sqrt",
) -> tuple[Tensor, Tensor]:
    """Best rank-``rank`` approximation (Eckart–Young) of S = Σ p_k B_k A_k as factors.

    Computed by :func:`factored_svd` (QR of the stacked factors + SVD of the core),
    never forming the m×n matrix. ``split`` chooses how Σ_r is shared:
    ``"sqrt"``: B = U_r Σ_r^{1/2}, A = Σ_r^{1/2} V_rᵀ; ``"left"``: B = U_r Σ_r, A = V_rᵀ;
    ``"right"``: B = U_r, A = Σ_r V_rᵀ. Returns B (m×rank), A (rank×n), zero-padded
    when rank(S) < rank.
    """
    U, s, Vh = factored_svd(Bs, As, weights)
    return factors_from_svd(U, s, Vh, rank, split)
