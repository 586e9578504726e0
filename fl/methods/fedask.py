"""FedASK (arXiv 2507.09990, "Differentially Private Federated Low Rank Adaptation
Beyond Fixed-Matrix"): two-stage randomized sketching that aggregates Σ_k p_k B_k A_k
exactly (when the sketch is wide enough) and refactorizes it into rank-r factors.

Per round, for every LoRA layer (B: m×r, A: r×n, ΔW = s·B A):

- stage ``train_sketch``: client k trains locally (DP mode: B and head only, A fixed
  at the last global A; non-DP: A, B and head), keeps (B_k, A_k) and replies
  Y_k = B_k (A_k Ω) (m×w, w = r + p) with Ω (n×w) Gaussian from a seed shared by
  server and clients (derived from the round seed, or from the run seed with
  ``omega=fixed``), plus its head. The server forms Y = Σ p_k Y_k, Q = orth(Y) (m×w).
- stage ``project``: the server sends Q to the clients that answered stage 1; each
  replies Ỹ_k = A_kᵀ (B_kᵀ Q) (n×w). The server forms Ỹ = Σ p_k Ỹ_k = Sᵀ Q and takes
  the SVD Ỹᵀ = U Σ Vᵀ: B = Q U_r Σ_r^½, A = Σ_r^½ V_rᵀ (the rank-r truncation of
  Q Qᵀ S). The head is averaged.

Exactness (tests/fl/test_fedask.py, float64): with d = rank(S), S = Σ p_k B_k A_k,
the result is S's rank-r truncated SVD whenever w = r + p >= d. In DP mode all
clients share A, so d <= r and p = 0 is exact; with K clients training A_k and B_k
independently d = K·r, so exactness needs p >= K·r − r (the paper states
p >= d_B − r + 2, the +2 being the usual randomized-SVD oversampling).

A client that fails in stage 2 after answering stage 1: the server recomputes Y and
Q from the survivors' Y_k (renormalized p_k), sends the new Q to the survivors, and
repeats up to ``max_retries`` times; if it still fails (or nobody survives) the round
is discarded (global state unchanged). Either way the round's metrics say which
(``stage2_failed``, ``stage2_retries``, ``round_discarded``). The failed client's DP
steps are in the ledger regardless (it trained).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fl import linalg as L
from fl.errors import UsageError
from fl.methods.base import Method, Options, Replies, RoundInfo
from fl.methods.context import ClientView, ServerView
from fl.methods.registry import register
from fl.models import factors as F

__all__ = [
    "FedASK",
    "FedASKOptions",
    "omega_seed",
    "layer_omega",
    "client_sketch",
    "client_project",
    "server_basis",
    "server_refactor",
    "fedask_layer",
]


# ------------------------------------------------------------------ pure functions


def omega_seed(base_seed: int, layer: str) -> int:
    """Seed of Ω for one layer: derive_seed(base_seed, "fedask-omega", layer)."""
    from fl.privacy.rng import derive_seed

    return derive_seed(base_seed, "fedask-omega", layer)


def layer_omega(seed: int, n: int, width: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Ω (n×width), entries N(0, 1), identical on server and clients for one seed."""
    return L.gaussian_sketch(n, width, seed, dtype=dtype, device=device)


