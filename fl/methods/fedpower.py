"""FedPower (arXiv 2605.08443): exact server-side aggregation of the clients' LoRA
products, refactorized to rank r with PowerDP (noisy subspace iteration), with
input / output / no perturbation as comparison variants. See docs/fedpower.md.

Round (all sizes per adapted layer ℓ: B m×r, A r×n; s = alpha/R the LoRA scale):

1. Clients start from the global factors (B_g, A_g) and the global head, train A, B
   and the head locally (non-private, or DP-SGD with ``--dp-level sample``; the
   client's DP event is recorded by ``client.train``) and send their state.
2. The server forms each client's update as the client's *effective LoRA product*
   ΔW_k^ℓ = s·B_k^ℓ A_k^ℓ (absolute, not a difference from the global: the global
   adapter IS the rank-r refactorization of the average of the clients' products,
   so nothing from earlier rounds is carried except through the clients' start).
   s is applied here, once: the server passes s·B_k to the pure functions of
   :mod:`fl.privacy.powerdp` and divides the released B by s.
3. Joint clip over layers: ‖ΔW_k‖ = sqrt(Σ_ℓ ‖ΔW_k^ℓ‖_F²) <= C (factored norms),
   by scaling every B_k^ℓ of the client with the same factor.
4. Average with weights p_k: client-level DP: p = 1/K_expected fixed and public
   (the sensitivity needs a data-independent denominator); otherwise n_k/Σn.
   W̄^ℓ = Σ_k p_k ΔW_k^ℓ is never formed unless ``dense=True`` (or ``input``
   perturbation, which needs the m×n matrix by definition).
5. Refactorize each layer to rank r with the chosen perturbation; new global
   B^ℓ = B_out/s (B_out = U_r Σ_r), A^ℓ = A_out (orthonormal rows).
6. Head (dense parameters): update u_k = θ_k − θ_g, clipped separately to C,
   θ_g ← θ_g + Σ_k p_k clip(u_k) (+ Gaussian noise under client-level DP).

Client-level DP (add/remove one client's whole data). Every Gaussian release of the
round has ℓ2 sensitivity Δ = C·p *jointly over all layers*: for a projection step,
sqrt(Σ_ℓ ‖p ΔW_j^ℓ X^ℓ‖_F²) <= p sqrt(Σ_ℓ ‖ΔW_j^ℓ‖_F²) <= p C (each X^ℓ has orthonormal
columns and depends only on public randomness and earlier noisy releases). So one
PowerDP round is 2·iters + 1 joint releases whatever the number of layers, input
perturbation is 1 joint release, the head is 1 more release (‖p u_j‖ <= pC), and
output perturbation is 2 releases *per layer* (each layer's factors have their own
worst-case sensitivity, see ``powerdp.output_perturbation``). With k releases of
per-release noise multiplier σ_rel on the same sampled cohort, the round is exactly
one Gaussian mechanism of multiplier σ_rel/√k, subsampled once by the client
sampling. The engine's σ (``--noise-multiplier``, or calibrated from ``--epsilon``
with ``client_dp_releases() = 1``) is that ROUND multiplier σ_round; each release
uses σ_rel = σ_round·√k, and one event of multiplier σ_round is recorded per round.
This is exact for both fixed-count and Poisson client sampling.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fl import linalg
from fl.errors import UsageError
from fl.methods.base import Method, Options
from fl.methods.context import ClientView, ServerView
from fl.methods.registry import register
from fl.privacy import clipping, tap
from fl.privacy import powerdp as P

PERTURBATIONS = ("powerdp", "input", "output", "none")


@dataclass
class FedPowerOptions(Options):
    perturbation: str = field(
        default="powerdp", metadata={"help": "powerdp | input | output | none"}
    )
    power_iters: int = field(
        default=1, metadata={"help": "PowerDP power iterations t (2t+1 noisy projections)"}
    )
    server_clip: float = field(
        default=0.0,
        metadata={
            "help": "C for the client-update clip (0: --clip under client-level DP, "
            "no clipping otherwise)"
        },
    )
    dense: bool = field(
        default=False, metadata={"help": "reference path: form the m×n average (slow)"}
    )
    oversample: int = field(default=0, metadata={"help": "extra power-iteration columns"})

    def validate(self) -> None:
        if self.perturbation not in PERTURBATIONS:
            raise UsageError(
                f"perturbation must be one of {PERTURBATIONS}, got {self.perturbation!r}"
            )
        if not (isinstance(self.power_iters, int) and 0 <= self.power_iters <= 100):
            raise UsageError(f"power_iters must be an integer in [0, 100], got {self.power_iters}")
        if not (math.isfinite(self.server_clip) and self.server_clip >= 0):
            raise UsageError(f"server_clip must be >= 0 (0 = default), got {self.server_clip}")
        if not (isinstance(self.oversample, int) and self.oversample >= 0):
            raise UsageError(f"oversample must be an integer >= 0, got {self.oversample}")


def releases_per_round(perturbation: str, iters: int, n_layers: int, head: bool) -> int:
    """Joint Gaussian releases k of one round (each with sensitivity Δ = C·p):
    powerdp 2·iters+1, input 1, output 2 per layer, none 0; +1 for a private head."""
    if perturbation == "powerdp":
        k = P.releases_per_round(iters)
    elif perturbation == "input":
        k = 1
    elif perturbation == "output":
        k = 2 * n_layers
    elif perturbation == "none":
        k = 0
    else:
        raise ValueError(f"unknown perturbation {perturbation!r}")
    return k + (1 if head else 0)


@dataclass
class AggregateResult:
    """Output of :func:`server_aggregate`.

    factors: {layer: {"B": m×r, "A": r×n}} raw (unscaled) global factors.
    head: {param: tensor} new global head.
    releases: per layer, the mechanism's release records (powerdp format);
      "head" has the head release record when it is noised.
    norms: (K,) joint effective update norms ‖ΔW_k‖ before clipping.
    clip_factors: (K,) scale applied to each client (1 = not clipped).
    subspace_error: {layer: sin of the largest principal angle} (max of the left and
      right subspaces) between the released rank-r factors and the non-private
      truncated SVD of the same clipped average.
    diagnostics: {layer: :func:`subspace_diagnostics`} (error, error_top1, gap_to_noise).
    """

    factors: dict
    head: dict
    releases: dict
    norms: torch.Tensor
    clip_factors: torch.Tensor
    subspace_error: dict
    diagnostics: dict = field(default_factory=dict)


def joint_clip(
    Bs_by_layer: dict[str, list[torch.Tensor]],
    As_by_layer: dict[str, list[torch.Tensor]],
    clip: float,
) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Clip each client's update jointly over layers: ‖ΔW_k‖ = sqrt(Σ_ℓ ‖B_k^ℓ A_k^ℓ‖_F²)
    <= clip, by scaling all of the client's B_k^ℓ by min(1, clip/‖ΔW_k‖) — the one
    client-level clip, :func:`fl.privacy.clipping.clip_factored_clients`. A client
    whose update is not finite contributes zero (its B's and A's are zeroed in place
    in ``As_by_layer`` too). Returns (clipped Bs by layer, norms (K,) with NaN/inf
    kept for reporting, factors (K,))."""
    layers = list(Bs_by_layer)
    clipped, norms, facs = clipping.clip_factored_clients(
        [(Bs_by_layer[ly], As_by_layer[ly]) for ly in layers], clip
    )
    for ly, (_, As) in zip(layers, clipped):
        As_by_layer[ly][:] = As
    return {ly: Bs for ly, (Bs, _) in zip(layers, clipped)}, norms, facs


