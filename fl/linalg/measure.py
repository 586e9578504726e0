"""Measurements: aggregation exactness and principal angles between subspaces."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fl.linalg.core import Tensor, Weights, client_weights, factored_sum_norm, qr_q


def aggregation_error(
    B_glob: Tensor, A_glob: Tensor, Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights
) -> Tensor:
    """Aggregation exactness ‖B_glob A_glob − S‖_F / ‖S‖_F, S = Σ p_k B_k A_k, factored.

    The difference is itself a factored sum ([B_glob, B_1..B_K] with weights
    [1, −p_1..−p_K]), so both norms go through :func:`factored_sum_norm` (QR, no
    cancellation: an exact aggregate gives ~1e-15 in float64). Returns 0 when both
    are 0 and inf when only S is 0.
    """
    w = client_weights(weights, len(Bs))
    num = factored_sum_norm([B_glob, *Bs], [A_glob, *As], [1.0] + [-p for p in w])
    den = factored_sum_norm(Bs, As, w)
    if float(den) == 0.0:
        return torch.zeros_like(num) if float(num) == 0.0 else torch.full_like(num, math.inf)
    return num / den


def principal_angles(U: Tensor, V: Tensor) -> Tensor:
    """Principal angles (radians, ascending, length min(p, q)) between span(U) and span(V).

    U (d×p), V (d×q) with full column rank (need not be orthonormal). Q_U, Q_V by QR;
    cosines are the singular values of Q_Uᵀ Q_V (clamped to [0, 1]). Angles below π/4
    are taken from the sines (singular values of the residual of the smaller basis
    projected off the other), which keeps small angles accurate to ~1e-16 instead of
    the ~1e-8 floor of arccos.
    """
    if U.shape[0] != V.shape[0]:
        raise ValueError(f"subspaces live in different spaces: {U.shape[0]} vs {V.shape[0]}")
    Qu, Qv = qr_q(U), qr_q(V)
    if Qu.shape[1] < Qv.shape[1]:
        Qu, Qv = Qv, Qu  # Qv is the smaller basis
    M = Qu.mT @ Qv
    cos = torch.clamp(torch.linalg.svdvals(M), 0.0, 1.0)  # descending
    theta_cos = torch.arccos(cos)  # ascending
    sin = torch.clamp(torch.linalg.svdvals(Qv - Qu @ M), 0.0, 1.0)
    theta_sin = torch.flip(torch.arcsin(sin), dims=(0,))  # ascending
    return torch.where(cos * cos > 0.5, theta_sin, theta_cos)


def largest_principal_angle(U: Tensor, V: Tensor) -> Tensor:
    """Largest principal angle (radians) between span(U) and span(V) (0-dim tensor)."""
    return principal_angles(U, V).max()


def rowspace_angle(A0: Tensor, At: Tensor) -> Tensor:
    """Largest principal angle between rowspace(A0) and rowspace(At) (A: r×n)."""
    return largest_principal_angle(A0.mT, At.mT)
