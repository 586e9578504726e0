"""FLoRA (stacking-based heterogeneous federated LoRA): exact aggregation by stacking
the client factors, merged into the base weights, with a fresh LoRA every round.

Round t, client k with rank r_k <= R:
- starts from the merged base W_0 + D_t (D_t = everything merged so far) and a fresh
  LoRA: B = 0, A = the round's seeded random A (rows ≥ r_k zero and masked, so the
  client trains exactly r_k ranks; ``U(−1/√n, 1/√n)`` like peft's default init);
- trains A, B (its r_k ranks) and the head, sends B_k (m×r_k), A_k (r_k×n), head.

Server: stacks B = [p_1 B_1 .. p_K B_K], A = [A_1; ..; A_K] (p_k ∝ n_k,
:func:`fl.linalg.flora_stack`) so that B A = Σ p_k B_k A_k exactly, and merges
D_{t+1} = D_t + s·B A into the base; the head is averaged (∝ n_k). s = alpha / R
(``fl.models.factors``), the same for every client whatever r_k.

Where the merged update lives. D_t is kept *exactly*, in factored float64 form, in the
method state (``self.merged[mod] = (B_m, A_m)`` with D = B_m A_m, s included;
checkpointed). Its width grows by Σ r_k a round; once it exceeds min(m, n) it is
re-factored by an SVD at rank min(m, n), which is exact (rank D <= min(m, n)). Clients
receive (B_m, A_m) and add B_m A_m to their frozen base weights for local training
(restored exactly afterwards) — FLoRA's growing download is the price of exactness.

What is released. The engine evaluates and saves a rank-R PEFT adapter on the
*unmodified* base W_0, which cannot hold D_t exactly once rank(D_t) > R. The released
adapter is the best rank-R approximation of D_t (truncated SVD, Eckart–Young) plus the
head; its relative error ‖D − D_R‖_F/‖D‖_F (over all layers) is reported every round
as ``release_rel_error``. The exact global model W_0 + D_t is evaluated separately
(``merged_accuracy``, ``merged_loss``) when option ``eval_merged`` is true.

Noise: init_noise = 0 (clients start from the global function: same merged base, B = 0);
agg_noise = ‖s·B A − Σ p_k s·B_k A_k‖_F = 0 up to float64 rounding (exact stacking).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fl.linalg import factored_svd, flora_stack, truncated_svd_factors
from fl.linalg.noise import agg_noise, state_distance
from fl.methods.base import Method, Options, RoundInfo
from fl.methods.context import ClientView
from fl.methods.plora import client_rank, head_average, mean, rank_mask
from fl.methods.registry import register
from fl.models import factors as F


def _lora_layer(model: torch.nn.Module, mod: str):
    inner = model.base_model.model if hasattr(model, "base_model") else model
    return inner.get_submodule(mod)


@contextmanager
def merged_base(model: torch.nn.Module, merged: dict):
    """Temporarily set W_0 ← W_0 + B_m A_m in the base layer of every adapted module.

    ``merged``: {module name: (B_m (m×w), A_m (w×n))}, the update with s already in it.
    peft layers with ``fan_in_fan_out`` (GPT-2 Conv1D) store Wᵀ; the delta is transposed
    for them. The original weights are copied back on exit (exact restore, not a
    subtraction, so no rounding drift accumulates across clients).
    """
    saved = []
    try:
        with torch.no_grad():
            for mod, (Bm, Am) in merged.items():
                layer = _lora_layer(model, mod)
                W = layer.base_layer.weight
                D = Bm.double() @ Am.double()
                if getattr(layer, "fan_in_fan_out", False):
                    D = D.T
                saved.append((W, W.detach().clone()))
                W.add_(D.to(W.device, W.dtype))
        yield
    finally:
        with torch.no_grad():
            for W, W0 in saved:
                W.copy_(W0)


def fresh_factors(template: dict, seed: int) -> dict:
    """A fresh LoRA for every layer of ``template``: B = 0, A ~ U(−1/√n, 1/√n) (peft's
    default kaiming_uniform(a=√5) bound) from one generator seeded with ``seed``
    (layers in sorted order, so the draw does not depend on dict order)."""
    g = torch.Generator().manual_seed(int(seed))
    out = {}
    for mod in sorted(template):
        A0, B0 = template[mod]["A"], template[mod]["B"]
        bound = 1.0 / math.sqrt(A0.shape[1])
        A = (torch.rand(A0.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
        out[mod] = {"A": A.to(A0.dtype), "B": torch.zeros_like(B0)}
    return out


def truncate_release(Bm: torch.Tensor, Am: torch.Tensor, R: int, s: float, dtype):
    """Rank-R raw peft factors (B (m×R), A (R×n)) with s·B A = best rank-R approx of
    D = B_m A_m, and (‖D − D_R‖_F², ‖D‖_F²) from the singular values."""
    U, sv, Vh = factored_svd([Bm], [Am], None)
    B, A = truncated_svd_factors([Bm], [Am], None, R, split="sqrt")
    c = 1.0 / math.sqrt(s)
    return (B * c).to(dtype), (A * c).to(dtype), float((sv[R:] ** 2).sum()), float((sv**2).sum())


def release_truncation(
    wide: dict[str, tuple[torch.Tensor, torch.Tensor]], like: dict, R: int, s: float
) -> tuple[dict, float]:
    """The rank-R release of an exact per-module update {mod: (B_m, A_m)} (FLoRA's merged
    D, FlexLoRA's average G), for every module of ``like`` (factors {mod: {"A", "B"}},
    whose dtypes the release takes): ({mod: {"A", "B"}}, release_rel_error), the error
    being √(Σ_mod ‖D − D_R‖_F² / Σ_mod ‖D‖_F²) (0 when D = 0); see
    :func:`truncate_release`."""
    factors, tail, total = {}, 0.0, 0.0
    for mod, ab in like.items():
        B, A, t, a = truncate_release(*wide[mod], R, s, ab["B"].dtype)
        factors[mod] = {"A": A, "B": B}
        tail, total = tail + t, total + a
    return factors, math.sqrt(tail / total) if total > 0 else 0.0


def wide_tensors(prefix: str, wide: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """A per-module update {mod: (B_m, A_m)} as checkpoint tensors ``<prefix>/<mod>/B|A``."""
    out = {}
    for mod, (B, A) in wide.items():
        out[f"{prefix}/{mod}/B"], out[f"{prefix}/{mod}/A"] = B, A
    return out


def wide_from_tensors(prefix: str, tensors: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`wide_tensors` (float64); {} when the checkpoint has none."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(prefix + "/"):
            mod, which = k[len(prefix) + 1 :].rsplit("/", 1)
            pairs.setdefault(mod, {})[which] = v.double()
    return {mod: (p["B"], p["A"]) for mod, p in pairs.items()}


def compress_exact(Bm: torch.Tensor, Am: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-factor B_m A_m (m×w, w×n) at width min(m, n) when w exceeds it — exact, since
    the product's rank is at most min(m, n)."""
    cap = min(Bm.shape[0], Am.shape[1])
    if Bm.shape[1] <= cap:
        return Bm, Am
    return truncated_svd_factors([Bm], [Am], None, cap, split="sqrt")


