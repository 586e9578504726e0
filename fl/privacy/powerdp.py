"""Over 500 lines on purpose: one mechanism family — PowerDP's noisy power iteration and its two baselines (input and output perturbation) — sharing the client clip, the sensitivities and the release records.

PowerDP: client-level DP refactorization of the averaged LoRA update (FedPower,
arXiv 2605.08443), with its two comparison mechanisms, as pure functions.

Setting (client-level DP, add/remove-one-client neighbouring). The server rebuilds
each sampled client's update ΔW_k = B_k A_k (m×n, never formed), clips it to
‖ΔW_k‖_F <= C (:func:`clip_factored`) and forms — implicitly — the average
W̄ = Σ_{k∈S} p ΔW_k with a FIXED, public weight p = 1/K_expected (K_expected = q·N
for Poisson client sampling with rate q, or the fixed cohort size). W̄ is then
refactorized to rank r by a noisy simultaneous power iteration (Hardt & Price 2014,
alternating W̄ and W̄ᵀ because W̄ is rectangular):

    X_0 = orth(Ω),  Ω = gaussian_sketch(n, k, seed)          (public randomness)
    for i = 0..iters-1:
        Y_i = W̄ X_i  + G_{2i}      (m×k)   P_i     = orth(Y_i)
        Z_i = W̄ᵀ P_i + G_{2i+1}    (n×k)   X_{i+1} = orth(Z_i)
    final: Y = W̄ X_iters + G_{2·iters}  (m×k)
    G_j ~ N(0, (σΔ)² I)  i.i.d., Δ = C·p

Noise enters every projection BEFORE it is orthonormalized (and the final
projection, which is released un-orthonormalized). Every noisy projection is a
release: ``releases_per_round(iters) = 2·iters + 1``. The output W̄ ≈ Y X_itersᵀ
is post-processed (free) by an SVD of the m×k matrix Y = U Σ Zᵀ:

    FACTOR CONVENTION: B = U_r Σ_r (m×r, orthogonal columns, norms descending),
                       A = (X Z_r)ᵀ (r×n, orthonormal rows).

So B A is the projection of the noisy W̄ onto the estimated row space; the caller
applies the LoRA scaling s separately. k = r + oversample (oversample >= 0 costs
more noise entries but no extra sensitivity).

Sensitivity (derivation; also docs/powerdp.md). Each projection multiplies W̄ (or
W̄ᵀ) by a matrix X with orthonormal columns that is a function only of public
randomness and of earlier noisy releases (adaptive composition treats it as fixed).
For neighbours S and S' = S ∪ {j}: W̄' − W̄ = p ΔW_j, so

    ‖W̄' X − W̄ X‖_F = p ‖ΔW_j X‖_F <= p ‖ΔW_j‖_F ‖X‖_2 = p ‖ΔW_j‖_F <= p C

(‖M X‖_F² = tr(Xᵀ Mᵀ M X) <= ‖X‖_2² ‖M‖_F², ‖X‖_2 = 1); the same holds for W̄ᵀ P.
Hence Δ = C·p = C/K_expected for every projection, independent of k, r, m, n.
(Replace-one neighbouring doubles it: 2C/K.) The fixed denominator matters: with a
data-dependent one, W̄ = Σ_S ΔW_k / |S|, adding a client changes W̄ by
ΔW_j/(|S|+1) − W̄/(|S|+1), of norm up to 2C/(|S|+1), and the calibration would use
|S|, itself private (and undefined for |S| = 1 → 0); with data-size weights
n_k/Σn a single large client has weight ~1 and Δ ~ C. So the weights passed in
must be data-independent; the sensitivity uses C·max(weights) (or an explicit
``weight_bound``, the public bound on any client's weight, which is what an added
client would get).

Accounting. One round is the adaptive composition of ``releases_per_round`` Gaussian
mechanisms, each with noise multiplier σ (std/Δ), all on the SAME sampled cohort.
Composing n Gaussian mechanisms of multiplier σ is exactly one Gaussian mechanism
of multiplier σ/√n (μ-GDP composes as √n μ), and client subsampling amplifies the
round once, not each release. So a round is ONE Poisson-subsampled Gaussian event
with multiplier σ/√(releases_per_round) and rate q; counting rounds×releases
independently-subsampled events would understate ε when q < 1 (identical when
q = 1). :func:`calibrate_powerdp_sigma` and :func:`powerdp_epsilon` do this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fl import linalg
from fl.privacy import clipping, tap
from fl.privacy.rng import draw_normal

Tensor = torch.Tensor

__all__ = [
    "clip_factored",
    "clip_scales",
    "clip_clients",
    "projection_sensitivity",
    "releases_per_round",
    "round_noise_multiplier",
    "initial_basis",
    "gaussian_noise",
    "noisy_projection",
    "powerdp",
    "input_perturbation",
    "output_perturbation",
    "no_perturbation",
    "powerdp_epsilon",
    "calibrate_powerdp_sigma",
]


# ---------------------------------------------------------------------------- clipping
# One implementation and one non-finite policy for every client-level clip:
# fl.privacy.clipping (a non-finite update contributes zero, is counted, never raises).


def clip_factored(B: Tensor, A: Tensor, C: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Scale the update so that ‖B A‖_F <= C (:mod:`fl.privacy.clipping` on one client).

    Returns (B', A', norm, factor) with B' = factor·B, A' = A (only B is scaled, so an
    orthonormal A stays orthonormal), norm = ‖B A‖_F before clipping (0-dim float64
    tensor, NaN/inf kept) and factor = min(1, C / norm) (0-dim tensor). If the update
    is s·B A with LoRA scale s, pass s·B. ``C = inf`` disables clipping. A non-finite
    update (NaN/Inf entries or norm) gets factor 0 and B' = A' = 0 (it contributes
    zero; see the policy in :mod:`fl.privacy.clipping`).
    """
    [(Bc, Ac)], norms, f = clipping.clip_factored_clients([([B], [A])], C)
    return Bc[0], Ac[0], norms[0], f[0]


