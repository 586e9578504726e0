"""DP linear probe: the baseline every DP-LoRA method must beat.

Clients train the classification head only, on the frozen encoder's pooled features;
the server averages the heads (p_k ∝ n_k), or under client-level DP clips each client's
head update and adds Gaussian noise (as FedAvg-LoRA does for its released parameters).
The LoRA factors are never trained (B stays 0, so the adapter leaves the encoder
unchanged), which makes the whole encoder a frozen prefix: its pooled features are
computed once per example and every step costs a linear layer (:mod:`fl.models.heads`), so a
private run takes seconds. With sample-level DP each step is DP-SGD on the head alone:
per-example gradients of a linear softmax classifier, clipped to C, with N(0, σ²C²) noise.
"""

from __future__ import annotations

from fl.methods.fedavg import FedAvg
from fl.methods.registry import register


@register
class Probe(FedAvg):
    name = "probe"
    trainable = ("head",)
    averaged = ()
    #: the encoder (and its LoRA factors) is never trained: the engine caches features
    trains_factors = False