def server_layer(
    merged: tuple[torch.Tensor, torch.Tensor] | None,
    Bs: list[torch.Tensor],
    As: list[torch.Tensor],
    weights,
    s: float,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """FLoRA's server step on one layer (pure; the method and ``analysis.hetero`` call
    it): stack the clients' factors, B = [p_1 B_1 .. p_K B_K], A = [A_1; ..; A_K]
    (:func:`fl.linalg.flora_stack`, B A = Σ p_k B_k A_k exactly), and merge s·B A into
    the merged update D = B_m A_m (``merged`` = (B_m, A_m), or None before the first
    round), re-factored exactly when wider than min(m, n) (:func:`compress_exact`).
    Returns ((B_m', A_m'), (B, A)): the new merged update and the round's stack."""
    B, A = flora_stack(Bs, As, weights)
    if merged is not None:
        Bm, Am = merged
        Bm, Am = torch.cat([Bm, s * B], dim=1), torch.cat([Am, A], dim=0)
    else:
        Bm, Am = s * B, A
    return compress_exact(Bm, Am), (B, A)


@dataclass
class FLoRAOptions(Options):
    eval_merged: bool = field(
        default=True,
        metadata={"help": "evaluate the exact global model W_0 + D on the test set each eval"},
    )


@register
class FLoRA(Method):
    name = "flora"
    Options = FLoRAOptions
    dp_levels = ("none", "sample")
    release_note = (
        "rank-R truncated SVD of the merged update D (exact global model is W_0 + D; "
        "release_rel_error in metrics) and the classification head"
    )

    def init_state(self, initial: dict) -> None:
        super().init_state(initial)
        self.merged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._release: dict | None = None
        self._release_err = 0.0

    def server_round(self, rnd: RoundInfo, clients, send) -> dict:
        srv = self.server
        s = srv.scaling
        self.global_state["factors"] = fresh_factors(
            self.global_state["factors"], rnd.derive("flora/init")
        )
        replies = send(clients, "train", {"state": self.global_state, "merged": self._payload()})
        if not replies.ok:
            return {"failed_clients": replies.failed, "skipped": "no client replied"}
        cids = replies.senders
        ns = [float(replies.ok[c]["n"]) for c in cids]
        tot = sum(ns)
        ps = [x / tot for x in ns]
        round_stack, client_states = {}, []
        for c in cids:
            client_states.append({"factors": replies.ok[c]["factors"], "head": {}})
        for mod in self.global_state["factors"]:
            Bs = [replies.ok[c]["factors"][mod]["B"].double() for c in cids]
            As = [replies.ok[c]["factors"][mod]["A"].double() for c in cids]
            self.merged[mod], (B, A) = server_layer(self.merged.get(mod), Bs, As, ps, s)
            round_stack[mod] = {"B": B, "A": A}
        self.global_state["head"] = head_average([replies.ok[c]["head"] for c in cids], ns)
        self._refresh_release()
        metrics = {
            "train_loss": mean(replies.ok[c]["loss"] for c in cids),
            "init_noise": mean(replies.ok[c]["init_noise"] for c in cids),
            # ΔW_server of this round = s·B_stack A_stack vs Σ p_k s·B_k A_k.
            "agg_noise": agg_noise({"factors": round_stack}, client_states, ns, s),
            "release_rel_error": self._release_err,
            "merged_width": max(Bm.shape[1] for Bm, _ in self.merged.values()),
        }
        if self.opts.eval_merged and srv.is_eval_round(rnd):
            with merged_base(srv.model, self.merged):
                ev = srv.evaluate(self.global_state)
            metrics["merged_accuracy"] = ev["accuracy"]
            metrics["merged_loss"] = ev["loss"]
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        return metrics

    def _payload(self) -> dict:
        return {mod: {"B": Bm, "A": Am} for mod, (Bm, Am) in self.merged.items()}

    def _refresh_release(self) -> None:
        if not self.merged:
            self._release, self._release_err = None, 0.0
            return
        factors, self._release_err = release_truncation(
            self.merged, self.global_state["factors"], self.server.cfg.rank, self.server.scaling
        )
        self._release = {"factors": factors, "head": self.global_state["head"]}

    def released_state(self) -> dict:
        if self._release is None:
            return self.global_state
        return {"factors": self._release["factors"], "head": self.global_state["head"]}

    @staticmethod
    def client_start(glob: dict, payload: dict, r: int) -> tuple[dict, dict]:
        """A rank-r client's start: (LoRA state, merged update {mod: (B_m, A_m)} to add to
        its frozen base). Ranks ≥ r are zero in A and B (and masked in training)."""
        start = F.clone_state(glob)
        for ab in start["factors"].values():
            ab["A"][r:, :] = 0.0
            ab["B"][:, r:] = 0.0
        merged = {mod: (v["B"], v["A"]) for mod, v in payload["merged"].items()}
        return start, merged

    def on_train(self, client: ClientView, payload: dict) -> dict:
        glob = payload["state"]
        r = client_rank(client)
        start, merged = self.client_start(glob, payload, r)
        with merged_base(client.model, merged):
            res = client.train(
                start, trainable=("A", "B", "head"), grad_mask=rank_mask(start, range(r))
            )
        factors = {
            mod: {"B": ab["B"][:, :r].clone(), "A": ab["A"][:r, :].clone()}
            for mod, ab in res.state["factors"].items()
        }
        return {
            "factors": factors,
            "head": res.state["head"],
            "loss": res.loss,
            "n": client.n,
            # Same merged base as the global model; the LoRA parts differ only in A rows
            # whose B columns are 0, so this is 0 (computed, not assumed).
            "init_noise": state_distance(start, glob, client.scaling),
        }

    # ---- checkpointing: the merged update is server state beyond global_state --------
    def state_dict(self):
        tensors, meta = super().state_dict()
        return {**tensors, **wide_tensors("flora", self.merged)}, meta

    def load_state_dict(self, tensors, meta) -> None:
        super().load_state_dict(tensors, meta)
        self.merged = wide_from_tensors("flora", tensors)
        self._refresh_release()
