"""Fed-PLoRA (arXiv 2602.16936, "Heterogeneous Federated Fine-Tuning with Parallel
One-Rank Adaptation"): Select-N-Fold.

The rank-R LoRA of every adapted layer is read as R parallel rank-1 modules
B_(j) A_(j) (column j of B, m×1, times row j of A, 1×n), j = 0..R−1. Each round client i
with rank budget r_i <= R

1. *selects* K_i ⊂ {0..R−1}, |K_i| = r_i (pluggable policy, option ``selection``;
   ``random`` = uniform without replacement, seeded from the round seed and the client
   id),
2. *folds* the other modules into its frozen base,
   W_i = W_0 + Σ_{j∉K_i} s·B_(j)A_(j) + Σ_{j∈K_i} s·B_(j)A_(j),
3. trains the selected modules (and the classification head) and sends them back with
   their indices K_i.

The server averages each module j over the clients that trained it (weights ∝ n_k,
renormalized among them; :func:`fl.linalg.plora_aggregate`); a module no client trained
keeps its value. The head is averaged over all replying clients (∝ n_k).

Fold = freeze. The folded modules are not trained, so keeping them in place as frozen
LoRA ranks (gradient mask 0, see ``ClientContext.train(grad_mask=...)``) computes exactly
W_0 + Σ_{j∉K_i} s·B_(j)A_(j) + Σ_{j∈K_i} s·B_(j)A_(j) — the same function and the same
gradients for the selected modules as adding s·B_fold A_fold to W_0. This
implementation therefore realizes the fold as a freeze (no m×n matrix is formed, the
base model is untouched); ``tests/fl/test_hetero.py`` checks that the pure
:func:`fl.linalg.fold_modules` into the base weights gives the same weights and logits.
Masked coordinates are excluded from DP-SGD's per-sample clipping norm and their noisy
gradient is zeroed, so under DP they stay exactly unchanged.

Initialization noise is 0: the client starts from the global factors themselves.
Aggregation noise is generally > 0: averaging B_(j) and A_(j) separately over the
clients that trained module j has the FedAvg cross-term error
(Σ p B)(Σ p A) ≠ Σ p B A once two clients trained the same module.

This file also holds the rank helpers shared by the heterogeneous-rank methods
(flora, flexlora, hetlora).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fl.errors import UsageError
from fl.linalg import fold_modules, plora_aggregate, unfold_modules
from fl.linalg.noise import agg_noise, state_distance
from fl.methods.base import Method, Options, RoundInfo
from fl.methods.context import ClientView
from fl.methods.registry import register

# ------------------------------------------------------------------ shared rank helpers


def client_rank(client: ClientView) -> int:
    """r_i of a client (``--client-ranks`` / ``--client-ranks-list``; R when not given)."""
    return client.rank


def rank_mask(state: dict, keep_idx: list[int]) -> dict[str, torch.Tensor]:
    """grad_mask for ``client.train``: 1 on ranks ``keep_idx`` (rows of A (R×n), columns
    of B (m×R)), 0 elsewhere, for every adapted layer (keys ``factors/<mod>/A|B``)."""
    out = {}
    for mod, ab in state["factors"].items():
        R = ab["A"].shape[0]
        sel = torch.zeros(R, dtype=ab["A"].dtype)
        sel[list(keep_idx)] = 1.0
        out[f"factors/{mod}/A"] = sel[:, None].expand_as(ab["A"]).contiguous()
        out[f"factors/{mod}/B"] = sel[None, :].expand_as(ab["B"]).contiguous()
    return out


def head_average(heads: list[dict], weights: list[float]) -> dict:
    """Σ_k p_k head_k (p ∝ weights): the classification head, shared by every client."""
    tot = float(sum(weights))
    return {k: sum((w / tot) * h[k] for w, h in zip(weights, heads)) for k in heads[0]}


def mean(xs) -> float:
    xs = [float(x) for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


# ------------------------------------------------------------------ selection policies


# policy(R, r, seed, round_index, cid) -> sorted list of r distinct module indices in [0, R)
SelectionPolicy = Callable[[int, int, int, int, str], list[int]]
SELECTION_POLICIES: dict[str, SelectionPolicy] = {}


def register_selection(name: str):
    """Decorator: add a module-selection policy usable as ``--opt selection=<name>``."""

    def deco(fn: SelectionPolicy) -> SelectionPolicy:
        SELECTION_POLICIES[name] = fn
        return fn

    return deco


@register_selection("random")
def select_random(R: int, r: int, seed: int, round_index: int, cid: str) -> list[int]:
    """K_i uniform among the r-subsets of {0..R−1} (the paper's policy), from ``seed``."""
    g = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(R, generator=g)[:r].tolist())


@register_selection("roundrobin")
def select_roundrobin(R: int, r: int, seed: int, round_index: int, cid: str) -> list[int]:
    """Deterministic cover: modules (offset + round·r + t) mod R, t < r, with a per-client
    offset derived from the client id (so clients of one round differ)."""
    from fl.privacy.rng import derive_seed

    off = derive_seed("roundrobin", cid) % R
    return sorted({(off + round_index * r + t) % R for t in range(r)})


# ------------------------------------------------------------------ pure steps


