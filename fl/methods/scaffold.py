"""SCAFFOLD on the LoRA parameters (and head): control variates correct client drift.

Client k starts from the global θ, takes its local steps with gradient g + (c − c_k),
then updates its control variate (option II of Karimireddy et al. 2020):
c_k⁺ = c_k − c + (θ − y_k) / (K·η) with K local steps and learning rate η. The server
sets θ ← Σ p_k y_k (global step size 1) and c ← c + (|S|/N) · mean_k(c_k⁺ − c_k).

Under DP-SGD the correction term is data-independent given (c, c_k) and is added after
privatization; c_k is computed from the client's DP-trained parameters, so sending
it is post-processing. Option II is derived for SGD; with AdamW it is the same
heuristic used in practice.
"""

from __future__ import annotations

import torch

from fl.methods.context import ClientView
from fl.methods.fedavg import FedAvg
from fl.methods.registry import register
from fl.models import factors as F


@register
class Scaffold(FedAvg):
    name = "scaffold"
    dp_levels = ("none", "sample")

    def init_state(self, initial):
        super().init_state(initial)
        self.c = {k: torch.zeros_like(v) for k, v in F.flatten_state(self.global_state).items()}

    def server_round(self, rnd, clients, send):
        replies = send(clients, "train", {"state": self.global_state, "c": self.c})
        if not replies.ok:
            return {"failed_clients": replies.failed}
        self.global_state = self.aggregate_average(replies, keys=("A", "B"))
        N = self.server.cfg.clients
        frac = len(replies.ok) / N
        for k in self.c:
            dc = sum(r["delta_c"][k] for r in replies.ok.values()) / len(replies.ok)
            self.c[k] = self.c[k] + frac * dc
        out = {"train_loss": sum(r["loss"] for r in replies.ok.values()) / len(replies.ok)}
        out.update(self.noise_metrics(replies))
        return out

    def on_train(self, client: ClientView, payload: dict) -> dict:
        c = payload["c"]
        ck = client.state.get("c") or {k: torch.zeros_like(v) for k, v in c.items()}
        correction = {k: c[k] - ck[k] for k in c}
        start = payload["state"]
        res = client.train(start, trainable=self.trainable, correction=correction)
        x, y = F.flatten_state(start), F.flatten_state(res.state)
        # c_i+ = c_i − c + (x − y_i) / (K·η), with η the key's own learning rate
        new_ck = {k: ck[k] - c[k] + (x[k] - y[k]) / (res.steps * client.lr_of(k)) for k in c}
        client.state["c"] = new_ck
        delta_c = {k: new_ck[k] - ck[k] for k in c}
        return {
            "state": res.state,
            "loss": res.loss,
            "n": client.n,
            "delta_c": delta_c,
            "init_noise": 0.0,
        }

    def state_dict(self):
        t, meta = super().state_dict()
        for k, v in self.c.items():
            t[f"c/{k}"] = v
        return t, meta

    def load_state_dict(self, tensors, meta):
        super().load_state_dict(tensors, meta)
        self.c = {k[2:]: v for k, v in tensors.items() if k.startswith("c/")}
