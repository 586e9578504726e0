"""FedProx on the LoRA parameters: FedAvg-LoRA with the proximal term μ/2‖θ − θ_global‖²
in each client's objective (θ = trainable LoRA factors and head). The term's gradient
μ(θ − θ_global) does not depend on the data, so under DP-SGD it is added after
clipping and noise (it needs no privatization)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fl.errors import UsageError
from fl.methods.base import Options
from fl.methods.context import ClientView
from fl.methods.fedavg import FedAvg
from fl.methods.registry import register


@dataclass
class FedProxOptions(Options):
    mu: float = field(default=0.01, metadata={"help": "proximal coefficient μ >= 0"})

    def validate(self):
        if not (self.mu >= 0):
            raise UsageError(f"fedprox option mu must be >= 0, got {self.mu}")


@register
class FedProx(FedAvg):
    name = "fedprox"
    Options = FedProxOptions

    def on_train(self, client: ClientView, payload: dict) -> dict:
        return self.local_train(client, payload, prox_mu=self.opts.mu)
