"""Loss attack (Yeom et al. 2018): members have lower loss, so score = −ℓ(x, y)."""

from __future__ import annotations

import numpy as np

THREAT_MODEL = (
    "black-box query access to the target model's loss (or logits) on the candidate "
    "examples and their labels; no other data, no reference models"
)


def loss_scores(target_loss) -> np.ndarray:
    """Args: target_loss (n,) cross-entropy in nats. Returns (n,) scores, higher = member."""
    return -np.asarray(target_loss, dtype=np.float64)


THREAT_MODEL_CLASS = (
    "black-box query access to the target model's loss on the candidate examples and their "
    "labels; each loss is compared with the mean loss of the candidates of its class (no "
    "membership labels, no other data, no reference models)"
)


def class_centered_scores(target_loss, labels) -> np.ndarray:
    """The loss attack with each class's offset removed: score = −(ℓ(x, y) − ℓ̄_y), where
    ℓ̄_y is the mean loss of the candidates labelled y (members and non-members alike: the
    attacker knows the labels, not the membership).

    Within a class it ranks like :func:`loss_scores`; across classes it no longer mistakes
    a class that is merely harder (higher loss for everyone) for the non-members' class.
    Where members and non-members differ in their class mix, the plain loss attack's AUC
    moves off 0.5 with no memorization at all; this one does not.

    Args: target_loss (n,) in nats; labels (n,) integer class labels.
    Returns: (n,) scores, higher = member.
    """
    t = np.asarray(target_loss, dtype=np.float64)
    y = np.asarray(labels)
    if y.shape != t.shape:
        raise ValueError(f"labels must have the loss's shape {t.shape}, got {y.shape}")
    classes, inv = np.unique(y, return_inverse=True)
    means = np.bincount(inv, weights=t, minlength=classes.size) / np.bincount(inv)
    return -(t - means[inv])
