"""Is the batch sampling what the ledger says? A permutation test on sampler canaries.

Sampler canaries (:mod:`fl.privacy.sampler_canaries`) are records that the trainer's own
sampler draws into batches like every example, but whose gradient lives on coordinates of
their own (no example touches them): at step t canary j's observed privatized sum, in units
of C, is

    u_{t,j} = s_{t,j} + σ·ξ_{t,j},

s_{t,j} ∈ {0, 1} the sampler's decision (after the clip a canary adds exactly C) and ξ the
step's fresh N(0, 1) noise. No data term: the coordinates are isolated, so nothing here
depends on what the data or the model do.

Under the claimed Poisson sampling, s_{t,j} are i.i.d. Bernoulli(q) over steps, and the
noise i.i.d. over steps, so each canary's series (u_{1,j}, …, u_{T,j}) within one local
training is exchangeable: its distribution does not change when the steps are permuted —
whatever σ and q are. A shuffled or fixed batch schedule (each record once per epoch of
L ≈ 1/q steps) makes a canary's appearances repel each other within an epoch: the series'
autocovariances at lags 1 … L−1 are negative (−q² each in s-units), and a window of L
consecutive steps from the start of the local training (where an epoch starts) holds exactly
one appearance instead of Binomial(L, q). The statistic

    A = Σ_j Σ_w (Σ_{t ∈ w} (u_{t,j} − ū_j))²,   windows w of L = round(1/q) steps from step 0,

is small under such a schedule. A schedule that cycles the same batches every epoch (the
planted fault ``fixed_batches``) also puts a canary at the same phase of every epoch: the
statistic

    B = Σ_j Σ_{φ < L} (Σ_e (u_{eL+φ,j} − ū_j))²    (the series folded by phase)

is large under it. Each is compared with its distribution under independent random
permutations of each series' steps (Monte Carlo, P permutations; p_A = (1 + #{A_perm ≤ A}) /
(1 + P), p_B = (1 + #{B_perm ≥ B}) / (1 + P)), and the two are joined by Bonferroni
(p = min(1, 2·min(p_A, p_B))). The test is exact: under the null the observed series is one
more draw from the permutation distribution, so P(p ≤ α) ≤ α for any σ, q, number of
canaries and data.

Power grows with the number of canaries M, the steps T and q: roughly z ≈ sqrt(M·T)·q^{3/2}/σ²;
at q = 0.01 a record is drawn about T·q times in all, and how it was drawn barely shows.
The per-canary counts (Σ_t s_{t,j}, Binomial(T, q) under Poisson) are estimated from the
same series: their dispersion is reported beside the test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingTest", "sampling_test"]


@dataclass(frozen=True)
class SamplingTest:
    """The permutation test's outcome over every local training: the two statistics (each
    standardised by its permutations' spread: ``z_window`` negative and ``z_phase`` positive
    under a shuffled or cycled schedule), their p-values and the joint one, the window
    (steps), and the count dispersion (observed variance of the per-canary sums minus the
    noise's, over Binomial's Tq(1−q): about 1 under Poisson sampling)."""

    z_window: float
    z_phase: float
    p_window: float
    p_phase: float
    p_value: float
    permutations: int
    canaries: int
    steps: int
    window: int
    count_dispersion: float | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _window_stat(x: np.ndarray, L: int) -> np.ndarray:
    """Σ over the windows of L consecutive steps (from step 0; the last one may be shorter)
    of the squared window sums, summed over the series: x is (..., T, M), centred per
    series; returns (...,)."""
    T = x.shape[-2]
    full = (T // L) * L
    out = np.zeros(x.shape[:-2])
    if full:
        w = x[..., :full, :].reshape(*x.shape[:-2], T // L, L, x.shape[-1]).sum(axis=-2)
        out += np.einsum("...wm,...wm->...", w, w)
    if full < T:
        r = x[..., full:, :].sum(axis=-2)
        out += np.einsum("...m,...m->...", r, r)
    return out


def _phase_stat(x: np.ndarray, L: int) -> np.ndarray:
    """Σ over the phases φ < L of the squared sums over the epochs at that phase (the steps
    folded by L; a last partial epoch is left out), summed over the series."""
    T = x.shape[-2]
    full = (T // L) * L
    if full == 0:
        return np.zeros(x.shape[:-2])
    f = x[..., :full, :].reshape(*x.shape[:-2], T // L, L, x.shape[-1]).sum(axis=-3)
    return np.einsum("...pm,...pm->...", f, f)


def sampling_test(
    blocks: list[tuple[np.ndarray, float, float]],
    permutations: int = 999,
    seed: int | None = None,
) -> SamplingTest:
    """The permutation test over ``blocks`` of (u (T, M) in units of C, σ, q): one per local
    training. The permutations come from a generator seeded with ``seed`` (None: the OS's
    entropy); the p-value is exact for any seed."""
    if permutations < 19:
        raise ValueError(f"permutations must be at least 19, got {permutations}")
    rng = np.random.default_rng(seed)
    obs_w = obs_p = 0.0
    perm_w = np.zeros(permutations)
    perm_p = np.zeros(permutations)
    canaries = steps = 0
    window = 0
    disp_num = disp_den = 0.0
    for u, sigma, q in blocks:
        u = np.asarray(u, dtype=np.float64)
        if u.ndim != 2:
            raise ValueError(f"sampler observations must be (steps, canaries), got {u.shape}")
        if not np.isfinite(u).all():
            raise ValueError("sampler observations hold NaN or Inf")
        if not (0 < q <= 1) or not (sigma > 0):
            raise ValueError(f"need 0 < q <= 1 and σ > 0, got q = {q}, σ = {sigma}")
        T, M = u.shape
        if T < 2 or M == 0:
            continue
        L = max(2, min(T, int(round(1 / q))))
        x = u - u.mean(axis=0, keepdims=True)
        obs_w += float(_window_stat(x, L))
        obs_p += float(_phase_stat(x, L))
        # independent permutations of each series' steps, in chunks to bound memory
        chunk = max(1, int(2e7 // max(1, T * M)))
        for s in range(0, permutations, chunk):
            n = min(chunk, permutations - s)
            idx = np.argsort(rng.random((n, T, M)), axis=1)
            xp = np.take_along_axis(np.broadcast_to(x, (n, T, M)), idx, axis=1)
            perm_w[s : s + n] += _window_stat(xp, L)
            perm_p[s : s + n] += _phase_stat(xp, L)
        canaries += M
        steps = max(steps, T)
        window = max(window, L)
        # per-canary sums: Var = Var(count) + Tσ² under the null; Binomial gives Tq(1−q)
        sums = u.sum(axis=0)
        disp_num += float(np.var(sums, ddof=1) - T * sigma**2) * M if M > 1 else 0.0
        disp_den += T * q * (1 - q) * M
    if canaries == 0:
        raise ValueError("no sampler-canary observations with at least two steps")
    p_w = (1 + int(np.sum(perm_w <= obs_w))) / (1 + permutations)
    p_p = (1 + int(np.sum(perm_p >= obs_p))) / (1 + permutations)

    def z(obs: float, perm: np.ndarray) -> float:
        return (obs - float(np.mean(perm))) / (float(np.std(perm)) or 1.0)

    return SamplingTest(
        z_window=z(obs_w, perm_w),
        z_phase=z(obs_p, perm_p),
        p_window=p_w,
        p_phase=p_p,
        p_value=min(1.0, 2 * min(p_w, p_p)),
        permutations=permutations,
        canaries=canaries,
        steps=steps,
        window=window,
        count_dispersion=disp_num / disp_den if disp_den > 0 and math.isfinite(disp_num) else None,
    )
