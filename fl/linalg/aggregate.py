"""The methods' server rules on factors: the homogeneous baselines (FedAvg-LoRA, FFA,
FedSA), the heterogeneous-rank ones (FLoRA stacking, FlexLoRA, HETLoRA) and Fed-PLoRA's
rank-1 modules (fold, unfold, per-module average)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fl.linalg.core import (
    Tensor,
    Weights,
    check_pairs,
    client_weights,
    factored_fro_norm,
    weighted_sum,
)
from fl.linalg.svd import truncated_svd_factors


def fedavg_aggregate(
    Bs: Sequence[Tensor], As: Sequence[Tensor], weights: Weights = None
) -> tuple[Tensor, Tensor]:
    """FedAvg-LoRA / FedIT: B = Σ p_k B_k, A = Σ p_k A_k (equal ranks).

    Inexact: (Σ p_k B_k)(Σ p_k A_k) − Σ p_k B_k A_k = Σ_{j≠k} p_j p_k B_j A_k − ... (the
    cross-term error); it vanishes when all A_k are equal, or all B_k are equal.
    """
    check_pairs(Bs, As)
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
    check_pairs(Bs, As)
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
    check_pairs(Bs, As)
    w = client_weights(weights, len(Bs))
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
    check_pairs(Bs, As)
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
    w = client_weights(weights, len(client_modules))
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
