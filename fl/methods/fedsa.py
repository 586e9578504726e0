"""FedSA-LoRA: A is shared and averaged; each client's B stays with the client
(personalization). The server never sees B_k.

Released/evaluated: the *global* model is (global A, average of the clients' last B —
sent only for evaluation and release here, as the paper's global baseline); the
*personalized* models (global A, B_k) are evaluated too (``personalized_accuracy``,
the mean over the clients that took part in the round). Under sample-level DP both A
and B are trained by DP-SGD, so everything released is post-processing.
"""

from __future__ import annotations

import torch

from fl.methods.context import ClientView
from fl.methods.fedavg import FedAvg
from fl.methods.registry import register
from fl.models import factors as F


@register
class FedSA(FedAvg):
    name = "fedsa"
    dp_levels = ("none", "sample")
    release_note = "shared A, the head, and the data-size-weighted mean of the clients' B"

    def init_state(self, initial):
        super().init_state(initial)
        self.client_B: dict[str, dict[str, torch.Tensor]] = {}

    def server_round(self, rnd, clients, send):
        replies = send(clients, "train", {"state": self.global_state})
        if not replies.ok:
            return {"failed_clients": replies.failed}
        new = self.aggregate_average(replies, keys=("A",))
        # B: the global copy is the size-weighted mean of the B's reported this round
        # (used only for the released global model, never sent back to clients).
        avgB = self.aggregate_average(replies, keys=("B",))
        for k in new["factors"]:
            new["factors"][k]["B"] = avgB["factors"][k]["B"]
        self.global_state = new
        for cid, r in replies.ok.items():
            self.client_B[cid] = {k: ab["B"].clone() for k, ab in r["state"]["factors"].items()}
        self._last = list(replies.ok)
        out = {"train_loss": sum(r["loss"] for r in replies.ok.values()) / len(replies.ok)}
        out.update(self.noise_metrics(replies))
        return out

    def on_train(self, client: ClientView, payload: dict) -> dict:
        start = F.clone_state(payload["state"])
        local_B = client.state.get("B")
        if local_B is not None:
            for k, ab in start["factors"].items():
                ab["B"] = local_B[k]
        out = self.local_train(client, payload, start=start)
        client.state["B"] = {k: ab["B"].clone() for k, ab in out["state"]["factors"].items()}
        return out

    def eval_states(self):
        # One personalized model: the most recent client's (keeps evaluation cheap);
        # the metric name says what it is.
        if not getattr(self, "_last", None):
            return {}
        cid = self._last[0]
        st = F.clone_state(self.global_state)
        for k in st["factors"]:
            st["factors"][k]["B"] = self.client_B[cid][k]
        return {f"personalized_client{cid}": st}

    def state_dict(self):
        t, meta = super().state_dict()
        for cid, bs in self.client_B.items():
            for k, v in bs.items():
                t[f"clientB/{cid}/{k}"] = v
        meta["last"] = getattr(self, "_last", [])
        return t, meta

    def load_state_dict(self, tensors, meta):
        super().load_state_dict(tensors, meta)
        self.client_B = {}
        for key, v in tensors.items():
            if key.startswith("clientB/"):
                _, cid, k = key.split("/", 2)
                self.client_B.setdefault(cid, {})[k] = v
        self._last = meta.get("last", [])
