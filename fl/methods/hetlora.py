"""HETLoRA (heterogeneous LoRA with rank truncation, zero-padding and sparsity-weighted
aggregation).

Round: client k with rank r_k takes the first r_k ranks of the global rank-R adapter
(:func:`fl.linalg.hetlora_truncate`: B[:, :r_k], A[:r_k, :]); in its rank-R model the
ranks ≥ r_k are zero in A and B and masked, so they stay zero. It trains its r_k ranks
and the head and sends B_k (m×r_k), A_k (r_k×n). The server zero-pads to R
(:func:`fl.linalg.hetlora_pad`) and averages B and A *separately* with the sparsity
weights w_k = ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F, per layer (:func:`fl.linalg.hetlora_aggregate`,
uniform when all norms are 0); the head is averaged ∝ n_k. s = alpha / R for every
client (``fl.models.factors``), so truncation does not rescale the kept ranks.

Noise: init_noise_k = ‖s·B_{:, r_k:} A_{r_k:, :}‖_F summed over layers — the dropped
tail of the global adapter, > 0 whenever r_k < R and the tail is non-zero. agg_noise is
measured against the data-size-weighted ideal Σ p_k s·B_k A_k (p_k ∝ n_k, the same ideal
as every other method), so it contains both the A/B cross terms and the effect of the
norm weights.

Rank self-pruning (option ``prune``, default off). Rule used here (a simplified,
regularizer-free form of the paper's self-pruning): after local training, a client of
current rank r > 1 looks at its last t = r − max(1, ⌊γ r⌋) ranks (γ = ``prune_gamma``);
if ‖B_tail A_tail‖_F <= ``prune_tol`` · ‖B A‖_F (summed over layers, squared norms), it
zeroes that tail in its reply and uses rank r − t from the next round on (kept in the
client's persistent state). It is post-processing of the client's (DP-)trained factors,
so it costs no privacy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fl.errors import UsageError
from fl.linalg import factored_fro_norm, hetlora_aggregate, hetlora_pad, hetlora_truncate
from fl.linalg.noise import agg_noise, state_distance
from fl.methods.base import Method, Options, RoundInfo
from fl.methods.context import ClientView
from fl.methods.plora import client_rank, head_average, mean, rank_mask
from fl.methods.registry import register


def server_layer(
    Bs: list[torch.Tensor], As: list[torch.Tensor], R: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HETLoRA's server step on one layer (pure; the method and ``analysis.hetero``
    call it): zero-pad each client's rank-r_k factors to R and average B and A
    separately with the sparsity weights w_k = ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F — norms
    only, no data-size factor (:func:`fl.linalg.hetlora_aggregate`). Returns B (m×R),
    A (R×n)."""
    return hetlora_aggregate(Bs, As, R)


def truncated_start(glob: dict, r: int) -> dict:
    """Client start state: the global rank-R factors truncated to r ranks and zero-padded
    back to R (B: m×R, A: R×n, ranks ≥ r are 0)."""
    R = next(iter(glob["factors"].values()))["A"].shape[0]
    factors = {}
    for m, ab in glob["factors"].items():
        B, A = hetlora_pad(*hetlora_truncate(ab["B"], ab["A"], r), R)
        factors[m] = {"A": A, "B": B}
    return {"factors": factors, "head": glob["head"]}


def prune_decision(factors: dict, r: int, gamma: float, tol: float) -> int:
    """New rank after self-pruning (see module doc) for rank-r factors {m: {"B", "A"}}."""
    keep = max(1, math.floor(gamma * r))
    if r <= 1 or keep >= r:
        return r
    tail = sum(
        float(factored_fro_norm(ab["B"][:, keep:r].double(), ab["A"][keep:r].double())) ** 2
        for ab in factors.values()
    )
    full = sum(
        float(factored_fro_norm(ab["B"][:, :r].double(), ab["A"][:r].double())) ** 2
        for ab in factors.values()
    )
    return keep if full > 0 and math.sqrt(tail) <= tol * math.sqrt(full) else r


