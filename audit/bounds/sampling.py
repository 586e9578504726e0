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

is large under it. A trainer's epoch is ceil(n/B) batches, not always round(1/q) (B =
round(q·n)): each statistic is computed at L = ⌊1/q⌋, ⌊1/q⌋ + 1 and ⌊1/q⌋ + 2 (per local
training; clipped to [2, T]), six statistics in all. Each is standardised by the mean and
spread of its values over a pilot of 200 random permutations (independent permutations of
each series' steps), and the test statistic is the largest of −z_A and z_B over the
windows: one statistic, so the scan over windows costs no multiplicity correction (the
permutation distribution of the maximum accounts for it). The pilot does not break
exactness: a uniformly permuted copy of the data is a uniform draw from the data's orbit
whatever the observed order, so the standardisation is independent of the observed
statistic's rank among the permuted ones.

**The p-value.** Sequential Monte Carlo (Besag & Clifford, 1991): permutations are drawn
in growing chunks until the h-th exceedance (a permuted maximum at least the observed one;
h = ``stop_after``, 20) at permutation L, p = h / L; when fewer than h exceedances occur in
the P permutations (``permutations``, at most 19 999), p = (1 + g)/(1 + P), g the
exceedances. Both are valid p-values (P(p ≤ α) ≤ α under the null). Under the null the
test stops after about h·(1 + ln(P/h)) permutations on average (a few hundred); a schedule
that is not Poisson runs all P and reaches p = 1/(1 + P) = 5·10⁻⁵, below the threshold
the conformance family's Holm step needs at α = 0.001 (10⁻⁴ with ten tests,
:mod:`audit.bounds.conformance`). ``stop_after=None`` runs all P (a fixed Monte Carlo test).
The test is exact: under the null the observed series is one more draw from the permutation
distribution, so P(p ≤ α) ≤ α for any σ, q, number of canaries and data.

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
    """The permutation test's outcome over every local training: the window statistic's
    smallest z and the phase statistic's largest over the windows tried (each standardised
    by the pilot permutations: ``z_window`` negative and ``z_phase`` positive under a
    shuffled or cycled schedule), their Monte Carlo p-values over the permutations drawn
    (descriptive), the test's p-value (``p_value``, the maximum statistic's, exact), the
    permutations drawn, the window (steps) of the largest z, and the count dispersion
    (observed variance of the per-canary sums minus the noise's, over Binomial's Tq(1−q):
    about 1 under Poisson sampling)."""

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
    max_permutations: int = 0
    stop_after: int | None = None
    statistics: int = 2

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


#: window offsets tried: L = ⌊1/q⌋ + k (module doc)
OFFSETS = (0, 1, 2)
#: permutations that standardise the statistics (module doc)
PILOT = 200
#: a statistic whose pilot spread is below this share of Σx² (the scale of every statistic
#: here) is one the permutations cannot move (float32 rounding only): left out of the maximum
DEGENERATE = 1e-5


def _windows(q: float, T: int) -> list[int]:
    base = int(math.floor(1 / q + 1e-9))
    return [max(2, min(T, base + k)) for k in OFFSETS]


