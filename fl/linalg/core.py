"""Shared helpers (weights, factor-pair checks, stacking, QR), norms and sums of
factored client sets S = Σ_k p_k B_k A_k. Conventions: :mod:`fl.linalg`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Tensor = torch.Tensor
Weights = Sequence[float] | Tensor | None

# ----------------------------------------------------------------------------- helpers


def client_weights(weights: Weights, k: int) -> list[float]:
    """Weights as a list of k finite python floats (``None`` -> uniform 1/k)."""
    if k == 0:
        raise ValueError("empty client list")
    if weights is None:
        return [1.0 / k] * k
    if isinstance(weights, Tensor):
        w = [float(x) for x in weights.detach().reshape(-1).tolist()]
    else:
        w = [float(x) for x in weights]
    if len(w) != k:
        raise ValueError(f"got {len(w)} weights for {k} clients")
    if not all(math.isfinite(x) for x in w):
        raise ValueError(f"weights must be finite, got {w}")
    return w


def check_pairs(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> None:
    """Raise ValueError unless ``Bs``, ``As`` are K >= 1 pairs of 2-D factors B_k (m×r_k),
    A_k (r_k×n) with one update shape m×n."""
    if len(Bs) != len(As):
        raise ValueError(f"{len(Bs)} B factors but {len(As)} A factors")
    if len(Bs) == 0:
        raise ValueError("empty client list")
    m, n = Bs[0].shape[0], As[0].shape[1]
    for k, (B, A) in enumerate(zip(Bs, As)):
        if B.dim() != 2 or A.dim() != 2:
            raise ValueError(
                f"client {k}: factors must be 2-D, got {tuple(B.shape)}, {tuple(A.shape)}"
            )
        if B.shape[1] != A.shape[0]:
            raise ValueError(f"client {k}: B is {tuple(B.shape)} but A is {tuple(A.shape)}")
        if B.shape[0] != m or A.shape[1] != n:
            raise ValueError(f"client {k}: update is {B.shape[0]}×{A.shape[1]}, expected {m}×{n}")


def weighted_concat(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights
) -> tuple[Tensor, Tensor]:
    """B_cat = [B_1 .. B_K] (m×Σr_k), A_cat = [p_1 A_1; ..; p_K A_K] (Σr_k×n):
    Σ_k p_k B_k A_k = B_cat A_cat."""
    check_pairs(Bs, As)
    w = client_weights(weights, len(Bs))
    return torch.cat(list(Bs), dim=1), torch.cat([p * A for p, A in zip(w, As)], dim=0)


def qr_q(M: Tensor) -> Tensor:
    """Q of the reduced QR decomposition of M (d×k -> d×k)."""
    return torch.linalg.qr(M, mode="reduced").Q


def _qr_r(M: Tensor) -> Tensor:
    return torch.linalg.qr(M, mode="r").R


def orth(M: Tensor) -> Tensor:
    """Orthonormal basis Q (d×k, QᵀQ = I) of the columns of M (d×k), by reduced QR.

    Assumes full column rank (rank-deficient input gives a Q whose span contains
    range(M)). Signs are fixed so diag(R) >= 0, which makes Q unique for full rank.
    """
    Q, R = torch.linalg.qr(M, mode="reduced")
    d = torch.sign(torch.diagonal(R))
    d = torch.where(d == 0, torch.ones_like(d), d)
    return Q * d


# ----------------------------------------------------------------------- norms, sums


def weighted_sum(tensors: Sequence[Tensor], weights: Weights = None) -> Tensor:
    """Σ_k w_k T_k for same-shape tensors (``weights=None`` -> uniform mean)."""
    if len(tensors) == 0:
        raise ValueError("empty tensor list")
    w = client_weights(weights, len(tensors))
    out = w[0] * tensors[0]
    for p, t in zip(w[1:], tensors[1:]):
        if t.shape != tensors[0].shape:
            raise ValueError(f"shape mismatch: {tuple(t.shape)} vs {tuple(tensors[0].shape)}")
        out = out + p * t
    return out


def factored_fro_norm(B: Tensor, A: Tensor) -> Tensor:
    """‖B A‖_F for B (m×r), A (r×n) without forming B A.

    ‖BA‖_F² = trace((BᵀB)(AAᵀ)) (r×r Gram matrices, O((m+n)r²)). A tiny negative
    value from rounding is clamped to 0 before the square root. Relative accuracy is
    that of the Gram matrices (~machine eps · cond², fine for clipping); for the norm
    of a difference that nearly cancels use :func:`factored_sum_norm`.
    """
    if B.shape[1] != A.shape[0]:
        raise ValueError(f"B is {tuple(B.shape)} but A is {tuple(A.shape)}")
    sq = torch.sum((B.mT @ B) * (A @ A.mT))
    return torch.sqrt(torch.clamp(sq, min=0.0))


def factored_fro_inner(B1: Tensor, A1: Tensor, B2: Tensor, A2: Tensor) -> Tensor:
    """Frobenius inner product <B1 A1, B2 A2>_F = trace((B1ᵀB2)(A2A1ᵀ)), factored.

    Shapes: B1 (m×r1), A1 (r1×n), B2 (m×r2), A2 (r2×n); cost O((m+n) r1 r2).
    """
    if B1.shape[1] != A1.shape[0] or B2.shape[1] != A2.shape[0]:
        raise ValueError("factor shapes do not chain")
    return torch.sum((B1.mT @ B2) * (A1 @ A2.mT))


def factored_sum_norm(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None
) -> Tensor:
    """‖Σ_k p_k B_k A_k‖_F computed stably in factored form.

    With B_cat = Q_B R_B and A_catᵀ = Q_A R_A (reduced QR), Σ p_k B_k A_k =
    Q_B (R_B R_Aᵀ) Q_Aᵀ, so the norm is ‖R_B R_Aᵀ‖_F (a (Σr)×(Σr) core). Unlike the
    Gram-trace formula this has no cancellation, so it is accurate for differences
    (used by :func:`aggregation_error`).
    """
    Bc, Ac = weighted_concat(Bs, As, weights)
    return torch.linalg.matrix_norm(_qr_r(Bc) @ _qr_r(Ac.mT).mT)


def apply_sum(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights, X: Tensor) -> Tensor:
    """(Σ_k p_k B_k A_k) X computed as Σ_k p_k B_k (A_k X). X (n×c) -> m×c."""
    check_pairs(Bs, As)
    w = client_weights(weights, len(Bs))
    out = None
    for p, B, A in zip(w, Bs, As):
        t = B @ (A @ X)
        out = p * t if out is None else out + p * t
    return out


def apply_sum_t(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights, Y: Tensor) -> Tensor:
    """(Σ_k p_k B_k A_k)ᵀ Y computed as Σ_k p_k A_kᵀ (B_kᵀ Y). Y (m×c) -> n×c."""
    check_pairs(Bs, As)
    w = client_weights(weights, len(Bs))
    out = None
    for p, B, A in zip(w, Bs, As):
        t = A.mT @ (B.mT @ Y)
        out = p * t if out is None else out + p * t
    return out


def stack_factors(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights
) -> tuple[Tensor, Tensor, Tensor]:
    """(B_cat m×Σr_k, A_cat Σr_k×n, d (Σr_k,)) with Σ_k p_k B_k A_k = B_cat diag(d) A_cat:
    d holds p_k repeated r_k times (the factors themselves are only concatenated).
    ``weights`` may be a (K,) tensor on the factors' device (kept there: no host sync)."""
    check_pairs(Bs, As)
    ref = Bs[0]
    if isinstance(weights, Tensor) and weights.ndim == 1 and len(weights) == len(Bs):
        w = weights.to(dtype=ref.dtype, device=ref.device)
    else:
        w = torch.tensor(client_weights(weights, len(Bs)), dtype=ref.dtype, device=ref.device)
    ranks = torch.tensor([B.shape[1] for B in Bs], device=ref.device)
    d = torch.repeat_interleave(w, ranks)
    return torch.cat(list(Bs), dim=1), torch.cat(list(As), dim=0), d