def _clip_head(updates: list[dict], clip: float) -> tuple[list[dict], list[float]]:
    """Clip each client's head update (all head params jointly) to ℓ2 norm ``clip``
    (:func:`fl.privacy.clipping.clip_dense_clients`; non-finite updates become zero)."""
    keys = [list(u) for u in updates]
    clipped, norms, _ = clipping.clip_dense_clients([list(u.values()) for u in updates], clip)
    out = [dict(zip(k, ts)) for k, ts in zip(keys, clipped)]
    return out, [float(x) for x in norms]


def subspace_diagnostics(
    B: torch.Tensor,
    A: torch.Tensor,
    Bs: list[torch.Tensor],
    As: list[torch.Tensor],
    weights,
    rank: int,
    noise_norm: float = 0.0,
) -> dict:
    """How far the released factors are from the exact refactorization, and why.

    ``error``: sin of the largest principal angle between the released rank-r subspaces
    (col(B), row(A)) and the top-r singular subspaces (U_r, V_r) of W̄ = Σ p_k B_k A_k
    (factored SVD; max of left and right: the worst of the r directions); ``error_top1``:
    the same for the leading direction alone (B's first column and A's first row
    against U_1, V_1; the released factors list their directions by decreasing
    singular value); ``gap_to_noise``: (s_r − s_{r+1}) of W̄ over ``noise_norm``, the
    spectral norm of one Gaussian release (about std·(√rows + √cols)). The noisy power
    method identifies the top-r subspace only when the gap exceeds the noise's norm
    (Hardt & Price, 2014): below 1, an error near 1 is expected, whatever the method
    does. None without noise. Errors are NaN where W̄ has rank < r."""
    U, s, Vh = linalg.factored_svd(Bs, As, weights)
    out: dict = {"error": math.nan, "error_top1": math.nan, "gap_to_noise": None}

    def sin_max(k: int) -> float:  # the first k released directions against the exact
        left = linalg.largest_principal_angle(B[:, :k], U[:, :k])
        right = linalg.largest_principal_angle(A[:k].mT, Vh[:k].mT)
        return float(torch.sin(torch.maximum(left, right)))

    if s.numel() >= 1 and float(s[0]) > 1e-300:
        out["error_top1"] = sin_max(1)
    if s.numel() >= rank and float(s[rank - 1]) > 1e-12 * max(float(s[0]), 1e-300):
        out["error"] = sin_max(rank)
    if noise_norm > 0:
        s_r = float(s[rank - 1]) if s.numel() >= rank else 0.0
        s_next = float(s[rank]) if s.numel() > rank else 0.0
        out["gap_to_noise"] = (s_r - s_next) / noise_norm
    return out


