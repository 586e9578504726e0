"""FedAvg-LoRA (FedIT): clients train A, B and the head; the server averages A and B
*separately* (weights p_k ∝ n_k).

The average of products is not the product of averages: Σ p_k B_k A_k ≠ (Σ p_k B_k)(Σ p_k
A_k) — the cross-term error that exact-aggregation methods remove. Under client-level
DP the clipped updates of A, B and the head get server-side Gaussian noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl.methods.base import Method, Options, Replies, RoundInfo
from fl.methods.context import ClientView
from fl.methods.registry import register


@dataclass
class FedAvgOptions(Options):
    pass


@register
class FedAvg(Method):
    name = "fedavg"
    Options = FedAvgOptions
    dp_levels = ("none", "sample", "client")
    trainable = ("A", "B", "head")
    averaged = ("A", "B")
    head_warmup = True

    def payload(self, rnd: RoundInfo, cid: str) -> dict:
        return {"state": self.global_state}

    def server_round(self, rnd, clients, send):
        replies = send(clients, "train", {"state": self.global_state}) if clients else Replies()
        # Under client-level DP an empty cohort still gets a pure-noise release.
        if not replies.ok and self.server.dp_level != "client":
            return {"failed_clients": replies.failed, "skipped": "no client replied"}
        metrics = {"train_loss": _mean(r["loss"] for r in replies.ok.values())}
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        if self.server.dp_level != "client":
            metrics.update(self.update_norms(replies))
        if self.server.dp_level == "client":
            self.global_state, st = self.client_level_dp_average(rnd, replies, keys=self.averaged)
            metrics.update(st)
        else:
            self.global_state = self.aggregate_average(replies, keys=self.averaged)
        metrics.update(self.noise_metrics(replies))
        return metrics

    def local_train(self, client: ClientView, payload: dict, start=None, **kw) -> dict:
        from fl.linalg.noise import state_distance

        start = payload["state"] if start is None else start
        res = client.train(start, trainable=self.trainable, **kw)
        return {
            "state": res.state,
            "loss": res.loss,
            "n": client.n,
            "examples": res.examples,
            "init_noise": state_distance(start, payload["state"], client.scaling),
        }

    def on_train(self, client: ClientView, payload: dict) -> dict:
        return self.local_train(client, payload)


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")
