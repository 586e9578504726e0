"""Pure linear algebra on LoRA factors, shared by the federated methods and ``analysis``.

Conventions
-----------
* A LoRA factor pair is ``B`` (m×r) and ``A`` (r×n); the weight update is
  ΔW = s·B A with s = alpha/r.  Every function here works on ``B`` and ``A``
  **without** the scaling s (the caller applies s in one place) unless it says
  otherwise.
* A client set is given as lists ``Bs`` = [B_1..B_K], ``As`` = [A_1..A_K] and
  ``weights`` = [p_1..p_K] (python floats, a 1-D tensor, or ``None`` = uniform 1/K).
  The ideal aggregate is S = Σ_k p_k B_k A_k (m×n). Client ranks r_k may differ
  wherever a function does not need them equal.
* Tensors in, tensors out; no state, no ``nn.Module``. Any floating dtype works
  (the tests use float64); results keep the dtype/device of the inputs. Scalars are
  returned as 0-dim tensors.
* Nothing here forms an m×n matrix unless its name or docstring says so
  (``dense_sum``, ``fold_modules(dense=True)``, ``flexlora``'s are factored too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Tensor = torch.Tensor
Weights = Sequence[float] | Tensor | None

__all__ = [
    "weighted_sum",
    "factored_fro_norm",
    "factored_fro_inner",
    "factored_sum_norm",
    "apply_sum",
    "apply_sum_t",
    "dense_sum",
    "orth",
    "gaussian_sketch",
    "sketch",
    "sketch_basis",
    "project",
    "refactor",
    "factored_svd",
    "truncated_svd_factors",
    "fedavg_aggregate",
    "ffa_aggregate",
    "fedsa_aggregate",
    "flora_stack",
    "flexlora_aggregate",
    "flexlora_redistribute",
    "hetlora_pad",
    "hetlora_truncate",
    "hetlora_weights",
    "hetlora_aggregate",
    "fold_modules",
    "unfold_modules",
    "plora_aggregate",
    "aggregation_error",
    "principal_angles",
    "largest_principal_angle",
    "rowspace_angle",
    "subspace_iteration",
]


# ----------------------------------------------------------------------------- helpers


def _weights(weights: Weights, k: int) -> list[float]:
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


def _check_pairs(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> None:
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


def _stack(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights) -> tuple[Tensor, Tensor]:
    """B_cat = [B_1 .. B_K] (m×Σr_k), A_cat = [p_1 A_1; ..; p_K A_K] (Σr_k×n):
    Σ_k p_k B_k A_k = B_cat A_cat."""
    _check_pairs(Bs, As)
    w = _weights(weights, len(Bs))
    return torch.cat(list(Bs), dim=1), torch.cat([p * A for p, A in zip(w, As)], dim=0)


def _qr_q(M: Tensor) -> Tensor:
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
    w = _weights(weights, len(tensors))
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
    Bc, Ac = _stack(Bs, As, weights)
    return torch.linalg.matrix_norm(_qr_r(Bc) @ _qr_r(Ac.mT).mT)


def apply_sum(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights, X: Tensor) -> Tensor:
    """(Σ_k p_k B_k A_k) X computed as Σ_k p_k B_k (A_k X). X (n×c) -> m×c."""
    _check_pairs(Bs, As)
    w = _weights(weights, len(Bs))
    out = None
    for p, B, A in zip(w, Bs, As):
        t = B @ (A @ X)
        out = p * t if out is None else out + p * t
    return out


def apply_sum_t(Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights, Y: Tensor) -> Tensor:
    """(Σ_k p_k B_k A_k)ᵀ Y computed as Σ_k p_k A_kᵀ (B_kᵀ Y). Y (m×c) -> n×c."""
    _check_pairs(Bs, As)
    w = _weights(weights, len(Bs))
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
    _check_pairs(Bs, As)
    ref = Bs[0]
    if isinstance(weights, Tensor) and weights.ndim == 1 and len(weights) == len(Bs):
        w = weights.to(dtype=ref.dtype, device=ref.device)
    else:
        w = torch.tensor(_weights(weights, len(Bs)), dtype=ref.dtype, device=ref.device)
    ranks = torch.tensor([B.shape[1] for B in Bs], device=ref.device)
    d = torch.repeat_interleave(w, ranks)
    return torch.cat(list(Bs), dim=1), torch.cat(list(As), dim=0), d


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
    Bc, Ac = _stack(Bs, As, weights)
    return Bc @ Ac


# -------------------------------------------------------------------- FedASK sketch


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
    return _factors_from_svd(Q @ U, s, Vh, rank, "sqrt")


# ------------------------------------------------------------------- truncated SVD


def _factors_from_svd(
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
    Bc, Ac = _stack(Bs, As, weights)
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
    return _factors_from_svd(U, s, Vh, rank, split)


# -------------------------------------------------------------- baseline aggregations


def fedavg_aggregate(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None
) -> tuple[Tensor, Tensor]:
    """FedAvg-LoRA / FedIT: B = Σ p_k B_k, A = Σ p_k A_k (equal ranks).

    Inexact: (Σ p_k B_k)(Σ p_k A_k) − Σ p_k B_k A_k = Σ_{j≠k} p_j p_k B_j A_k − ... (the
    cross-term error); it vanishes when all A_k are equal, or all B_k are equal.
    """
    _check_pairs(Bs, As)
    return weighted_sum(Bs, weights), weighted_sum(As, weights)


def ffa_aggregate(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights: Weights = None,
    check: bool = True,
    atol: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """FFA-LoRA: A is frozen and shared; B = Σ p_k B_k, A = A_1.

    Exact (B A = Σ p_k B_k A) when all A_k are equal, which ``check`` verifies
    (ValueError otherwise; ``atol`` tolerance on the max abs difference).
    """
    _check_pairs(Bs, As)
    A0 = As[0]
    if check:
        for k, A in enumerate(As[1:], start=1):
            if A.shape != A0.shape or float((A - A0).abs().max()) > atol:
                raise ValueError(f"FFA-LoRA needs a shared A; client {k} differs from client 0")
    return weighted_sum(Bs, weights), A0.clone()


def fedsa_aggregate(As: Sequence[Tensor], weights: Weights = None) -> Tensor:
    """FedSA-LoRA: only A is shared and averaged (B stays local): Σ p_k A_k."""
    return weighted_sum(As, weights)


def flora_stack(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None
) -> tuple[Tensor, Tensor]:
    """FLoRA stacking: B = [p_1 B_1, ..., p_K B_K] (m×Σr_k), A = [A_1; ...; A_K] (Σr_k×n).

    B A = Σ p_k B_k A_k exactly, at rank Σ_k r_k (ranks may differ).
    """
    _check_pairs(Bs, As)
    w = _weights(weights, len(Bs))
    return torch.cat([p * B for p, B in zip(w, Bs)], dim=1), torch.cat(list(As), dim=0)


def flexlora_aggregate(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights: Weights,
    rank: int | None = None,
    split: str = "sqrt",
) -> tuple[Tensor, Tensor]:
    """FlexLoRA server: exact average S = Σ p_k B_k A_k, then truncated SVD to ``rank``.

    ``rank=None`` keeps min(Σ r_k, m, n) (exact). Returns B (m×rank), A (rank×n).
    """
    if rank is None:
        rank = min(sum(B.shape[1] for B in Bs), Bs[0].shape[0], As[0].shape[1])
    return truncated_svd_factors(Bs, As, weights, rank, split)


def flexlora_redistribute(
    B: Tensor, A: Tensor, client_rank: int, split: str = "sqrt"
) -> tuple[Tensor, Tensor]:
    """FlexLoRA client factors: top-r_i SVD factors of the global update B A
    (B (m×R), A (R×n)) -> B_i (m×r_i), A_i (r_i×n)."""
    return truncated_svd_factors([B], [A], [1.0], client_rank, split)


def hetlora_pad(B: Tensor, A: Tensor, R: int) -> tuple[Tensor, Tensor]:
    """Zero-pad rank-r factors to rank R >= r: B (m×r) -> m×R, A (r×n) -> R×n. B A unchanged."""
    r = B.shape[1]
    if A.shape[0] != r:
        raise ValueError(f"B is {tuple(B.shape)} but A is {tuple(A.shape)}")
    if R < r:
        raise ValueError(f"cannot pad rank {r} to smaller rank {R}")
    return (
        torch.cat([B, B.new_zeros(B.shape[0], R - r)], dim=1),
        torch.cat([A, A.new_zeros(R - r, A.shape[1])], dim=0),
    )


def hetlora_truncate(B: Tensor, A: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """HETLoRA's rank truncation for a client: first r columns of B, first r rows of A."""
    if r > B.shape[1] or r > A.shape[0]:
        raise ValueError(f"cannot truncate rank {B.shape[1]} to larger rank {r}")
    return B[:, :r].clone(), A[:r, :].clone()