def release_noise_norm(perturbation: str, m: int, n: int, k: int, std: float) -> float:
    """Expected spectral norm (Gordon: ≤ std·(√rows + √cols)) of one Gaussian release:
    PowerDP's projections are m×k or n×k (the larger counts), input perturbation's
    m×n; 0 for the other perturbations (their noise is on the factors, not on W̄)."""
    if std <= 0:
        return 0.0
    if perturbation == "powerdp":
        return std * (math.sqrt(max(m, n)) + math.sqrt(k))
    if perturbation == "input":
        return std * (math.sqrt(m) + math.sqrt(n))
    return 0.0


def server_aggregate(
    global_state: dict,
    client_states: list[dict],
    weights: list[float],
    *,
    scaling: float,
    rank: int,
    perturbation: str = "powerdp",
    iters: int = 2,
    noise_multiplier: float = 0.0,
    clip: float = math.inf,
    weight_bound: float | None = None,
    generator: torch.Generator | None = None,
    seed: int = 0,
    dense: bool = False,
    oversample: int = 0,
    private_head: bool = False,
    measure: bool = True,
) -> AggregateResult:
    """The FedPower server step (module docstring), as a function of tensors.

    global_state / client_states: engine states (raw factors, ``fl.models.factors``).
    weights: p_k per client (client-level DP: 1/K_expected each; else n_k/Σn).
    scaling: s = alpha/R (applied here only). rank: r. noise_multiplier: σ_rel, the
    PER-RELEASE noise multiplier (std/Δ); Δ = clip·(weight_bound or max p_k).
    private_head: add N(0, (σ_rel·clip·p)²) to the averaged clipped head update.
    Factors are computed in float64 and returned in the global state's dtype.
    """
    if perturbation not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {perturbation!r}")
    if perturbation == "none" and noise_multiplier > 0:
        raise ValueError("perturbation 'none' cannot carry noise")
    if not client_states or len(weights) != len(client_states):
        raise ValueError("need one weight per client and at least one client")
    layers = list(global_state["factors"])
    wb = float(weight_bound) if weight_bound is not None else max(abs(w) for w in weights)
    dt = torch.float64
    Bs = {ly: [scaling * c["factors"][ly]["B"].to(dt) for c in client_states] for ly in layers}
    As = {ly: [c["factors"][ly]["A"].to(dt) for c in client_states] for ly in layers}
    Bc, norms, facs = joint_clip(Bs, As, clip)
    factors, releases, sub_err, diag = {}, {}, {}, {}
    for li, ly in enumerate(layers):
        like = global_state["factors"][ly]["B"]
        b, a = Bc[ly], As[ly]
        if perturbation == "powerdp":
            B, A, rec = P.powerdp(
                b,
                a,
                weights,
                rank,
                iters,
                noise_multiplier,
                clip,
                generator=generator,
                dense=dense,
                seed=seed + li,
                oversample=oversample,
                weight_bound=wb,
            )
        elif perturbation == "input":
            B, A, rec = P.input_perturbation(
                b, a, weights, rank, noise_multiplier, clip, generator, weight_bound=wb
            )
        elif perturbation == "output":
            B, A, rec = P.output_perturbation(
                b, a, weights, rank, noise_multiplier, clip, generator, weight_bound=wb
            )
        elif dense:
            U, s, Vh = torch.linalg.svd(linalg.dense_sum(b, a, weights), full_matrices=False)
            B, A = linalg.factors_from_svd(U, s, Vh, rank, "left")
            rec = []
        else:
            B, A, rec = P.no_perturbation(b, a, weights, rank, clip)
        releases[ly] = rec
        if measure:
            m, n = b[0].shape[0], a[0].shape[1]
            std = noise_multiplier * clip * wb if noise_multiplier > 0 else 0.0
            nn = release_noise_norm(perturbation, m, n, rank + oversample, std)
            diag[ly] = subspace_diagnostics(B, A, b, a, weights, rank, nn)
            sub_err[ly] = diag[ly]["error"]
        factors[ly] = {
            "A": A.to(dtype=like.dtype),
            "B": (B / scaling).to(dtype=like.dtype),
        }
    head = {k: v.clone() for k, v in global_state.get("head", {}).items()}
    if head:
        ups = [{k: c["head"][k].to(dt) - head[k].to(dt) for k in head} for c in client_states]
        clipped, _ = _clip_head(ups, clip)
        for k in head:
            tot = sum(p * u[k] for p, u in zip(weights, clipped))
            if private_head and noise_multiplier > 0:
                if generator is None:
                    raise ValueError("a generator is required for the private head")
                noise = P.gaussian_noise(
                    tuple(tot.shape), noise_multiplier * clip * wb, generator, tot
                )
                # one release over the head's keys (fl.privacy.tap), sensitivity clip·p
                tot = tap.release(
                    "fedpower-head", tot, noise, clip * wb, part=k, released=tot + noise
                )
            head[k] = (head[k].to(dt) + tot).to(head[k].dtype)
        if private_head:
            releases["head"] = [
                {
                    "what": "head_update",
                    "sensitivity": clip * wb,
                    "noise_std": noise_multiplier * clip * wb,
                    "noise_multiplier": noise_multiplier,
                }
            ]
    return AggregateResult(factors, head, releases, norms, facs, sub_err, diag)


