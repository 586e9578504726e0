"""The Method contract: a server program of stages, and one client handler per stage.

A method is written once and runs unchanged on any transport:

- ``server_round(rnd, clients, send)`` runs on the server. ``send(clients, stage,
  payload)`` delivers ``payload`` (one dict for all, or ``{client_id: dict}``) to
  each client's ``on_<stage>`` handler and returns :class:`Replies`. It may be called
  several times per round (FedASK's two stages). It returns the round's metrics.
- ``on_<stage>(client, payload)`` runs where the client's data lives. ``client`` is a
  :class:`fl.methods.context.ClientView`: ``client.train(...)`` does local (DP-)SGD and
  records its DP event; ``client.state`` persists between stages and rounds.

A method sees the engine only through ``ClientView`` and ``ServerView`` (``self.server``):
nothing else of the engine, its trainer or its configuration.

Payloads and replies are dicts of tensors, numbers, strings and nested dicts of those
(what a Flower record can carry).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from fl.errors import UsageError
from fl.methods.context import ClientView, ServerView  # noqa: F401 - the contract's views
from fl.methods.rounds import Replies, RoundInfo  # noqa: F401 - the method contract's types
from fl.models import factors as F
from fl.privacy import clipping, tap


@dataclass
class Options:
    """Method options (``--opt key=value``). Subclasses add fields with help metadata."""


def parse_options(cls: type, raw: dict[str, Any]) -> Any:
    """An instance of the options dataclass ``cls`` from raw ``--opt`` values, each
    checked against its field's default type (UsageError naming the option)."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UsageError(f"unknown option(s) {unknown} for this method; known: {sorted(known)}")
    kw = {}
    for k, v in raw.items():
        default = known[k].default
        if isinstance(default, bool) and not isinstance(v, bool):
            raise UsageError(f"option {k!r} must be true or false, got {v!r}")
        if isinstance(default, int | float) and not isinstance(default, bool):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise UsageError(f"option {k!r} must be a number, got {v!r}")
            v = type(default)(v) if isinstance(default, float) or float(v).is_integer() else v
        if isinstance(default, str) and not isinstance(v, str):
            raise UsageError(f"option {k!r} must be a string, got {v!r}")
        kw[k] = v
    opts = cls(**kw)
    check = getattr(opts, "validate", None)
    if check:
        check()
    return opts