def hetlora_weights(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> Tensor:
    """HETLoRA sparsity weights: w_k = ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F (uniform when all
    norms are 0). Norms only — no data-size factor p_k: these are the weights the method
    (``fl.methods.hetlora``) trains with. Returns a (K,) tensor."""
    _check_pairs(Bs, As)
    norms = torch.stack([factored_fro_norm(B, A) for B, A in zip(Bs, As)])
    tot = norms.sum()
    if float(tot) <= 0.0:
        return torch.full_like(norms, 1.0 / len(Bs))
    return norms / tot


def hetlora_aggregate(Bs: Sequence[Tensor], As: Sequence[Tensor], R: int) -> tuple[Tensor, Tensor]:
    """HETLoRA server: zero-pad each client's rank-r_k factors to R, then average B and A
    separately with the sparsity weights of :func:`hetlora_weights`. Returns B (m×R), A (R×n)."""
    w = hetlora_weights(Bs, As)
    padded = [hetlora_pad(B, A, R) for B, A in zip(Bs, As)]
    return weighted_sum([b for b, _ in padded], w), weighted_sum([a for _, a in padded], w)


# ------------------------------------------------------------------ Fed-PLoRA modules


def _index_list(idx, R: int) -> list[int]:
    if isinstance(idx, Tensor):
        idx = idx.reshape(-1).tolist()
    out = [int(i) for i in idx]
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate module indices: {out}")
    if any(i < 0 or i >= R for i in out):
        raise ValueError(f"module index out of range [0, {R}): {out}")
    return out


def _complement(keep: list[int], R: int) -> list[int]:
    ks = set(keep)
    return [j for j in range(R) if j not in ks]


def fold_modules(
    B: Tensor, A: Tensor, keep_idx, dense: bool = False
) -> tuple[tuple[Tensor, Tensor] | Tensor, Tensor, Tensor]:
    """Fed-PLoRA (arXiv 2602.16936) client split of a rank-R LoRA into R rank-1 modules.

    Module j is B[:, j] A[j, :]. The client keeps the modules ``keep_idx`` (r_i of them,
    in the given order) trainable and folds the others into its frozen base.
    Returns (fold, B_keep (m×r_i), A_keep (r_i×n)) where fold is the folded update
    B[:, drop] A[drop, :] with drop = the complement of keep_idx in ascending order —
    as factors ``(B_drop, A_drop)`` or, with ``dense=True``, as the m×n matrix.
    B_keep A_keep + fold = B A.
    """
    R = B.shape[1]
    keep = _index_list(keep_idx, R)
    drop = _complement(keep, R)
    Bd, Ad = B[:, drop], A[drop, :]
    fold = Bd @ Ad if dense else (Bd, Ad)
    return fold, B[:, keep], A[keep, :]


def unfold_modules(
    B_keep: Tensor, A_keep: Tensor, keep_idx, B_fold: Tensor, A_fold: Tensor
) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`fold_modules` (factored fold): rebuild the rank-R factors with
    R = r_i + r_fold, placing B_keep/A_keep at ``keep_idx`` and the folded modules at
    the complement (ascending). Returns B (m×R), A (R×n)."""
    R = B_keep.shape[1] + B_fold.shape[1]
    keep = _index_list(keep_idx, R)
    if len(keep) != B_keep.shape[1]:
        raise ValueError(f"{len(keep)} indices for {B_keep.shape[1]} kept modules")
    drop = _complement(keep, R)
    B = B_keep.new_zeros(B_keep.shape[0], R)
    A = A_keep.new_zeros(R, A_keep.shape[1])
    B[:, keep], A[keep, :] = B_keep, A_keep
    B[:, drop], A[drop, :] = B_fold, A_fold
    return B, A


def plora_aggregate(
    global_B: Tensor,
    global_A: Tensor,
    client_modules: Sequence[tuple],
    weights: Weights = None,
) -> tuple[Tensor, Tensor]:
    """Fed-PLoRA server: average each rank-1 module over the clients that trained it.

    ``client_modules[k] = (idx_k, B_sel_k (m×r_k), A_sel_k (r_k×n))``: client k trained
    modules ``idx_k`` (column j of B_sel_k / row j of A_sel_k is module idx_k[j]).
    For module j: B[:, j] = Σ_{k∋j} p_k B_sel_k[:, pos] / Σ_{k∋j} p_k (weights renormalized
    among the clients that trained j), same for A[j, :]. A module no client trained
    (or whose contributors all have weight 0) keeps its global value.
    Returns new B (m×R), A (R×n); the inputs are not modified.
    """
    R = global_B.shape[1]
    w = _weights(weights, len(client_modules))
    num_B = torch.zeros_like(global_B)
    num_A = torch.zeros_like(global_A)
    den = global_B.new_zeros(R)
    for p, (idx, Bs, As) in zip(w, client_modules):
        ids = _index_list(idx, R)
        if Bs.shape[1] != len(ids) or As.shape[0] != len(ids):
            raise ValueError(
                f"{len(ids)} module indices for factors {tuple(Bs.shape)}, {tuple(As.shape)}"
            )
        num_B[:, ids] += p * Bs
        num_A[ids, :] += p * As
        den[ids] += p
    trained = den != 0
    B, A = global_B.clone(), global_A.clone()
    B[:, trained] = num_B[:, trained] / den[trained]
    A[trained, :] = num_A[trained, :] / den[trained, None]
    return B, A


# ---------------------------------------------------------------------- measurements


def aggregation_error(
    B_glob: Tensor, A_glob: Tensor, Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights
) -> Tensor:
    """Aggregation exactness ‖B_glob A_glob − S‖_F / ‖S‖_F, S = Σ p_k B_k A_k, factored.

    The difference is itself a factored sum ([B_glob, B_1..B_K] with weights
    [1, −p_1..−p_K]), so both norms go through :func:`factored_sum_norm` (QR, no
    cancellation: an exact aggregate gives ~1e-15 in float64). Returns 0 when both
    are 0 and inf when only S is 0.
    """
    w = _weights(weights, len(Bs))
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
    Qu, Qv = _qr_q(U), _qr_q(V)
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