@register
class FedPower(Method):
    """FedPower with PowerDP (see the module docstring and docs/fedpower.md)."""

    name = "fedpower"
    Options = FedPowerOptions
    dp_levels = ("none", "sample", "client")
    release_note = (
        "global LoRA factors (B = U_rΣ_r/s, A with orthonormal rows: the rank-r "
        "refactorization of the clipped average of the clients' products s·B_kA_k) and "
        "the classification head"
    )

    def __init__(self, server: ServerView, options):
        super().__init__(server, options)
        if server.dp_level == "client":
            if options.perturbation == "none":
                raise UsageError(
                    "fedpower: perturbation=none adds no noise and cannot give client-level DP"
                )

    # -------------------------------------------------------------- configuration
    def client_dp_releases(self) -> int:
        # The engine calibrates/records σ for ONE Gaussian event per round: the round
        # equivalent σ_round; each of the k joint releases uses σ_round·√k (exact
        # composition of Gaussians on one cohort, then one subsampling).
        return 1

    def clip(self) -> float:
        o, srv = self.opts, self.server
        if o.server_clip > 0:
            return float(o.server_clip)
        return float(srv.clip) if srv.dp_level == "client" else math.inf

    def round_releases(self) -> int:
        return releases_per_round(
            self.opts.perturbation,
            self.opts.power_iters,
            len(self.global_state["factors"]),
            bool(self.global_state.get("head")),
        )

    def release_noise_multiplier(self) -> float:
        """σ_rel = σ_round·√k (0 unless client-level DP)."""
        if self.server.dp_level != "client":
            return 0.0
        return float(self.server.noise_multiplier) * math.sqrt(self.round_releases())

    # ----------------------------------------------------------------- server side
    def server_round(self, rnd, clients, send):
        srv, o = self.server, self.opts
        replies = send(clients, "train", {"state": self.global_state})
        client_level = srv.dp_level == "client"
        metrics: dict = {}
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        cids = replies.senders
        if cids:
            metrics["train_loss"] = _mean(replies.ok[c]["loss"] for c in cids)
        elif not client_level:
            metrics["skipped"] = "no client replied"
            return metrics
        states = [replies.ok[c]["state"] for c in cids]
        n_real = len(states)
        canaries = srv.canary_clients if client_level else None  # --canary-clients (audit)
        if client_level:
            p = 1.0 / srv.expected_clients_per_round
            if canaries is not None:
                # Canary clients taking part this round: one more client state each, of
                # ‖ΔW‖ = C and head update C, through the same clips, before the noise.
                states = states + canaries.factored_states(
                    self.global_state, srv.scaling, canaries.taking_part(rnd.index), self.clip()
                )
            weights = [p] * len(states)
            if not states:
                # An empty cohort must still release (pure noise): skipping would reveal
                # that no client took part, which a subsampled-Gaussian bound does not allow.
                states = [_zero_update(self.global_state)]
                weights = [p]
            wb = p
        else:
            tot = float(sum(replies.ok[c]["n"] for c in cids))
            weights = [replies.ok[c]["n"] / tot for c in cids]
            wb = None
        sigma_rel = self.release_noise_multiplier()
        t0 = time.perf_counter()
        res = server_aggregate(
            self.global_state,
            states,
            weights,
            scaling=srv.scaling,
            rank=srv.cfg.rank,
            perturbation=o.perturbation,
            iters=o.power_iters,
            noise_multiplier=sigma_rel,
            clip=self.clip(),
            weight_bound=wb,
            generator=srv.noise_generator(rnd, "fedpower") if sigma_rel > 0 else None,
            seed=rnd.derive("powerdp-basis") % (1 << 62),
            dense=o.dense,
            oversample=o.oversample,
            private_head=client_level,
        )
        server_seconds = time.perf_counter() - t0
        if client_level:
            # One event per round: the k releases of multiplier σ_rel on one cohort
            # compose to one Gaussian of multiplier σ_rel/√k = the engine's σ.
            srv.record_client_level_release(rnd, stage="aggregate", count=1)
        if canaries is not None:
            canaries.observe_factored(
                rnd.index,
                self.global_state,
                {"factors": res.factors, "head": res.head},
                srv.scaling,
            )
        self.global_state = {"factors": res.factors, "head": res.head}
        errs = [v for v in res.subspace_error.values() if v == v]
        top1 = [
            d["error_top1"] for d in res.diagnostics.values() if d["error_top1"] == d["error_top1"]
        ]
        gaps = [
            d["gap_to_noise"] for d in res.diagnostics.values() if d["gap_to_noise"] is not None
        ]
        metrics.update(
            {
                "subspace_error": sum(errs) / len(errs) if errs else None,
                "subspace_error_max": max(errs) if errs else None,
                "subspace_error_top1": sum(top1) / len(top1) if top1 else None,
                "gap_to_noise_min": min(gaps) if gaps else None,
                **clipping.stats(res.norms[:n_real], self.clip()),
                "releases_per_round": self.round_releases() if client_level else 0,
                "release_noise_multiplier": sigma_rel,
                "server_seconds": server_seconds,
            }
        )
        if cids:
            metrics.update(self.noise_metrics(replies))
        return metrics

    # ----------------------------------------------------------------- client side
    def on_train(self, client: ClientView, payload: dict) -> dict:
        from fl.linalg.noise import state_distance

        start = payload["state"]
        res = client.train(start, trainable=("A", "B", "head"))
        return {
            "state": res.state,
            "loss": res.loss,
            "n": client.n,
            "examples": res.examples,
            "init_noise": state_distance(start, payload["state"], client.scaling),
        }


def _zero_update(state: dict) -> dict:
    """A client state that contributes nothing: B = 0 and the head equal to the global."""
    return {
        "factors": {
            k: {"A": ab["A"].clone(), "B": torch.zeros_like(ab["B"])}
            for k, ab in state["factors"].items()
        },
        "head": {k: v.clone() for k, v in state.get("head", {}).items()},
    }


def _mean(xs) -> float:
    xs = [float(x) for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")