def clip_scales(Bs: Sequence[Tensor], As: Sequence[Tensor], C: float) -> Tensor:
    """The clip factors of all clients, a (K,) float64 tensor (0 for a non-finite
    update), without scaling any factor (:func:`fl.privacy.clipping.clip_factors`)."""
    if len(Bs) != len(As) or not Bs:
        raise ValueError("need equal, non-empty lists of B and A factors")
    clipping.check_bound(C)
    return clipping.clip_factors(clipping.factored_norms([(Bs, As)]), C)


def clip_clients(
    Bs: Sequence[Tensor], As: Sequence[Tensor], C: float
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Clip every client (:func:`fl.privacy.clipping.clip_factored_clients`, one layer);
    returns (Bs', As', norms (K,)); a non-finite client's factors are zeros."""
    if len(Bs) != len(As) or not Bs:
        raise ValueError("need equal, non-empty lists of B and A factors")
    [(Bc, Ac)], norms, _ = clipping.clip_factored_clients([(Bs, As)], C)
    return Bc, Ac, norms


# ------------------------------------------------------------------------- sensitivity


def _weight_bound(weights, weight_bound: float | None) -> float:
    if weight_bound is not None:
        wb = float(weight_bound)
    else:
        w = linalg.client_weights(weights, len(weights))
        wb = max(abs(x) for x in w)
    if not (math.isfinite(wb) and wb >= 0):
        raise ValueError(f"weight bound must be finite and >= 0, got {wb}")
    return wb


def projection_sensitivity(clip: float, weight: float) -> float:
    """ℓ2 sensitivity of one projection W̄ X (or W̄ᵀ P), X with orthonormal columns,
    under add/remove-one-client: Δ = C·p, p the fixed per-client weight 1/K_expected."""
    if not (clip > 0 and weight >= 0):
        raise ValueError(f"need clip > 0 and weight >= 0, got {clip}, {weight}")
    return float(clip) * float(weight)


def releases_per_round(iters: int) -> int:
    """Noisy releases (Gaussian mechanisms) of one PowerDP round: 2·iters + 1."""
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    return 2 * int(iters) + 1


def round_noise_multiplier(noise_multiplier: float, iters: int) -> float:
    """Noise multiplier of the single Gaussian mechanism equivalent to one round:
    σ/√(releases_per_round(iters)). Record one ledger event per round with this σ
    and the client sampling rate."""
    return float(noise_multiplier) / math.sqrt(releases_per_round(iters))


# ------------------------------------------------------------------------------- noise


def initial_basis(
    n: int, k: int, seed: int, dtype: torch.dtype = torch.float64, device=None
) -> Tensor:
    """Public starting basis X_0 = orth(gaussian_sketch(n, k, seed)) (n×k)."""
    return linalg.orth(linalg.gaussian_sketch(n, k, seed, dtype=dtype, device=device))


def gaussian_noise(shape: tuple[int, ...], std: float, generator, like: Tensor) -> Tensor:
    """N(0, std²) noise of ``shape`` in ``like``'s dtype and device. ``generator``: a
    run's keyed noise stream (:class:`fl.privacy.rng.NoiseSource`, drawn in float64
    and cast), or a ``torch.Generator`` for simulations (drawn on its device, in
    float64 when ``like`` is float64, else float32)."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    if not isinstance(generator, torch.Generator):
        return draw_normal(generator, shape, std, like.dtype, like.device)
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    g = torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)
    return g.mul_(std).to(dtype=like.dtype, device=like.device)


def noisy_projection(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights,
    X: Tensor,
    noise_std: float,
    generator: torch.Generator | None,
    transpose: bool = False,
    dense: Tensor | None = None,
    stacked: tuple[Tensor, Tensor, Tensor] | None = None,
    sensitivity: float | None = None,
) -> Tensor:
    """One Gaussian release: W̄ X + G (X n×k -> m×k) or, with ``transpose``, W̄ᵀ X + G
    (X m×k -> n×k); W̄ = Σ p_k B_k A_k applied factored (or the given ``dense`` W̄);
    G ~ N(0, noise_std² I). ``noise_std = 0`` adds nothing. ``stacked``: the result of
    ``linalg.stack_factors`` for these clients and weights (used instead of them).
    ``sensitivity``: the bound on ‖Δ(W̄ X)‖ the accounting assumes (X orthonormal: that of
    W̄), declared to the release tap (:mod:`fl.privacy.tap`; a neighbour replay)."""
    if dense is not None:
        Y = dense.mT @ X if transpose else dense @ X
    elif stacked is not None:
        Y = linalg.apply_stacked(*stacked, X, transpose=transpose)
    elif transpose:
        Y = linalg.apply_sum_t(Bs, As, weights, X)
    else:
        Y = linalg.apply_sum(Bs, As, weights, X)
    if noise_std > 0:
        if generator is None:
            raise ValueError("a generator is required when noise_std > 0")
        noise = gaussian_noise(tuple(Y.shape), noise_std, generator, Y)
        if sensitivity is not None and tap.active() is not None:
            return tap.release("powerdp", Y, noise, sensitivity)
        Y.add_(noise)  # Y is fresh
    return Y


def _record(what: str, i: int, sens: float, sigma: float, **extra) -> dict:
    std = 0.0 if sigma == 0 else sigma * sens
    return {
        "what": what,
        "iter": i,
        "sensitivity": sens,
        "noise_std": std,
        "noise_multiplier": float(sigma),
        **extra,
    }


def _check_sigma_clip(noise_multiplier: float, clip: float) -> None:
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not (clip > 0):
        raise ValueError(f"clip must be > 0, got {clip}")
    if noise_multiplier > 0 and math.isinf(clip):
        raise ValueError("a noisy mechanism needs a finite clipping bound")


# ----------------------------------------------------------------------------- PowerDP


def powerdp(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights,
    rank: int,
    iters: int,
    noise_multiplier: float,
    clip: float,
    generator: torch.Generator | None = None,
    dense: bool = False,
    seed: int = 0,
    oversample: int = 0,
    weight_bound: float | None = None,
) -> tuple[Tensor, Tensor, list[dict]]:
    """PowerDP refactorization of the clipped average (see the module docstring).

    Bs[k] (m×r_k), As[k] (r_k×n): client factors (unscaled; scale by s first if the
    clip is on s·B A). weights: fixed public per-client weights (1/K_expected);
    sensitivity Δ = clip·(weight_bound or max|weights|). rank: output rank r.
    iters: power iterations (each = one W̄ and one W̄ᵀ noisy projection). noise
    multiplier σ: every release gets i.i.d. N(0, (σΔ)²) entries. generator: noise RNG
    (required when σ > 0). seed: public seed of X_0. dense: form W̄ (m×n) and multiply
    by it (reference/speed check; same math). oversample: extra columns k = r + p.

    Returns (B (m×r), A (r×n), releases) with B = U_r Σ_r (orthogonal columns),
    A = V_rᵀ (orthonormal rows), B A ≈ W̄; ``releases`` lists every noisy release in
    order: {"what": "projection", "iter": i, "side": "W"|"Wt", "sensitivity": Δ,
    "noise_std": σΔ, "noise_multiplier": σ, "shape": [rows, k]}; the last one is the
    final projection (``"final": True``). len(releases) == releases_per_round(iters).
    With σ = 0 this is ``linalg.subspace_iteration`` on W̄ (non-private).
    """
    _check_sigma_clip(noise_multiplier, clip)
    if rank <= 0 or iters < 0 or oversample < 0:
        raise ValueError(
            f"need rank > 0, iters >= 0, oversample >= 0; got {rank}, {iters}, {oversample}"
        )
    linalg.check_pairs(Bs, As)
    clipping.check_bound(clip)
    ref = Bs[0]
    w = linalg.client_weights(weights, len(Bs))
    sens = projection_sensitivity(clip, _weight_bound(w, weight_bound))
    std = noise_multiplier * sens if noise_multiplier > 0 else 0.0
    # Clip norms from per-client float64 Gram products; the factors are concatenated
    # once (m×Σr_k and Σr_k×n) so that every projection is two GEMMs.
    ranks = [B.shape[1] for B in Bs]
    norms = linalg.client_fro_norms(Bs, As)
    scales = clipping.clip_factors(norms, clip).to(dtype=ref.dtype, device=ref.device)
    # A non-finite client contributes zero (fl.privacy.clipping): its factors become
    # zeros, since a zero weight alone would still spread 0·NaN = NaN.
    dead = [f == 0.0 for f in scales.tolist()]
    n = As[0].shape[1]
    W, stacked = None, None
    if dense:
        Bs = [torch.zeros_like(B) if d else B for B, d in zip(Bs, dead)]
        As = [torch.zeros_like(A) if d else A for A, d in zip(As, dead)]
        W = linalg.dense_sum([B * f for B, f in zip(Bs, scales.unbind())], As, w)
    else:
        Bcat, Acat = torch.cat(list(Bs), dim=1), torch.cat(list(As), dim=0)
        if any(dead):
            offs = [0]
            for r in ranks:
                offs.append(offs[-1] + r)
            for k, d in enumerate(dead):
                if d:
                    Bcat[:, offs[k] : offs[k + 1]] = 0
                    Acat[offs[k] : offs[k + 1]] = 0
        # W̄ = B_cat diag(d) A_cat with d = (p_k·clip factor_k, repeated r_k times), so
        # each projection is two GEMMs (m×Σr_k and Σr_k×n) and a row scaling of the
        # small Σr_k×k middle.
        pw = torch.as_tensor(w, dtype=scales.dtype, device=scales.device) * scales
        d = torch.repeat_interleave(pw, torch.tensor(ranks, device=pw.device))
        stacked = (Bcat, Acat, d)
    Bc, Ac = list(Bs), list(As)
    k = rank + oversample
    X = initial_basis(n, k, seed, dtype=ref.dtype, device=ref.device)
    records: list[dict] = []

    def release(M: Tensor, transpose: bool, i: int, final: bool = False) -> Tensor:
        Y = noisy_projection(
            Bc,
            Ac,
            w,
            M,
            std,
            generator,
            transpose=transpose,
            dense=W,
            stacked=stacked,
            sensitivity=sens,
        )
        rec = _record(
            "projection",
            i,
            sens,
            noise_multiplier,
            side="Wt" if transpose else "W",
            shape=list(Y.shape),
        )
        if final:
            rec["final"] = True
        records.append(rec)
        return Y

    for i in range(iters):
        P = linalg.orth(release(X, False, i))
        X = linalg.orth(release(P, True, i))
    Y = release(X, False, iters, final=True)
    U, s, Zh = torch.linalg.svd(Y, full_matrices=False)
    B = U[:, :rank] * s[:rank]
    A = (X @ Zh[:rank, :].mT).mT
    return B, A, records


# ------------------------------------------------------------------------ comparisons


def input_perturbation(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights,
    rank: int,
    noise_multiplier: float,
    clip: float,
    generator: torch.Generator | None = None,
    weight_bound: float | None = None,
) -> tuple[Tensor, Tensor, list[dict]]:
    """Input perturbation: W̃ = W̄ + G, G ~ N(0, (σΔ)²) on all m×n entries, Δ = C·p
    (W̄ itself has sensitivity p‖ΔW_j‖_F <= C·p), then the exact rank-r truncated SVD
    of W̃ (post-processing). FORMS the dense m×n matrix (necessarily). One release.
    Returns (B = U_r Σ_r, A = V_rᵀ, releases) with the powerdp convention."""
    _check_sigma_clip(noise_multiplier, clip)
    Bc, Ac, _ = clip_clients(Bs, As, clip)
    w = linalg.client_weights(weights, len(Bc))
    sens = projection_sensitivity(clip, _weight_bound(w, weight_bound))
    Wn = linalg.dense_sum(Bc, Ac, w)
    if noise_multiplier > 0:
        if generator is None:
            raise ValueError("a generator is required when noise_multiplier > 0")
        noise = gaussian_noise(tuple(Wn.shape), noise_multiplier * sens, generator, Wn)
        Wn = tap.release("powerdp-input", Wn, noise, sens, released=Wn + noise)
    U, s, Vh = torch.linalg.svd(Wn, full_matrices=False)
    B, A = linalg.factors_from_svd(U, s, Vh, rank, "left")
    return B, A, [_record("dense_update", 0, sens, noise_multiplier, shape=list(Wn.shape))]


def output_perturbation(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights,
    rank: int,
    noise_multiplier: float,
    clip: float,
    generator: torch.Generator | None = None,
    calibration: str = "norm_bound",
    factor_clip: float | None = None,
    weight_bound: float | None = None,
) -> tuple[Tensor, Tensor, list[dict]]:
    """Output perturbation: exact rank-r truncated SVD of W̄ (factored, never dense),
    B = U_r Σ_r, A = V_rᵀ, then Gaussian noise on each factor: two releases.

    The sensitivity of SVD factors is NOT bounded by C·p: with a small (or zero) gap
    σ_r − σ_{r+1}, adding one client (‖p ΔW_j‖ <= C·p) can rotate U_r, V_r by up to
    90° (Wedin: sinΘ <= C·p / gap, unbounded as gap → 0). Calibrations:

    * ``"norm_bound"`` (default, a valid DP bound): B is clipped to ‖B‖_F <= C_B
      (``factor_clip``, public; default C, the norm bound C·p·|S| of W̄ for a cohort
      of |S| ≈ K_expected = 1/p clients), so ‖B − B'‖_F <= 2 C_B; A has orthonormal rows,
      ‖A‖_F = √r, so ‖A − A'‖_F <= 2√r. These are worst-case (triangle-inequality)
      bounds, tight up to constants when singular vectors can flip, and make the
      noise on A enormous compared to its entries (~1/√n) — that is the honest price.
    * ``"heuristic"``: Δ = C·p for both factors, as if the factors were as sensitive
      as W̄. This is NOT a differential-privacy guarantee (only a first-order,
      large-gap approximation); releases are marked ``"heuristic": True``.

    Returns (B, A, releases) with releases "factor_B" and "factor_A".
    """
    _check_sigma_clip(noise_multiplier, clip)
    if calibration not in ("norm_bound", "heuristic"):
        raise ValueError(f"calibration must be 'norm_bound' or 'heuristic', got {calibration!r}")
    Bc, Ac, _ = clip_clients(Bs, As, clip)
    w = linalg.client_weights(weights, len(Bc))
    wb = _weight_bound(w, weight_bound)
    B, A = linalg.truncated_svd_factors(Bc, Ac, w, rank, split="left")
    heuristic = calibration == "heuristic"
    if heuristic:
        sens_B = sens_A = projection_sensitivity(clip, wb)
    else:
        cb = float(factor_clip) if factor_clip is not None else float(clip)
        if not (cb > 0) or (noise_multiplier > 0 and math.isinf(cb)):
            raise ValueError(f"factor_clip must be > 0 (finite when noisy), got {cb}")
        nb = torch.linalg.matrix_norm(B)
        if math.isfinite(cb) and float(nb) > cb:
            B = B * (cb / nb)
        sens_B, sens_A = 2.0 * cb, 2.0 * math.sqrt(rank)
    if noise_multiplier > 0:
        if generator is None:
            raise ValueError("a generator is required when noise_multiplier > 0")
        nB = gaussian_noise(tuple(B.shape), noise_multiplier * sens_B, generator, B)
        nA = gaussian_noise(tuple(A.shape), noise_multiplier * sens_A, generator, A)
        # two releases (fl.privacy.tap), each at its own declared sensitivity
        B = tap.release("powerdp-output-B", B, nB, sens_B, released=B + nB)
        A = tap.release("powerdp-output-A", A, nA, sens_A, released=A + nA)
    recs = [
        _record("factor_B", 0, sens_B, noise_multiplier, shape=list(B.shape)),
        _record("factor_A", 0, sens_A, noise_multiplier, shape=list(A.shape)),
    ]
    if heuristic:
        for r in recs:
            r["heuristic"] = True
    return B, A, recs


def no_perturbation(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    weights,
    rank: int,
    clip: float = math.inf,
) -> tuple[Tensor, Tensor, list[dict]]:
    """Non-private reference: clip (``clip=inf``: none), exact truncated SVD of W̄
    (factored). Returns (B = U_r Σ_r, A = V_rᵀ, []) — no releases to account."""
    Bc, Ac, _ = clip_clients(Bs, As, clip)
    B, A = linalg.truncated_svd_factors(Bc, Ac, weights, rank, split="left")
    return B, A, []


# -------------------------------------------------------------------------- accounting


def powerdp_epsilon(
    noise_multiplier: float,
    delta: float,
    rounds: int,
    iters: int,
    client_rate: float,
    accountant: str = "pld",
) -> float:
    """ε(δ) of ``rounds`` PowerDP rounds: each round is one Poisson-subsampled (rate
    ``client_rate``) Gaussian with multiplier σ/√(2·iters+1) (see module docstring)."""
    # imported here: dp_accounting (with scipy) is ~2 s of imports that a process which
    # only aggregates (the aggregation benchmark's memory probes) does not need
    from fl.privacy.accounting import epsilon

    return epsilon(
        round_noise_multiplier(noise_multiplier, iters), client_rate, rounds, delta, accountant
    )


def calibrate_powerdp_sigma(
    target_epsilon: float,
    delta: float,
    rounds: int,
    iters: int,
    client_rate: float,
    accountant: str = "pld",
) -> float:
    """Per-release noise multiplier σ so that ``rounds`` rounds of PowerDP with ``iters``
    iterations (releases_per_round(iters) releases each) reach at most ``target_epsilon``.

    σ_round = calibrate_noise(target_epsilon, client_rate, rounds, delta) for one
    subsampled Gaussian per round, and σ = σ_round·√(releases_per_round(iters)) — the
    same as calibrating rounds×releases plain Gaussian releases when client_rate = 1,
    and correct (not optimistic) when client_rate < 1.
    """
    from fl.privacy.accounting import calibrate_noise

    s_round = calibrate_noise(target_epsilon, client_rate, rounds, delta, accountant)
    sigma = s_round * math.sqrt(releases_per_round(iters))
    # guard against the last-ulp loss of σ·√n/√n: the returned σ must meet the target
    while powerdp_epsilon(sigma, delta, rounds, iters, client_rate, accountant) > target_epsilon:
        sigma *= 1.0 + 1e-9
    return sigma
