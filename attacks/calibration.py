"""Difficulty-calibrated loss attack (Watson et al. 2022).

score(x) = −(ℓ_target(x) − mean_{j: x ∉ D_j} ℓ_j(x)): the target's loss relative to the
loss of reference models trained *without* x on the attacker's own data with the same
pipeline; an example that is just easy (low loss everywhere) no longer looks like a member.
"""

from __future__ import annotations

import numpy as np

THREAT_MODEL = (
    "query access to the target's loss on the candidates; the training pipeline "
    "(model, method, config) and same-distribution data to train reference models that "
    "exclude the scored example (only references that did not train on x are used)"
)


def calibration_scores(target_loss, ref_loss, ref_in=None) -> np.ndarray:
    """Args:
        target_loss: (n,) target loss in nats.
        ref_loss: (k, n) loss of k reference models on the same examples.
        ref_in: (k, n) bool, True where reference j trained on example i (those are left
            out of the mean); None = no reference trained on any example. Where an example
            has no OUT reference, the mean over all references is used.
    Returns: (n,) scores, higher = member.
    """
    t = np.asarray(target_loss, dtype=np.float64)
    r = np.asarray(ref_loss, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != t.shape[0] or r.shape[0] < 1:
        raise ValueError(f"ref_loss must be (k>=1, {t.shape[0]}), got {r.shape}")
    out = np.ones_like(r, dtype=bool) if ref_in is None else ~np.asarray(ref_in, dtype=bool)
    n_out = out.sum(axis=0)
    mean_out = np.where(out, r, 0.0).sum(axis=0) / np.maximum(n_out, 1)
    mean_ref = np.where(n_out > 0, mean_out, r.mean(axis=0))
    return -(t - mean_ref)