@dataclass
class HetLoRAOptions(Options):
    prune: bool = field(default=False, metadata={"help": "rank self-pruning on the clients"})
    prune_gamma: float = field(
        default=0.9, metadata={"help": "fraction of ranks kept when a client prunes (0, 1)"}
    )
    prune_tol: float = field(
        default=0.05, metadata={"help": "prune when ‖tail‖_F <= prune_tol · ‖B A‖_F"}
    )

    def validate(self):
        if not (0.0 < self.prune_gamma < 1.0):
            raise UsageError(
                f"hetlora option prune_gamma must be in (0, 1), got {self.prune_gamma}"
            )
        if not (self.prune_tol >= 0.0 and math.isfinite(self.prune_tol)):
            raise UsageError(f"hetlora option prune_tol must be >= 0, got {self.prune_tol}")


@register
class HetLoRA(Method):
    name = "hetlora"
    Options = HetLoRAOptions
    dp_levels = ("none", "sample")
    release_note = (
        "rank-R LoRA factors (zero-padded client factors averaged with ‖B_kA_k‖_F weights) "
        "and the classification head"
    )

    def server_round(self, rnd: RoundInfo, clients, send) -> dict:
        srv = self.server
        R = srv.cfg.rank
        replies = send(clients, "train", {"state": self.global_state})
        if not replies.ok:
            return {"failed_clients": replies.failed, "skipped": "no client replied"}
        cids = replies.senders
        ns = [float(replies.ok[c]["n"]) for c in cids]
        factors, padded = {}, {c: {} for c in cids}
        for m in self.global_state["factors"]:
            Bs = [replies.ok[c]["factors"][m]["B"] for c in cids]
            As = [replies.ok[c]["factors"][m]["A"] for c in cids]
            B, A = server_layer(Bs, As, R)
            factors[m] = {"A": A, "B": B}
            for c, Bk, Ak in zip(cids, Bs, As):
                Bp, Ap = hetlora_pad(Bk, Ak, R)
                padded[c][m] = {"A": Ap, "B": Bp}
        self.global_state = {
            "factors": factors,
            "head": head_average([replies.ok[c]["head"] for c in cids], ns),
        }
        states = [{"factors": padded[c]} for c in cids]
        metrics = {
            "train_loss": mean(replies.ok[c]["loss"] for c in cids),
            "init_noise": mean(replies.ok[c]["init_noise"] for c in cids),
            "agg_noise": agg_noise(self.global_state, states, ns, srv.scaling),
            "client_ranks_used": {c: int(replies.ok[c]["rank"]) for c in cids},
        }
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        return metrics

    def on_train(self, client: ClientView, payload: dict) -> dict:
        glob = payload["state"]
        r = int(client.state.get("hetlora_rank", client_rank(client)))
        start = truncated_start(glob, r)
        res = client.train(
            start, trainable=("A", "B", "head"), grad_mask=rank_mask(start, range(r))
        )
        factors = {
            m: {"B": ab["B"][:, :r].clone(), "A": ab["A"][:r, :].clone()}
            for m, ab in res.state["factors"].items()
        }
        if self.opts.prune:
            new_r = prune_decision(factors, r, self.opts.prune_gamma, self.opts.prune_tol)
            if new_r < r:
                for ab in factors.values():
                    ab["B"][:, new_r:] = 0.0
                    ab["A"][new_r:, :] = 0.0
                client.state["hetlora_rank"] = new_r
        return {
            "factors": factors,
            "head": res.state["head"],
            "loss": res.loss,
            "n": client.n,
            "rank": r,
            "init_noise": state_distance(start, glob, client.scaling),
        }


def tail_norm(glob: dict, r: int, s: float) -> float:
    """Closed form of HETLoRA's init noise: sqrt(Σ_layers ‖s·B[:, r:] A[r:, :]‖_F²)."""
    tot = 0.0
    for ab in glob["factors"].values():
        tot += float(factored_fro_norm(ab["B"][:, r:].double(), ab["A"][r:].double())) ** 2
    return s * math.sqrt(tot)
