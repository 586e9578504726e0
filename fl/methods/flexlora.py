"""FlexLoRA: exact average of the clients' full updates ΔW_k = s·B_k A_k, redistributed
to each client as the top-r_k SVD factors of the global update.

Server state: the global update G = Σ_k p_k B_k A_k of the last round (p_k ∝ n_k), kept
*exactly* in factored float64 form (B_g = [p_1 B_1 .. p_K B_K], A_g = [A_1; ..; A_K],
:func:`fl.linalg.flora_stack`, width Σ r_k <= K·R, re-factored exactly at min(m, n) if
wider). Effective update s·G with s = alpha / R for every client (``fl.models.factors``).

Round: client k gets (B_k, A_k) = top-r_k SVD factors of G
(:func:`fl.linalg.flexlora_redistribute`, split B = U√Σ, A = √ΣVᵀ) in ranks 0..r_k−1 of
its rank-R adapter; ranks ≥ r_k are zero in A and B and masked, so they stay zero. A
rank whose singular value is 0 (e.g. every rank in round 1, when G = B_0 A_0 = 0) would
have B = A = 0 and never get a gradient; it gets A = the initial LoRA A row and B = 0
instead (peft's init: trainable, and B = 0 keeps the function unchanged). The client
trains its r_k ranks and the head and sends B_k A_k back as factors.

Noise: init_noise = mean_k ‖s·B_kA_k(start) − s·G‖_F = s·sqrt(Σ_{j>r_k} σ_j(G)²) — > 0
when r_k < rank(G); computed by the server, which knows both. agg_noise = 0 up to
float64 rounding (exact stacking). What is released (and evaluated) is the rank-R
truncated SVD of G plus the head; ``release_rel_error`` = ‖G − G_R‖_F/‖G‖_F.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl.linalg import factored_svd, flexlora_redistribute, flora_stack
from fl.linalg.noise import agg_noise, state_distance
from fl.methods.base import Method, Options, RoundInfo
from fl.methods.context import ClientView
from fl.methods.flora import compress_exact, release_truncation, wide_from_tensors, wide_tensors
from fl.methods.plora import client_rank, head_average, mean, rank_mask
from fl.methods.registry import register

# A singular value at or below this fraction of the largest counts as 0 (dead rank).
_DEAD_RTOL = 1e-10


def client_start_factors(
    Bg: torch.Tensor, Ag: torch.Tensor, r: int, R: int, A_init: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-R start factors of a rank-r client from the global update G = B_g A_g.

    Ranks 0..r−1: top-r SVD factors of G; where σ_j(G) is 0 (<= 1e-10 σ_max), B column 0
    and A row = ``A_init`` row j. Ranks r..R−1: zero. Returns B (m×R), A (R×n) in the dtype
    of ``A_init``."""
    B, A = flexlora_redistribute(Bg, Ag, r)
    sv = factored_svd([Bg], [Ag], None)[1]
    smax = float(sv[0]) if sv.numel() else 0.0
    sv_r = torch.zeros(r, dtype=sv.dtype)
    sv_r[: min(r, sv.numel())] = sv[:r]
    dead = sv_r <= _DEAD_RTOL * smax if smax > 0 else torch.ones(r, dtype=torch.bool)
    B, A = B.clone(), A.clone()
    B[:, dead] = 0.0
    A[dead, :] = A_init[:r][dead].to(A.dtype)
    dtype = A_init.dtype
    Bf = torch.zeros(Bg.shape[0], R, dtype=dtype)
    Af = torch.zeros(R, Ag.shape[1], dtype=dtype)
    Bf[:, :r], Af[:r, :] = B.to(dtype), A.to(dtype)
    return Bf, Af


