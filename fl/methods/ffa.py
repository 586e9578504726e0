"""FFA-LoRA: A stays frozen at its random initialization; only B (and the head) is
trained and averaged. With a shared A the average of products is exact:
Σ p_k B_k A = (Σ p_k B_k) A. Under DP the noise reaches ΔW only through B, so its
power grows linearly in σ² (no σ⁴ cross term)."""

from __future__ import annotations

from fl.methods.fedavg import FedAvg
from fl.methods.registry import register


@register
class FFA(FedAvg):
    name = "ffa"
    trainable = ("B", "head")
    averaged = ("B",)
