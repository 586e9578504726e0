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
