"""Likelihood-ratio attack, LiRA (Carlini et al. 2022), on the logit-scaled confidence φ.

Online:  Λ(x) = N(φ_t; μ_in, σ_in²) / N(φ_t; μ_out, σ_out²), with the Gaussians fitted to
         φ of x under the shadow models that trained on x (IN) and that did not (OUT);
         score = log Λ.
Offline: one-sided test against the OUT Gaussian only, Λ = Pr[Z ≤ φ_t], Z ~ N(μ_out, σ_out²);
         the score returned is z = (φ_t − μ_out)/σ_out, a strictly increasing function of
         Λ = Φ(z) for each example, which keeps resolution where Φ(z) rounds to 1.
Global variance (for few shadows): one σ_in and one σ_out for all examples, the pooled
within-example standard deviation of φ (residuals around each example's own mean).
"""

from __future__ import annotations

import numpy as np

THREAT_MODEL_ONLINE = (
    "query access to the target's logits on the candidates; the training pipeline and "
    "same-distribution data; the attacker knows the candidate examples and trains shadow "
    "models on random halves of (candidates ∪ own data), so each candidate is IN some "
    "shadows and OUT of others"
)
THREAT_MODEL_OFFLINE = (
    "query access to the target's logits on the candidates; the training pipeline and "
    "same-distribution data; only shadow models that did NOT train on the scored example "
    "are used (no shadow training after the candidates are known would be needed)"
)
# Smallest standard deviation allowed (φ in nats), so a constant φ cannot divide by zero.
_MIN_STD = 1e-6


def _fit(phi: np.ndarray, mask: np.ndarray, global_variance: bool):
    """Per-example mean (n,) and std (n,) of phi (k, n) over the entries where mask is True."""
    cnt = mask.sum(axis=0)
    mu = np.where(mask, phi, 0.0).sum(axis=0) / np.maximum(cnt, 1)
    resid2 = np.where(mask, (phi - mu) ** 2, 0.0)
    dof_pooled = int(cnt.sum() - (cnt > 0).sum())
    if dof_pooled > 0:
        pooled = np.sqrt(resid2.sum() / dof_pooled)
    else:  # one value per example: fall back to the spread of all values
        pooled = float(np.std(phi[mask])) if mask.any() else 1.0
    if global_variance:
        sd = np.full(phi.shape[1], pooled)
    else:
        per = np.sqrt(resid2.sum(axis=0) / np.maximum(cnt - 1, 1))
        # Fewer than 2 values: no per-example spread; use the pooled one.
        sd = np.where(cnt >= 2, per, pooled)
    return mu, np.maximum(sd, _MIN_STD), cnt


def _check(target_phi, shadow_phi, shadow_in):
    t = np.asarray(target_phi, dtype=np.float64)
    s = np.asarray(shadow_phi, dtype=np.float64)
    m = np.asarray(shadow_in, dtype=bool)
    if s.ndim != 2 or s.shape[1] != t.shape[0] or m.shape != s.shape:
        raise ValueError(
            f"shadow_phi and shadow_in must be (k, {t.shape[0]}), got {s.shape} and {m.shape}"
        )
    return t, s, m


def _log_normal(x, mu, sd):
    return -0.5 * ((x - mu) / sd) ** 2 - np.log(sd) - 0.5 * np.log(2 * np.pi)


def lira_online(target_phi, shadow_phi, shadow_in, global_variance: bool = False) -> np.ndarray:
    """Args:
        target_phi: (n,) φ of the target model on the candidates.
        shadow_phi: (k, n) φ of k shadow models on the same candidates.
        shadow_in: (k, n) bool, shadow j trained on candidate i.
        global_variance: one σ_in / σ_out for all examples (recommended below ~16 shadows).
    Returns: (n,) log-likelihood ratios, higher = member.
    Raises: ValueError if some candidate has no IN or no OUT shadow.
    """
    t, s, m = _check(target_phi, shadow_phi, shadow_in)
    mu_in, sd_in, c_in = _fit(s, m, global_variance)
    mu_out, sd_out, c_out = _fit(s, ~m, global_variance)
    if (c_in == 0).any() or (c_out == 0).any():
        raise ValueError("online LiRA needs at least one IN and one OUT shadow per example")
    return _log_normal(t, mu_in, sd_in) - _log_normal(t, mu_out, sd_out)


def lira_offline(target_phi, shadow_phi, shadow_in, global_variance: bool = False) -> np.ndarray:
    """Offline LiRA: (n,) z = (φ_t − μ_out)/σ_out, higher = member (see module doc).
    Same arguments as :func:`lira_online`; only OUT entries are used."""
    t, s, m = _check(target_phi, shadow_phi, shadow_in)
    mu_out, sd_out, c_out = _fit(s, ~m, global_variance)
    if (c_out == 0).any():
        raise ValueError("offline LiRA needs at least one OUT shadow per example")
    return (t - mu_out) / sd_out
