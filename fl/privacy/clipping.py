"""Client-level clipping of client updates: the ONE implementation every method uses
(``fl.privacy.powerdp``, ``fl.methods.fedpower``, ``Method.client_level_dp_average``).

A client update u_k (a list of tensors — dense parameter differences, or LoRA factor
pairs whose product is the update) is scaled by

    f_k = min(1, C / ‖u_k‖)        (C = inf: f_k = 1; ‖u_k‖ = 0: f_k = 1)

so that ‖f_k u_k‖ <= C. Norms are computed in float64.

Non-finite policy (one for every caller). A client update whose norm is not finite —
a NaN/Inf entry, or an overflow of the norm — CONTRIBUTES ZERO: f_k = 0 and every one
of its tensors is replaced by zeros (``0·NaN`` is NaN, so scaling alone would not do).
It is never compared with C (a NaN norm would compare as "not larger than C" and pass
unclipped), never raises (one broken client cannot stop a round), and is counted:
:func:`stats` reports ``nonfinite_updates``, and the norm is reported as is (NaN/inf).
Zero is within any sensitivity bound, so the policy costs no privacy: the round's
release is that of the same cohort with that client's update replaced by 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fl import linalg

Tensor = torch.Tensor

__all__ = [
    "check_bound",
    "clip_factors",
    "factored_norms",
    "dense_norms",
    "apply",
    "clip_factored_clients",
    "clip_dense_clients",
    "stats",
]


def check_bound(C: float) -> None:
    """A clipping bound must be a number > 0 (``inf`` disables clipping)."""
    if not (isinstance(C, int | float) and not math.isnan(C) and C > 0):
        raise ValueError(f"clipping bound must be > 0, got {C!r}")


def clip_factors(norms: Tensor, C: float) -> Tensor:
    """The clip factors f_k (a (K,) float64 tensor, on ``norms``' device) of clients with
    update norms ``norms``: min(1, C/‖u_k‖), and 0 where the norm is not finite."""
    check_bound(C)
    norms = torch.as_tensor(norms, dtype=torch.float64)
    finite = torch.isfinite(norms)
    if math.isinf(C):
        f = torch.ones_like(norms)
    else:
        f = torch.clamp(C / norms, max=1.0)  # a zero norm gives inf, clamped to 1
    return torch.where(finite, f, torch.zeros_like(f))


def factored_norms(layers: Sequence[tuple[Sequence[Tensor], Sequence[Tensor]]]) -> Tensor:
    """Joint update norms ‖u_k‖ = sqrt(Σ_ℓ ‖B_k^ℓ A_k^ℓ‖_F²) of K clients, a (K,) float64
    tensor, never forming B A (``linalg.factored_fro_norm``; clients of one shape share
    batched Gram products). ``layers``: one (Bs, As) pair of K-lists per layer. NaN/Inf
    entries give a NaN/Inf norm (each entry enters a diagonal Gram term)."""
    if not layers:
        raise ValueError("need at least one layer")
    K = len(layers[0][0])
    if K == 0:
        raise ValueError("need at least one client")
    sq = None
    for Bs, As in layers:
        if len(Bs) != K or len(As) != K:
            raise ValueError("every layer needs one B and one A per client")
        Bs = [B.double() for B in Bs]
        As = [A.double() for A in As]
        if len({(tuple(B.shape), tuple(A.shape)) for B, A in zip(Bs, As)}) == 1:
            if Bs[0].shape[1] != As[0].shape[0]:
                raise ValueError(f"B is {tuple(Bs[0].shape)} but A is {tuple(As[0].shape)}")
            Bst, Ast = torch.stack(Bs), torch.stack(As)
            s = torch.sum((Bst.mT @ Bst) * (Ast @ Ast.mT), dim=(1, 2))
            # clamp keeps NaN; a rounding-negative sum becomes 0
            s = torch.clamp(s, min=0.0)
        else:
            s = torch.stack([linalg.factored_fro_norm(B, A) ** 2 for B, A in zip(Bs, As)])
        sq = s if sq is None else sq + s.to(sq.device)
    return torch.sqrt(sq)


def dense_norms(updates: Sequence[Sequence[Tensor]]) -> Tensor:
    """Joint ℓ2 norms of K dense updates (each a sequence of tensors), (K,) float64."""
    if not updates:
        raise ValueError("need at least one client")
    out = [
        math.sqrt(sum(float(t.double().pow(2).sum()) for t in u)) if len(u) else 0.0
        for u in updates
    ]
    return torch.tensor(out, dtype=torch.float64)


def apply(t: Tensor, f) -> Tensor:
    """``t`` scaled by the clip factor ``f``; zeros when f == 0 (a non-finite update)."""
    f = float(f)
    if f == 0.0:
        return torch.zeros_like(t)
    if f == 1.0:
        return t
    # In float64: f itself may be below the input dtype's range (a float32 update of
    # norm 1e40 has f ~ 1e-40, a float32 subnormal).
    return (t.double() * f).to(t.dtype)


def clip_factored_clients(
    layers: Sequence[tuple[Sequence[Tensor], Sequence[Tensor]]], C: float
) -> tuple[list[tuple[list[Tensor], list[Tensor]]], Tensor, Tensor]:
    """Clip K clients' factored updates jointly over layers (B_k^ℓ scaled by f_k, A_k^ℓ
    kept, so an orthonormal A stays orthonormal; a non-finite client's B and A are
    zeros). Returns (clipped layers, norms (K,), factors (K,))."""
    norms = factored_norms(layers)
    f = clip_factors(norms, C).tolist()
    out = []
    for Bs, As in layers:
        out.append(
            (
                [apply(B, fk) for B, fk in zip(Bs, f)],
                [torch.zeros_like(A) if fk == 0.0 else A for A, fk in zip(As, f)],
            )
        )
    return out, norms, torch.tensor(f, dtype=torch.float64)


def clip_dense_clients(
    updates: Sequence[Sequence[Tensor]], C: float
) -> tuple[list[list[Tensor]], Tensor, Tensor]:
    """Clip K clients' dense updates (each a sequence of tensors, clipped jointly).
    Returns (clipped updates, norms (K,), factors (K,))."""
    norms = dense_norms(updates)
    f = clip_factors(norms, C)
    out = [[apply(t, fk) for t in u] for u, fk in zip(updates, f.tolist())]
    return out, norms, f


def stats(norms: Tensor, C: float) -> dict:
    """Report of one clipping: mean finite norm, fraction of finite updates clipped,
    and the count of non-finite updates (which contributed zero)."""
    vals = [float(x) for x in torch.as_tensor(norms).reshape(-1)]
    finite = [x for x in vals if math.isfinite(x)]
    return {
        "update_norm_mean": sum(finite) / len(finite) if finite else None,
        "frac_clipped": sum(x > C for x in finite) / max(len(finite), 1),
        "nonfinite_updates": len(vals) - len(finite),
    }
