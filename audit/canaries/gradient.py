"""Scores of gradient (Dirac) canaries for the one-run audit (``fedlora audit RUN
--one-run`` on a run trained with ``--canary-kind gradient``; the mechanism and the
observation files: :mod:`fl.privacy.gradient_canaries`).

Each canary j has, for every DP-SGD step t of its client, the observation
x_t = (privatized step sum at its coordinate) = Σ_i clip(g_i)_j + b_j·s_t·C + N(0, σ²C²),
with b_j its inclusion bit and s_t ~ Bernoulli(q) its Poisson coin. With u_t = x_t / C and
the data's own gradient at the coordinate ignored, the log-likelihood ratio of one step is
log[(1 − q) + q·exp((u_t − ½)/σ²)], and the steps are independent given b_j (fresh coins
and noise), so the Neyman–Pearson statistic of a canary is their sum (``llr``, the
default). For q = 1 it is the linear statistic Σ_t u_t/σ up to an affine map; for q < 1 it
gives more weight to the few steps where the canary was sampled. ``linear`` (Σ_t u_t/σ)
is kept for comparison. Either is a function of the mechanism's outputs (and public σ, q,
C) only, so the one-run bound stays valid whatever its power.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fl.privacy.gradient_canaries import KIND, group_of, read_observations

#: the statistic the audit uses
DEFAULT_STATISTIC = "llr"


def score_linear(u: np.ndarray, sigma: float) -> np.ndarray:
    """Σ_t u_t/σ over the steps (axis 0), u = observation / C (σ = 0: Σ_t u_t)."""
    return u.sum(axis=0) / (sigma if sigma > 0 else 1.0)


def score_llr(u: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """Σ_t log[(1−q) + q·exp((u_t − ½)/σ²)], u = observation / C: the log-likelihood ratio
    of "included" against "not" when step t observes u_t ~ N(s_t, σ²), s_t ~ Bernoulli(q)
    (included) or u_t ~ N(0, σ²) (not), ignoring the data's own gradient at the
    coordinate. σ = 0: Σ_t u_t (no ratio exists)."""
    if sigma <= 0:
        return u.sum(axis=0)
    z = (u - 0.5) / sigma**2
    if q >= 1:
        return z.sum(axis=0)
    return np.logaddexp(math.log1p(-q), math.log(q) + z).sum(axis=0)


STATISTICS = {
    "llr": "sum over the canary's steps of log[(1-q) + q exp((x/C - 1/2)/sigma^2)] "
    "(log-likelihood ratio of the subsampled Gaussian; x = privatized step sum at the "
    "canary's coordinate)",
    "linear": "sum over the canary's steps of x / (sigma C) (x = privatized step sum at the "
    "canary's coordinate)",
}


#: a group (A factors, B factors, head) whose observed noise is below this fraction of
#: the claimed σ is scored at its observed noise level instead of the claimed one
NOISE_FLOOR = 0.5
#: the smallest observed/claimed ratio a score uses (a noiseless group: no division by 0)
MIN_RATIO = 1e-3


def observed_noise(records: list[dict], observations: list[dict]) -> dict[str, float]:
    """Per canary group (:func:`fl.privacy.gradient_canaries.group_of`: ``A``, ``B``,
    ``head``): ρ = observed / claimed noise, sqrt of the mean over the group's canaries and
    consecutive steps of one local training of (u_t − u_{t−1})² / (2σ²), u = observation / C.
    With fresh N(0, σ²) noise and a slowly moving data gradient ρ ≈ 1 (the canary's own
    C cancels at q = 1; at q < 1 its coins add at most q(1−q)/σ² to ρ²). A function of the
    DP outputs and public σ, C only, so a score that uses it keeps the bound valid."""
    acc: dict[str, list[float]] = {}
    for ob in observations:
        ids = np.asarray(ob["ids"], dtype=np.int64)
        obs = np.asarray(ob["obs"], dtype=np.float64).reshape(-1, len(ids))
        sigma = float(ob["sigma"])
        if ids.size == 0 or obs.shape[0] < 2 or sigma <= 0:
            continue
        d2 = (np.diff(obs / ob["clip"], axis=0) ** 2).sum(axis=0) / (2 * sigma**2)
        for g, v in zip((group_of(records[j]["param"]) for j in ids), d2):
            a = acc.setdefault(g, [0.0, 0.0])
            a[0] += float(v)
            a[1] += obs.shape[0] - 1
    return {g: math.sqrt(a[0] / a[1]) for g, a in sorted(acc.items()) if a[1] > 0}


def canary_scores(
    records: list[dict], observations: list[dict], statistic: str, noise: dict | None = None
) -> np.ndarray:
    """One score per canary (``records`` order): the sum over every observation of it
    (every step of every local training of its client) of the per-step statistic; 0 for a
    canary never observed.

    The statistic is taken at the claimed σ, except for a group whose observed noise
    (``noise``, :func:`observed_noise`, computed when None) is below :data:`NOISE_FLOOR`
    times it: that group's canaries are scored at σ·ρ, the noise the observations carry.
    A group missing its noise would otherwise be ranked by the claimed σ's scale and lost
    among the noisy groups' extremes. With noise as claimed (every correct run) the scores
    are those of the claimed σ, bit for bit. At q < 1 such a group's observations are taken
    relative to their minimum over the steps of one local training (per canary): the canary's
    coins make it jump between steps, while a noise that is the same at every step (a reused
    draw) cancels."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {list(STATISTICS)}")
    if records and all(isinstance(c, dict) and "param" in c for c in records):
        noise = observed_noise(records, observations) if noise is None else noise
    else:
        noise = {}
    low = {g: max(r, MIN_RATIO) for g, r in noise.items() if r < NOISE_FLOOR}
    scores = np.zeros(len(records), dtype=np.float64)
    for ob in observations:
        ids = np.asarray(ob["ids"], dtype=np.int64)
        obs = np.asarray(ob["obs"], dtype=np.float64).reshape(-1, len(ids))
        if ids.size == 0 or obs.shape[0] == 0:
            continue
        if ids.min() < 0 or ids.max() >= len(records):
            raise ValueError(f"{ob.get('file')}: canary ids outside the canary set")
        u = obs / ob["clip"]
        sigma = ob["sigma"]
        if low and sigma > 0:
            ratio = np.array([low.get(group_of(records[j]["param"]), 1.0) for j in ids])
            if (ratio < 1).any():
                if ob["q"] < 1 and u.shape[0] > 1:
                    # relative to the canary's lowest step of this local training: a noise
                    # that does not change between steps cancels, the coins' pattern stays
                    u = np.where(ratio < 1, u - u.min(axis=0), u)
                s = _score_at(u, sigma * ratio, ob["q"], statistic)
                np.add.at(scores, ids, s)
                continue
        if statistic == "llr":
            s = score_llr(u, sigma, ob["q"])
        else:
            s = score_linear(u, sigma)
        np.add.at(scores, ids, s)
    return scores