def client_sketch(B: torch.Tensor, A: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Stage-1 client message Y_k = B_k (A_k Ω): B (m×r), A (r×n), Ω (n×w) -> m×w."""
    return L.sketch(B, A, omega)


def client_project(B: torch.Tensor, A: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Stage-2 client message Ỹ_k = A_kᵀ (B_kᵀ Q): Q (m×w) -> n×w."""
    return L.project(B, A, Q)


def server_basis(Ys: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Stage-1 server step: Q = orth(Σ_k p_k Y_k) (m×min(m, w)), computed in float64
    (weights are normalized to sum 1)."""
    p = _normalize(weights)
    Y = L.weighted_sum([y.double() for y in Ys], p)
    return L.sketch_basis(Y)


def server_refactor(
    Q: torch.Tensor, Yts: Sequence[torch.Tensor], weights: Sequence[float], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-2 server step: Ỹ = Σ p_k Ỹ_k; SVD Ỹᵀ = UΣVᵀ; B = Q U_r Σ_r^½ (m×rank),
    A = Σ_r^½ V_rᵀ (rank×n), in float64."""
    p = _normalize(weights)
    Yt = L.weighted_sum([y.double() for y in Yts], p)
    return L.refactor(Q.double(), Yt, rank)


def fedask_layer(
    Bs: Sequence[torch.Tensor],
    As: Sequence[torch.Tensor],
    weights: Sequence[float] | None,
    rank: int,
    oversketch: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's whole FedASK protocol through the same functions the method uses —
    the ONE implementation that analysis, benchmarks and tests call: Ω from ``seed``
    (width w = rank + oversketch, :func:`layer_omega`), client sketches, server basis
    (float64), client projections, server refactor. ``weights=None``: uniform.
    Returns B (m×rank), A (rank×n) in the inputs' dtype (as the method stores them).

    When is it exact? Let d = rank(S), S = Σ p_k B_k A_k (d <= min(Σ_k r_k, m, n)).
    Y = S Ω, and for Gaussian Ω range(S Ω) = range(S) almost surely iff w >= d. Then
    Q Qᵀ S = S and the result is *exactly* the rank-``rank`` truncated SVD of S (S
    itself when rank >= d); for w < d it is the truncated SVD of the projection Q Qᵀ S
    (the usual randomized-SVD error). Measured (tests/fl/test_linalg.py, float64): with
    a shared A (FFA/FedASK-DP clients train B only) d <= r and w = r is already exact
    (~1e-15); with K clients of rank r and independent A_k, B_k (m, n >= K r) d = K r,
    and the error is O(1) at w = K r − 1 and ~1e-15 at w = K r. So exactness needs
    p >= d − rank (p >= K r − r for independent clients); the paper's p >= d_B − r + 2
    adds the randomized-SVD oversampling of 2, which helps when S is only
    approximately low rank.
    """
    L.check_pairs(Bs, As)
    if weights is None:
        weights = [1.0] * len(Bs)
    dt = Bs[0].dtype
    n = As[0].shape[1]
    om = layer_omega(seed, n, rank + oversketch, dtype=As[0].dtype, device=As[0].device)
    Q = server_basis([client_sketch(B, A, om) for B, A in zip(Bs, As)], weights).to(dt)
    B, A = server_refactor(Q, [client_project(B, A, Q) for B, A in zip(Bs, As)], weights, rank)
    return B.to(dt), A.to(dt)


def _normalize(weights: Sequence[float]) -> list[float]:
    w = [float(x) for x in weights]
    tot = sum(w)
    if not (tot > 0 and math.isfinite(tot)):
        raise ValueError(f"weights must have a positive finite sum, got {w}")
    return [x / tot for x in w]


# ------------------------------------------------------------------------ the method


@dataclass
class FedASKOptions(Options):
    oversketch: int = field(
        default=-1,
        metadata={
            "help": "sketch oversampling p (width r+p); -1 = auto: 2 in DP mode (shared A, "
            "rank(S) <= r), (K−1)·r + 2 without DP (K = expected clients per round)"
        },
    )
    clip_space: str = field(
        default="w",
        metadata={"help": "DP clipping space: w (per-sample ∂l/∂W, paper) | b (B's own gradient)"},
    )
    omega: str = field(
        default="fresh", metadata={"help": "sketch Ω: fresh (each round) | fixed (whole run)"}
    )
    measure_noise: bool = field(
        default=True,
        metadata={
            "help": "clients also return their factors in stage 2 to measure agg_noise "
            "(a measurement side-channel, not part of the protocol)"
        },
    )
    max_retries: int = field(
        default=2, metadata={"help": "stage-2 re-runs on survivors before discarding a round"}
    )

    def validate(self) -> None:
        if self.oversketch < -1:
            raise UsageError(f"oversketch must be >= 0 (or -1 = auto), got {self.oversketch}")
        if self.clip_space not in ("w", "b"):
            raise UsageError(f"clip_space must be 'w' or 'b', got {self.clip_space!r}")
        if self.omega not in ("fresh", "fixed"):
            raise UsageError(f"omega must be 'fresh' or 'fixed', got {self.omega!r}")
        if self.max_retries < 0:
            raise UsageError(f"max_retries must be >= 0, got {self.max_retries}")


@register
class FedASK(Method):
    name = "fedask"
    Options = FedASKOptions
    dp_levels = ("none", "sample")
    train_stages = ("train_sketch",)
    release_note = (
        "per round, per LoRA layer: stage train_sketch — client → server Y_k = B_k(A_kΩ) and "
        "the head, post-processing of the DP-SGD-trained B_k and head with public A_k (the "
        "last global A, fixed in DP mode) and public Ω (shared seed); server → client the "
        "global A, B, head. Stage project — server → client Q = orth(Σ p_k Y_k) (public, "
        "post-processing of released sketches); client → server Ỹ_k = A_kᵀ(B_kᵀQ), "
        "post-processing of DP-protected B_k with public A_k and Q; with measure_noise the "
        "client also sends (B_k, A_k) as a measurement side-channel, itself post-processing "
        "in DP mode. Released: global B = QUΣ^½, A = Σ^½Vᵀ and the averaged head."
    )

    def __init__(self, server: ServerView, options):
        super().__init__(server, options)
        self.A0: dict[str, torch.Tensor] = {}
        share = server.cfg.head_clip_share
        if share > 0 and server.dp_level == "sample" and self.opts.clip_space == "w":
            raise UsageError(
                "fedask: head_clip_share cannot split the W-space clip (clip_space=w clips "
                "the joint norm of the per-layer W gradients and the head); use "
                "--opt clip_space=b or leave head_clip_share at 0"
            )

    def privacy_note(self) -> str:
        if self.server.dp_level != "sample":
            return ""
        if self.opts.clip_space == "w":
            return (
                "W-space per-example clipping: the joint norm of [∂l/∂W per LoRA layer, ∂l/∂head] "
                "is clipped to C, N(0, σ²C²) is added in W-space (m×n per layer) and on the head, "
                "B.grad = s·(·)Aᵀ/(q·n) (post-processing); Poisson sampling; A fixed at the global A"
            )
        return "per-example clipping of (∂l/∂B, ∂l/∂head) to C, N(0, σ²C²) on both; A fixed"

    # ---- server ------------------------------------------------------------------
    def init_state(self, initial: dict) -> None:
        super().init_state(initial)
        self.A0 = {k: ab["A"].clone() for k, ab in initial["factors"].items()}

    @property
    def dp(self) -> bool:
        return self.server.dp_level == "sample"

    def width(self) -> int:
        r = self.server.cfg.rank
        p = self.opts.oversketch
        if p < 0:
            if self.dp:
                p = 2
            else:
                k = max(1, int(round(self.server.expected_clients_per_round)))
                p = (k - 1) * r + 2
        return r + p

    def omega_base(self, rnd: RoundInfo) -> int:
        if self.opts.omega == "fixed":
            from fl.privacy.rng import derive_seed

            return derive_seed(self.server.cfg.seed, "fedask-omega-fixed")
        return rnd.derive("fedask-omega")

    def server_round(self, rnd, clients, send):
        srv = self.server
        width = self.width()
        r1 = send(
            clients,
            "train_sketch",
            {"state": self.global_state, "omega_seed": self.omega_base(rnd), "width": width},
        )
        metrics: dict = {"sketch_width": width}
        if r1.failed:
            metrics["stage1_failed"] = dict(r1.failed)
        if not r1.ok:
            metrics.update({"skipped": "no client replied in stage 1", "round_discarded": True})
            return metrics
        for c in list(r1.ok):
            bad = self._check_stage1(r1.ok[c], width)
            if bad:
                srv.log(f"round {rnd.index + 1}: fedask rejected client {c}'s sketch: {bad}")
                r1.failed[c] = f"rejected sketch: {bad}"
                del r1.ok[c]
                metrics["stage1_failed"] = dict(r1.failed)
        if not r1.ok:
            metrics.update({"skipped": "no valid stage-1 reply", "round_discarded": True})
            return metrics
        metrics["train_loss"] = _mean(r["loss"] for r in r1.ok.values())
        alive = list(r1.senders)
        stage2_failed: dict[str, str] = {}
        retries = 0
        result = None
        while alive:
            w = [r1.ok[c]["n"] for c in alive]
            Q = {
                k: server_basis([r1.ok[c]["Y"][k] for c in alive], w).to(ab["B"].dtype)
                for k, ab in self.global_state["factors"].items()
            }
            r2 = send(alive, "project", {"Q": Q})
            for c in list(r2.ok):
                bad = self._check_stage2(r2.ok[c], Q)
                if bad:
                    r2.failed[c] = f"rejected projection: {bad}"
                    del r2.ok[c]
            if not r2.failed and set(r2.ok) == set(alive):
                result = (alive, w, Q, r2)
                break
            stage2_failed.update(r2.failed)
            survivors = [c for c in alive if c in r2.ok]
            srv.log(
                f"round {rnd.index + 1}: fedask stage 2 failed for {sorted(r2.failed)}; "
                + (
                    f"recomputing Y and Q from the {len(survivors)} survivor(s) (retry {retries + 1})"
                    if survivors and retries < self.opts.max_retries
                    else "discarding the round"
                )
            )
            if retries >= self.opts.max_retries:
                break
            retries += 1
            alive = survivors
        metrics["stage2_retries"] = retries
        if stage2_failed:
            metrics["stage2_failed"] = stage2_failed
        if result is None:
            metrics["round_discarded"] = True
            metrics["survivors"] = []
            srv.log(f"round {rnd.index + 1}: fedask round discarded; global state unchanged")
            return metrics
        alive, w, Q, r2 = result
        metrics["round_discarded"] = False
        metrics["survivors"] = list(alive)
        if stage2_failed:
            srv.log(
                f"round {rnd.index + 1}: fedask round completed with survivors {alive} "
                "(stage-1 aggregate recomputed without the failed clients)"
            )
        new = F.clone_state(self.global_state)
        rank = srv.cfg.rank
        for k, ab in new["factors"].items():
            B, A = server_refactor(Q[k], [r2.ok[c]["Yt"][k] for c in alive], w, rank)
            ab["B"] = B.to(ab["B"].dtype)
            ab["A"] = A.to(ab["A"].dtype)
        heads = [r1.ok[c]["head"] for c in alive]
        p = _normalize(w)
        for hk in new["head"]:
            new["head"][hk] = sum(pi * h[hk] for pi, h in zip(p, heads)).to(new["head"][hk].dtype)
        self.global_state = new
        metrics.update(self.angle_metrics())
        metrics.update(self._bytes(r1, r2, alive))
        if self.opts.measure_noise:
            from fl.linalg.noise import agg_noise

            # Clients start exactly at the global state: init_noise is 0 by construction.
            metrics["init_noise"] = 0.0
            metrics["agg_noise"] = agg_noise(
                self.global_state,
                [{"factors": r2.ok[c]["measure_factors"]} for c in alive],
                w,
                srv.scaling,
            )
        return metrics

    def _check_stage1(self, reply: dict, width: int) -> str | None:
        """Why a stage-1 reply is malformed (None = fine): every layer's Y_k must be
        m×w and the head must have the global shapes."""
        Y, head = reply.get("Y"), reply.get("head")
        if not isinstance(Y, dict) or set(Y) != set(self.global_state["factors"]):
            return "sketch layers differ from the global model"
        for k, ab in self.global_state["factors"].items():
            if tuple(Y[k].shape) != (ab["B"].shape[0], width):
                return f"Y of {k} has shape {tuple(Y[k].shape)}"
        if not isinstance(head, dict) or set(head) != set(self.global_state["head"]):
            return "head parameters differ from the global model"
        for k, t in self.global_state["head"].items():
            if tuple(head[k].shape) != tuple(t.shape):
                return f"head parameter {k} has shape {tuple(head[k].shape)}"
        return None

    def _check_stage2(self, reply: dict, Q: dict) -> str | None:
        Yt = reply.get("Yt")
        if not isinstance(Yt, dict) or set(Yt) != set(Q):
            return "projection layers differ from the global model"
        for k, ab in self.global_state["factors"].items():
            if tuple(Yt[k].shape) != (ab["A"].shape[1], Q[k].shape[1]):
                return f"Ỹ of {k} has shape {tuple(Yt[k].shape)}"
        return None

    def angle_metrics(self) -> dict:
        """a_rowspace_angle: max over layers of the largest principal angle (radians)
        between rowspace(A_0) and rowspace(A_t); a_rowspace_angle_mean: their mean.
        Zero rows of A_t (rank-deficient aggregate) are left out."""
        angles = []
        for k, ab in self.global_state["factors"].items():
            At = ab["A"].double()
            keep = At.norm(dim=1) > 0
            if not bool(keep.any()):
                continue
            angles.append(float(L.rowspace_angle(self.A0[k].double(), At[keep])))
        if not angles:
            return {}
        return {"a_rowspace_angle": max(angles), "a_rowspace_angle_mean": sum(angles) / len(angles)}

    @staticmethod
    def _bytes(r1: Replies, r2: Replies, alive: list[str]) -> dict:
        """Bytes of the protocol's upstream tensors (the transport's bytes_up also counts
        the measurement side-channel): Y_k, Ỹ_k and the head of the surviving clients
        (retries re-send Ỹ_k; only the final one is counted here)."""
        from fl.methods.rounds import payload_bytes

        sk, head = 0, 0
        for c in alive:
            sk += payload_bytes(r1.ok[c]["Y"]) + payload_bytes(r2.ok[c]["Yt"])
            head += payload_bytes(r1.ok[c]["head"])
        return {"sketch_bytes_up": sk, "protocol_bytes_up": sk + head}

    # ---- checkpointing -------------------------------------------------------------
    def state_dict(self):
        tensors, meta = super().state_dict()
        tensors.update({f"fedask_A0/{k}": v for k, v in self.A0.items()})
        return tensors, dict(meta, fedask={"A0_layers": sorted(self.A0)})

    def load_state_dict(self, tensors, meta):
        super().load_state_dict(tensors, meta)
        pre = "fedask_A0/"
        self.A0 = {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}
        missing = set(self.global_state["factors"]) - set(self.A0)
        if missing:
            raise UsageError(f"fedask checkpoint lacks A_0 for layers {sorted(missing)}")

    # ---- clients ---------------------------------------------------------------------
    def on_train_sketch(self, client: ClientView, payload: dict) -> dict:
        start = payload["state"]
        dp = client.dp_params() is not None
        if dp and self.opts.clip_space == "w":
            from fl.privacy.wspace import WSpaceClipper

            model = client.model
            with WSpaceClipper.from_model(model, client.scaling) as gt:
                res = client.train(start, trainable=("B", "head"), grad_transform=gt)
        elif dp:
            res = client.train(start, trainable=("B", "head"))
        else:
            res = client.train(start, trainable=("A", "B", "head"))
        factors = {k: {"A": ab["A"], "B": ab["B"]} for k, ab in res.state["factors"].items()}
        client.state["fedask"] = {"factors": factors}
        width = int(payload["width"])
        Y = {}
        for k, ab in factors.items():
            om = layer_omega(
                omega_seed(int(payload["omega_seed"]), k), ab["A"].shape[1], width, ab["A"].dtype
            )
            Y[k] = client_sketch(ab["B"], ab["A"], om)
        return {"Y": Y, "head": res.state["head"], "loss": res.loss, "n": client.n}

    def on_project(self, client: ClientView, payload: dict) -> dict:
        st = client.state.get("fedask")
        if st is None:
            raise RuntimeError("fedask: stage 'project' before 'train_sketch' on this client")
        fac = st["factors"]
        Yt = {k: client_project(fac[k]["B"], fac[k]["A"], Q) for k, Q in payload["Q"].items()}
        out = {"Yt": Yt, "n": client.n}
        if self.opts.measure_noise:
            # Measurement side-channel (agg_noise): not part of the protocol.
            out["measure_factors"] = fac
        return out


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")