class Method:
    """Base class. Subclasses set ``name`` and implement ``server_round`` and handlers."""

    name = "base"
    Options: type = Options
    # Which DP levels the method supports.
    dp_levels: tuple[str, ...] = ("none", "sample")
    # What is released to the clients / the world each round (stated in the manifest).
    release_note = "LoRA factors A, B and the classification head"
    # Stages whose handler runs local (DP-)SGD: a lost reply in one of them is charged
    # the DP-SGD event the server planned for that client (fl.run.transport.Dispatcher).
    train_stages: tuple[str, ...] = ("train",)
    #: Whether ``head_warmup_rounds`` applies: the method's factors persist across
    #: rounds, so head-only rounds leave them as they were (FedAvg-LoRA and its
    #: variants). Methods that re-factorize, merge or sketch every round do not.
    head_warmup: bool = False

    def __init__(self, server: ServerView, options):
        self.server = server
        self.opts = options
        self.global_state: dict = {}

    # ---- server side -----------------------------------------------------------
    def init_state(self, initial: dict) -> None:
        self.global_state = F.clone_state(initial)

    def server_round(self, rnd: RoundInfo, clients: list[str], send) -> dict:
        raise NotImplementedError

    def released_state(self) -> dict:
        """The global adapter as released (what attacks and evaluation see)."""
        return self.global_state

    def eval_states(self) -> dict[str, dict]:
        """Extra states to evaluate (e.g. personalized models), name → state."""
        return {}

    def privacy_note(self) -> str:
        """Method-specific description of its DP mechanism (for the manifest)."""
        return ""

    def client_dp_releases(self) -> int:
        """Gaussian releases per round under client-level DP (for calibration)."""
        return 1

    # ---- checkpointing (tensors in flat dicts, everything else JSON) ------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        return {f"global/{k}": v for k, v in F.flatten_state(self.global_state).items()}, {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.global_state = F.unflatten_state(
            {k[len("global/") :]: v for k, v in tensors.items() if k.startswith("global/")}
        )

    # ---- helpers shared by methods -----------------------------------------------
    @staticmethod
    def weights(replies: Replies) -> dict[str, float]:
        """p_k ∝ n_k over the clients that replied."""
        tot = float(sum(r["n"] for r in replies.ok.values()))
        return {cid: r["n"] / tot for cid, r in replies.ok.items()}

    def aggregate_average(self, replies: Replies, keys=("A", "B"), head=True) -> dict:
        cids = replies.senders
        states = [replies.ok[c]["state"] for c in cids]
        w = [replies.ok[c]["n"] for c in cids]
        new = F.weighted_average(states, w, keys=keys, head=head)
        # Keep the parts nobody averages (e.g. frozen A in FFA) from the global state.
        for k, ab in new["factors"].items():
            for which in ("A", "B"):
                if which not in keys:
                    ab[which] = self.global_state["factors"][k][which].clone()
        if not head:
            new["head"] = {k: v.clone() for k, v in self.global_state["head"].items()}
        return new

    def update_norms(self, replies: Replies) -> dict:
        """‖θ_k − θ_global‖ of each replied state against the current (pre-aggregation)
        global state: reported every round so that an enormous — possibly poisoned —
        update is visible even for methods without clipping. Call before aggregating."""
        out: dict = {}
        cids = [c for c in replies.senders if "state" in replies.ok[c]]
        if not cids:
            return out
        # Update norms are reported so that an enormous (possibly poisoned) update is
        # visible even for methods without clipping.
        base = F.flatten_state(self.global_state)
        norms = {}
        for c in cids:
            flat = F.flatten_state(replies.ok[c]["state"])
            norms[c] = math.sqrt(
                sum(
                    float((flat[k].float() - base[k].float()).pow(2).sum())
                    for k in base
                    if k in flat and flat[k].shape == base[k].shape
                )
            )
        vals = sorted(norms.values())
        med = vals[len(vals) // 2]
        out["update_norm_max"] = vals[-1]
        out["update_norm_median"] = med
        big = [c for c, v in norms.items() if med > 0 and v > 10 * med]
        if big:
            out["outlier_updates"] = big
            self.server.log(
                f"update norm of client(s) {big} is "
                f"more than 10x the median ({med:.3g}); not clipped (no DP clipping in this mode)"
                if self.server.dp_level == "none"
                else f"update norm of client(s) {big} is more than 10x the median ({med:.3g})"
            )
        return out

    def noise_metrics(self, replies: Replies, new_global: dict | None = None) -> dict:
        """init_noise (mean of the clients' reported ``init_noise``) and agg_noise of the
        new global state against the exact weighted average of the replied states
        (fl.linalg.noise). Call after aggregation."""
        from fl.linalg.noise import agg_noise

        new_global = self.global_state if new_global is None else new_global
        cids = [c for c in replies.senders if "state" in replies.ok[c]]
        out = {}
        inits = [float(replies.ok[c]["init_noise"]) for c in cids if "init_noise" in replies.ok[c]]
        if inits:
            out["init_noise"] = sum(inits) / len(inits)
        if cids:
            out["agg_noise"] = agg_noise(
                new_global,
                [replies.ok[c]["state"] for c in cids],
                [replies.ok[c]["n"] for c in cids],
                self.server.scaling,
            )
        return out

    def client_level_dp_average(
        self, rnd: RoundInfo, replies: Replies, keys=("A", "B"), head=True
    ) -> tuple[dict, dict]:
        """Server-side Gaussian mechanism on client updates (client-level DP).

        Each client's update u_k = θ_k − θ_global over the released parameters (the
        chosen factors and the head, flattened jointly) is clipped to ℓ2 norm C; the
        server adds N(0, σ²C²I) to Σ_k u_k and divides by the *expected* number of
        clients per round m (a fixed denominator: with a data-dependent one the
        sensitivity bound C/m would not hold). Add/remove one client changes the sum
        by at most C, so each round is one Gaussian mechanism with noise multiplier σ.
        A non-finite update contributes zero and is counted (``fl.privacy.clipping``).
        """
        srv = self.server
        base = F.flatten_state(self.global_state)
        names = [
            k
            for k in base
            if (k.startswith("head/") and head)
            or (k.startswith("factors/") and k.rsplit("/", 1)[-1] in keys)
        ]
        total = {k: torch.zeros_like(base[k], dtype=torch.float32) for k in names}
        updates = []
        for cid in replies.senders:
            flat = F.flatten_state(replies.ok[cid]["state"])
            updates.append([flat[k].float() - base[k].float() for k in names])
        norms = torch.zeros(0, dtype=torch.float64)
        if updates:
            # The one client-level clip (fl.privacy.clipping): a NaN/Inf update must not
            # pass as small — it contributes zero and is counted.
            clipped, norms, _ = clipping.clip_dense_clients(updates, srv.clip)
            for upd in clipped:
                for k, u in zip(names, upd):
                    total[k] += u
        canaries = srv.canary_clients  # --canary-clients (audit); None by default
        if canaries is not None:
            # Canary clients taking part this round: fixed updates of norm C, through the
            # same clip as a client, into the sum before the noise (fl.privacy.canary_clients).
            shapes = [tuple(base[k].shape) for k in names]
            ids = canaries.taking_part(rnd.index)
            for chunk in canaries.dense_update_chunks(names, shapes, ids):
                for upd in clipping.clip_dense_clients(chunk, srv.clip)[0]:
                    for k, u in zip(names, upd):
                        total[k] += u
        sigma = srv.noise_multiplier
        gen = srv.noise_generator(rnd, "client-level")
        m = srv.expected_clients_per_round
        out = F.flatten_state(F.clone_state(self.global_state))
        privatized = []  # the noisy sums, kept only for the canary clients' observation
        for k in names:
            noise = srv.noise(tuple(total[k].shape), sigma * srv.clip, gen)
            # one release over all keys: Σ clipped client updates, sensitivity C per client
            noisy = tap.release("client-aggregate", total[k], noise, srv.clip, part=k)
            out[k] = (base[k].float() + noisy / m).to(base[k].dtype)
            if canaries is not None:
                privatized.append(noisy)
        srv.record_client_level_release(rnd, stage="aggregate", count=1)
        if canaries is not None:
            canaries.observe_dense(
                rnd.index,
                names,
                [base[k] for k in names],
                [out[k] for k in names],
                privatized=privatized,
            )
        return F.unflatten_state(out), clipping.stats(norms, srv.clip)