def _score_at(u: np.ndarray, sigmas: np.ndarray, q: float, statistic: str) -> np.ndarray:
    """The statistic with one σ per canary (column), every σ > 0."""
    if statistic == "linear":
        return u.sum(axis=0) / sigmas
    z = (u - 0.5) / sigmas**2
    if q >= 1:
        return z.sum(axis=0)
    return np.logaddexp(math.log1p(-q), math.log(q) + z).sum(axis=0)


def is_gradient(canaries: list) -> bool:
    """Whether ``splits.json``'s canaries are gradient canaries (``"kind": "gradient"``)."""
    return bool(canaries) and all(isinstance(c, dict) and c.get("kind") == KIND for c in canaries)


def run_scores(run_dir: str | Path, canaries: list[dict], statistic: str = DEFAULT_STATISTIC):
    """(scores, observation summary) of a run's gradient canaries from its private
    observation files."""
    obs = read_observations(run_dir)
    noise = observed_noise(canaries, obs)
    scores = canary_scores(canaries, obs, statistic, noise)
    steps = sum(int(np.asarray(o["obs"]).shape[0]) for o in obs)
    return scores, {
        "files": len(obs),
        "client_steps": steps,
        # where the B canaries live: "flat" (DP-SGD's coordinates) or "w" (FedASK's W-space
        # slots, fl/privacy/wspace.py); the head's are coordinates either way
        "space": sorted({str(o.get("space", "flat")) for o in obs}),
        # per group: observed / claimed noise, and the σ its canaries were scored at
        "noise": {
            g: {
                "observed_over_claimed": r,
                "scored_at": "observed" if r < NOISE_FLOOR else "claimed",
            }
            for g, r in noise.items()
        },
    }


__all__ = [
    "DEFAULT_STATISTIC",
    "STATISTICS",
    "canary_scores",
    "is_gradient",
    "observed_noise",
    "run_scores",
    "score_linear",
    "score_llr",
]
