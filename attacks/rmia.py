"""Robust membership inference, RMIA (Zarifzadeh et al. 2024).

For a candidate x and population samples z (same distribution, known to the attacker):
    LR(x, z) = [p_θ(x) / Pr(x)] / [p_θ(z) / Pr(z)],   Pr(·) = mean over reference models,
    score(x) = fraction of z with LR(x, z) > γ,
with p(·) the probability of the true label. Online, Pr(x) averages all reference models
(each x is IN about half of them). Offline (OUT models only) uses the paper's linear
approximation Pr(x) ≈ ½((1+a)·p_OUT(x) + (1−a)), p_OUT = mean over references without x;
the same rule is applied to every z so that numerator and denominator are computed alike.
"""

from __future__ import annotations

import numpy as np

THREAT_MODEL = (
    "query access to the target's output probabilities on the candidates and on population "
    "samples z; the training pipeline and same-distribution data (the population z) to train "
    "reference models; online uses references with and without each candidate, offline only "
    "references without it"
)


def marginal_prob(ref_p, ref_in=None, offline_a: float | None = None) -> np.ndarray:
    """Pr(x) (m,) from reference probabilities ref_p (k, m) and IN masks ref_in (k, m).

    offline_a None: mean over all references. Else: ½((1+a)·mean_OUT + (1−a)); an example
    without OUT references uses the mean over all references as p_OUT.
    """
    p = np.asarray(ref_p, dtype=np.float64)
    if offline_a is None:
        return p.mean(axis=0)
    if not 0.0 <= offline_a <= 1.0:
        raise ValueError(f"offline parameter a must be in [0, 1], got {offline_a}")
    out = np.ones_like(p, bool) if ref_in is None else ~np.asarray(ref_in, bool)
    n_out = out.sum(axis=0)
    p_out = np.where(out, p, 0.0).sum(axis=0) / np.maximum(n_out, 1)
    p_out = np.where(n_out > 0, p_out, p.mean(axis=0))
    return 0.5 * ((1 + offline_a) * p_out + (1 - offline_a))


def rmia_scores(
    target_px,
    ref_px,
    ref_in_x,
    target_pz,
    ref_pz,
    ref_in_z=None,
    gamma: float = 1.0,
    offline_a: float | None = None,
) -> np.ndarray:
    """Args:
        target_px: (n,) target's true-class probability on the candidates.
        ref_px: (k, n) reference models' on the candidates; ref_in_x (k, n) bool IN masks.
        target_pz: (m,) target on population samples; ref_pz (k, m); ref_in_z (k, m) or None.
        gamma: threshold γ >= 1 on the pairwise likelihood ratio.
        offline_a: None = online; a in [0, 1] = offline approximation.
    Returns: (n,) scores in [0, 1], higher = member.
    """
    tx = np.asarray(target_px, dtype=np.float64)
    tz = np.asarray(target_pz, dtype=np.float64)
    if len(tz) == 0:
        raise ValueError("RMIA needs at least one population sample z")
    tiny = np.finfo(np.float64).tiny
    # Work with logs: the ratios of small probabilities stay finite.
    lx = np.log(np.maximum(tx, tiny)) - np.log(
        np.maximum(marginal_prob(ref_px, ref_in_x, offline_a), tiny)
    )
    lz = np.log(np.maximum(tz, tiny)) - np.log(
        np.maximum(marginal_prob(ref_pz, ref_in_z, offline_a), tiny)
    )
    # LR(x,z) > γ  ⇔  lz < lx − log γ: count z strictly below via a sorted array.
    lz_sorted = np.sort(lz)
    count = np.searchsorted(lz_sorted, lx - np.log(gamma), side="left")
    return count / len(lz)