def sampling_test(
    blocks: list[tuple[np.ndarray, float, float]],
    permutations: int = 19_999,
    seed: int | None = None,
    stop_after: int | None = 20,
) -> SamplingTest:
    """The permutation test over ``blocks`` of (u (T, M) in units of C, σ, q): one per local
    training. ``permutations``: at most this many; ``stop_after``: the exceedances after
    which the test stops (sequential Monte Carlo; None: all ``permutations``). The
    permutations come from a generator seeded with ``seed`` (None: the OS's entropy); the
    p-value is exact for any seed (module doc)."""
    if permutations < 19:
        raise ValueError(f"permutations must be at least 19, got {permutations}")
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1 or None, got {stop_after}")
    rng = np.random.default_rng(seed)
    S = 2 * len(OFFSETS)  # (window, phase) per offset
    obs = np.zeros(S)
    data = []  # (x centred, windows)
    canaries = steps = 0
    disp_num = disp_den = energy = 0.0
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
        Ls = _windows(q, T)
        # float32: the permutations run about 2× and the statistics 20× faster; the observed
        # statistic goes through the same float32 code as the permuted ones (exchangeable)
        x = (u - u.mean(axis=0, keepdims=True)).astype(np.float32)
        for k, L in enumerate(Ls):
            obs[2 * k] += float(_window_stat(x, L))
            obs[2 * k + 1] += float(_phase_stat(x, L))
        data.append((x, Ls))
        energy += float(np.square(x, dtype=np.float64).sum())  # the statistics' scale
        canaries += M
        steps = max(steps, T)
        # per-canary sums: Var = Var(count) + Tσ² under the null; Binomial gives Tq(1−q)
        sums = u.sum(axis=0)
        disp_num += float(np.var(sums, ddof=1) - T * sigma**2) * M if M > 1 else 0.0
        disp_den += T * q * (1 - q) * M
    if canaries == 0:
        raise ValueError("no sampler-canary observations with at least two steps")
    sign = np.array([-1.0 if k % 2 == 0 else 1.0 for k in range(S)])  # window: small
    cap = max(1, int(2e7 // max(1, max(x.size for x, _ in data))))

    def draw(n: int) -> np.ndarray:
        st = np.zeros((n, S))
        for x, Ls in data:
            # independent permutations of each series' steps
            xp = rng.permuted(np.broadcast_to(x, (n, *x.shape)), axis=1)
            for k, L in enumerate(Ls):
                st[:, 2 * k] += _window_stat(xp, L)
                st[:, 2 * k + 1] += _phase_stat(xp, L)
        return st

    pilot = np.concatenate([draw(min(cap, PILOT - i)) for i in range(0, PILOT, cap)])
    mean, sd = pilot.mean(axis=0), pilot.std(axis=0)
    # A statistic the permutations cannot move (a window or epoch as long as the run: the
    # square of the whole sum, Σx²) varies only by float rounding; standardised, that
    # rounding would rank the observed value at random — a false alarm at any level. Such
    # statistics are left out (z = −∞); with none left there is nothing to test.
    live = sd > DEGENERATE * max(energy, np.finfo(np.float64).tiny)
    sd = np.where(live, sd, 1.0)
    z_obs = np.where(live, sign * (obs - mean) / sd, -np.inf)
    t_obs = float(z_obs.max())
    exceed = g_w = g_p = 0
    stop_at = 0
    done, chunk = 0, min(cap, 64)
    if not live.any():
        permutations = 0  # p = 1: no statistic the permutations move
    while done < permutations:
        n = min(chunk, permutations - done)
        z = np.where(live, sign * (draw(n) - mean) / sd, -np.inf)
        t = z.max(axis=1)
        ext = t >= t_obs
        if stop_after is not None and exceed + int(ext.sum()) >= stop_after:
            stop_at = done + int(np.flatnonzero(np.cumsum(ext) + exceed >= stop_after)[0]) + 1
        exceed += int(ext.sum())
        g_w += int(np.sum(z[:, 0::2].max(axis=1) >= z_obs[0::2].max()))
        g_p += int(np.sum(z[:, 1::2].max(axis=1) >= z_obs[1::2].max()))
        done += n
        if stop_at:
            break
        chunk = min(cap, 2 * chunk)
    p_value = stop_after / stop_at if stop_at else (1 + exceed) / (1 + done)
    if not live.any():
        p_value = 1.0
    best = int(np.argmax(z_obs))
    return SamplingTest(
        z_window=float(-z_obs[0::2].max()),
        z_phase=float(z_obs[1::2].max()),
        p_window=(1 + g_w) / (1 + done),
        p_phase=(1 + g_p) / (1 + done),
        p_value=float(min(1.0, p_value)),
        permutations=done,
        canaries=canaries,
        steps=steps,
        window=int(data[0][1][best // 2]),
        count_dispersion=disp_num / disp_den if disp_den > 0 and math.isfinite(disp_num) else None,
        max_permutations=permutations,
        stop_after=stop_after,
        statistics=int(live.sum()),
    )
