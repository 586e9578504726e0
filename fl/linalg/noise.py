"""Initialization and aggregation noise of a round (ARCHITECTURE.md, noise definitions).

Both are measured on the effective LoRA updates s·B A of every adapted layer (the
head is excluded), summed over layers as sqrt(Σ_layers ‖·‖_F²), in factored form
(no m×n matrix is formed).

- init_noise: mean over the round's clients of ‖W_client_start − W_global‖_F — what a
  client starts from minus the global model (0 when a client starts exactly at it).
- agg_noise: ‖ΔW_server − Σ_k p_k ΔW_k‖_F — the server's new global update minus the
  ideal (exact, data-size-weighted) average of what the clients trained.
"""

from __future__ import annotations

import math

import torch

from fl.linalg import factored_sum_norm


def _layer_diff_sq(Bs: list[torch.Tensor], As: list[torch.Tensor], w: list[float]) -> float:
    v = factored_sum_norm(
        [b.double() for b in Bs], [a.double() for a in As], torch.tensor(w, dtype=torch.float64)
    )
    return float(v) ** 2


def state_distance(a: dict, b: dict, s: float) -> float:
    """sqrt(Σ_layers ‖s·B_aA_a − s·B_bA_b‖_F²)."""
    tot = 0.0
    for k in a["factors"]:
        fa, fb = a["factors"][k], b["factors"][k]
        tot += _layer_diff_sq([fa["B"], fb["B"]], [fa["A"], fb["A"]], [1.0, -1.0])
    return s * math.sqrt(tot)


def init_noise(client_starts: list[dict], global_state: dict, s: float) -> float:
    if not client_starts:
        return float("nan")
    return sum(state_distance(c, global_state, s) for c in client_starts) / len(client_starts)


def agg_noise(new_global: dict, client_states: list[dict], weights: list[float], s: float) -> float:
    """‖s·B_gA_g − Σ_k p_k s·B_kA_k‖ summed over layers (weights normalized to 1)."""
    tot_w = float(sum(weights))
    p = [w / tot_w for w in weights]
    tot = 0.0
    for k in new_global["factors"]:
        Bs = [new_global["factors"][k]["B"]] + [c["factors"][k]["B"] for c in client_states]
        As = [new_global["factors"][k]["A"]] + [c["factors"][k]["A"] for c in client_states]
        tot += _layer_diff_sq(Bs, As, [1.0] + [-x for x in p])
    return s * math.sqrt(tot)