def server_layer(
    Bs: list[torch.Tensor], As: list[torch.Tensor], weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexLoRA's server step on one layer (pure; the method and ``analysis.hetero``
    call it): the exact average G = Σ p_k B_k A_k, kept in factored float64 form
    (:func:`fl.linalg.flora_stack`, re-factored exactly at min(m, n) when wider). It is
    NOT truncated to rank R: clients start from the top-r_k factors of this exact G
    (:func:`client_start_factors`); only the released adapter is the rank-R truncation."""
    Bs = [B.double() for B in Bs]
    As = [A.double() for A in As]
    return compress_exact(*flora_stack(Bs, As, weights))


@dataclass
class FlexLoRAOptions(Options):
    pass


@register
class FlexLoRA(Method):
    """Server state: the exact average update G = Σ p_k B_k A_k per module (``stack``,
    float64, wide) and A_0 (``A_init``, for a client's dead ranks); released: G_R."""

    name = "flexlora"
    Options = FlexLoRAOptions
    dp_levels = ("none", "sample")
    release_note = (
        "rank-R truncated SVD of the exact average update Σ p_k B_k A_k "
        "(release_rel_error in metrics) and the classification head"
    )

    def init_state(self, initial: dict) -> None:
        """G_0 = B_0 A_0 of the initial adapter (0, since B_0 = 0)."""
        super().init_state(initial)
        self.A_init = {m: ab["A"].clone() for m, ab in initial["factors"].items()}
        self.stack = {
            m: (ab["B"].double().clone(), ab["A"].double().clone())
            for m, ab in initial["factors"].items()
        }

    def global_update_state(self) -> dict:
        """G as a (wide, float64) pseudo-state for fl.linalg.noise."""
        return {"factors": {m: {"B": B, "A": A} for m, (B, A) in self.stack.items()}}

    def server_round(self, rnd: RoundInfo, clients, send) -> dict:
        srv = self.server
        s, R = srv.scaling, srv.cfg.rank
        glob = self.global_update_state()
        payloads, inits = {}, {}
        for cid in clients:
            r = srv.client_rank(cid)
            factors = {}
            for m, (Bg, Ag) in self.stack.items():
                B, A = client_start_factors(Bg, Ag, r, R, self.A_init[m])
                factors[m] = {"A": A, "B": B}
            start = {"factors": factors, "head": self.global_state["head"]}
            payloads[cid] = {"state": start, "rank": r}
            inits[cid] = state_distance(start, glob, s)
        replies = send(clients, "train", payloads, per_client=True)
        if not replies.ok:
            return {"failed_clients": replies.failed, "skipped": "no client replied"}
        cids = replies.senders
        ns = [float(replies.ok[c]["n"]) for c in cids]
        ps = [x / sum(ns) for x in ns]
        for m in self.stack:
            Bs = [replies.ok[c]["factors"][m]["B"] for c in cids]
            As = [replies.ok[c]["factors"][m]["A"] for c in cids]
            self.stack[m] = server_layer(Bs, As, ps)
        head = head_average([replies.ok[c]["head"] for c in cids], ns)
        factors, release_err = release_truncation(self.stack, self.global_state["factors"], R, 1.0)
        self.global_state = {"factors": factors, "head": head}
        client_states = [{"factors": replies.ok[c]["factors"]} for c in cids]
        metrics = {
            "train_loss": mean(replies.ok[c]["loss"] for c in cids),
            "init_noise": mean(inits[c] for c in cids),
            "agg_noise": agg_noise(self.global_update_state(), client_states, ns, s),
            "release_rel_error": release_err,
        }
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        return metrics

    def on_train(self, client: ClientView, payload: dict) -> dict:
        start = payload["state"]
        r = int(payload["rank"])
        if r != client_rank(client):
            raise RuntimeError(
                f"server sent rank {r} to client {client.id} of rank {client_rank(client)}"
            )
        res = client.train(
            start, trainable=("A", "B", "head"), grad_mask=rank_mask(start, range(r))
        )
        factors = {
            m: {"B": ab["B"][:, :r].clone(), "A": ab["A"][:r, :].clone()}
            for m, ab in res.state["factors"].items()
        }
        return {"factors": factors, "head": res.state["head"], "loss": res.loss, "n": client.n}

    def state_dict(self):
        tensors, meta = super().state_dict()
        return {**tensors, **wide_tensors("flexlora", self.stack)}, meta

    def load_state_dict(self, tensors, meta) -> None:
        super().load_state_dict(tensors, meta)
        self.stack = wide_from_tensors("flexlora", tensors) or self.stack