def client_fro_norms(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> Tensor:
    """‖B_k A_k‖_F of every client, a (K,) float64 tensor: ‖B A‖_F² = Σ (BᵀB)∘(AAᵀ) with
    the r_k×r_k Gram products in float64 (no overflow for float32 input; NaN/Inf entries
    give a NaN/Inf norm; a rounding-negative sum is clamped to 0). One client at a time:
    a float64 copy of all K factors at once (a stacked batch) costs more than the Gram
    products themselves at m = n = 4096 (fresh pages), see docs/benchmarks.md."""
    check_pairs(Bs, As)
    sq = []
    for B, A in zip(Bs, As):
        Bd, Ad = B.to(torch.float64), A.to(torch.float64)
        sq.append(torch.sum((Bd.mT @ Bd) * (Ad @ Ad.mT)))
    return torch.sqrt(torch.clamp(torch.stack(sq), min=0.0))  # clamp keeps NaN


def apply_stacked(
    Bcat: Tensor, Acat: Tensor, d: Tensor, X: Tensor, transpose: bool = False
) -> Tensor:
    """B_cat diag(d) A_cat X (X n×c -> m×c) or, with ``transpose``, its transpose applied
    to X (m×c -> n×c); see :func:`stack_factors`."""
    if transpose:
        return Acat.mT @ (d[:, None] * (Bcat.mT @ X))
    return Bcat @ (d[:, None] * (Acat @ X))


def dense_sum(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None) -> Tensor:
    """Reference: the dense m×n matrix S = Σ_k p_k B_k A_k (forms it)."""
    Bc, Ac = weighted_concat(Bs, As, weights)
    return Bc @ Ac