def client_split(B: torch.Tensor, A: torch.Tensor, idx: list[int]):
    """A client's view of one layer for its selected modules ``idx``: (fold (B_f, A_f),
    B_sel (m×r), A_sel (r×n)) with B_sel A_sel + B_f A_f = B A
    (:func:`fl.linalg.fold_modules`)."""
    return fold_modules(B, A, idx)


def server_layer(
    Bg: torch.Tensor, Ag: torch.Tensor, client_modules: list[tuple], weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fed-PLoRA's server step on one layer (pure; the method and ``analysis.hetero``
    call it): average each rank-1 module over the clients that trained it, weights
    ∝ ``weights`` renormalized among them; untrained modules keep their value
    (:func:`fl.linalg.plora_aggregate`). ``client_modules[k] = (idx_k, B_sel_k, A_sel_k)``."""
    return plora_aggregate(Bg, Ag, client_modules, weights)


# ------------------------------------------------------------------ the method


@dataclass
class PLoRAOptions(Options):
    selection: str = field(
        default="random",
        metadata={"help": "module selection policy: " + ", ".join(sorted(SELECTION_POLICIES))},
    )

    def validate(self):
        if self.selection not in SELECTION_POLICIES:
            raise UsageError(
                f"plora option selection must be one of {sorted(SELECTION_POLICIES)}, "
                f"got {self.selection!r}"
            )


@register
class PLoRA(Method):
    name = "plora"
    Options = PLoRAOptions
    dp_levels = ("none", "sample")
    release_note = (
        "rank-R LoRA factors (R rank-1 modules, each averaged over the clients that "
        "trained it) and the classification head"
    )

    def server_round(self, rnd: RoundInfo, clients, send) -> dict:
        replies = send(clients, "train", {"state": self.global_state})
        if not replies.ok:
            return {"failed_clients": replies.failed, "skipped": "no client replied"}
        cids = replies.senders
        ns = [float(replies.ok[c]["n"]) for c in cids]
        old = self.global_state
        new = {"factors": {}, "head": head_average([replies.ok[c]["head"] for c in cids], ns)}
        R = self.server.cfg.rank
        trained = torch.zeros(R, dtype=torch.bool)
        for mod, ab in old["factors"].items():
            mods = [
                (replies.ok[c]["idx"], replies.ok[c]["modules"][mod]["B"],
                 replies.ok[c]["modules"][mod]["A"])
                for c in cids
            ]  # fmt: skip
            B, A = server_layer(ab["B"], ab["A"], mods, ns)
            new["factors"][mod] = {"A": A, "B": B}
        for c in cids:
            trained[replies.ok[c]["idx"].long()] = True
        # What each client's full rank-R adapter was after training: its trained modules
        # in place of the global ones (the server knows K_i) — for agg_noise.
        full = [self.client_full_state(old, replies.ok[c]) for c in cids]
        self.global_state = new
        metrics = {
            "train_loss": mean(replies.ok[c]["loss"] for c in cids),
            "init_noise": mean(replies.ok[c]["init_noise"] for c in cids),
            "agg_noise": agg_noise(new, full, ns, self.server.scaling),
            "modules_untrained": int((~trained).sum()),
        }
        if replies.failed:
            metrics["failed_clients"] = replies.failed
        return metrics

    @staticmethod
    def client_full_state(global_state: dict, reply: dict) -> dict:
        idx = reply["idx"].long()
        out = {"factors": {}, "head": reply["head"]}
        for mod, ab in global_state["factors"].items():
            B, A = ab["B"].clone(), ab["A"].clone()
            B[:, idx] = reply["modules"][mod]["B"]
            A[idx, :] = reply["modules"][mod]["A"]
            out["factors"][mod] = {"A": A, "B": B}
        return out

    def client_start(self, client: ClientView, glob: dict) -> tuple[dict, list[int]]:
        """The client's start state and its selected modules K_i for this round."""
        R = next(iter(glob["factors"].values()))["A"].shape[0]
        r = client_rank(client)
        policy = SELECTION_POLICIES[self.opts.selection]
        idx = policy(
            R, r, client.round.derive(f"select/{client.id}"), client.round.index, client.id
        )
        # The client's model: W_0 + fold (frozen) + selected modules (trained). Build its
        # start state from the fold representation so init_noise measures what it runs.
        start = {"factors": {}, "head": glob["head"]}
        for mod, ab in glob["factors"].items():
            (Bf, Af), Bk, Ak = client_split(ab["B"], ab["A"], idx)
            B, A = unfold_modules(Bk, Ak, idx, Bf, Af)
            start["factors"][mod] = {"A": A, "B": B}
        return start, idx

    def on_train(self, client: ClientView, payload: dict) -> dict:
        glob = payload["state"]
        start, idx = self.client_start(client, glob)
        res = client.train(start, trainable=("A", "B", "head"), grad_mask=rank_mask(start, idx))
        modules = {
            mod: {"B": ab["B"][:, idx].clone(), "A": ab["A"][idx, :].clone()}
            for mod, ab in res.state["factors"].items()
        }
        return {
            "idx": torch.tensor(idx, dtype=torch.long),
            "modules": modules,
            "head": res.state["head"],
            "loss": res.loss,
            "n": client.n,
            "init_noise": state_distance(start, glob, client.scaling),
        }
