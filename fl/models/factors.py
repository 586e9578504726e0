"""Per-layer LoRA factors as plain tensors, keyed by module name.

Convention (the one place the α/r scaling lives): a LoRA layer computes
``y = W0 x + s · B (A x)`` with B: m×r, A: r×n and ``s = alpha / r_ref``. The factors
here are the raw peft weights (no scaling); :func:`delta_w` / :func:`scaling` apply s.
``r_ref`` is the global rank R for every client and every method (also for clients
that train fewer ranks), so padding, truncating or selecting ranks never rescales
the function — the known defect of mixing alpha/r_i and alpha/R is avoided by design.

A *state* is ``{"factors": {name: {"A": A, "B": B}}, "head": {param: tensor}}``.
"""

from __future__ import annotations

import re

import torch

_LORA_RE = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+)\.lora_(?P<ab>[AB])\.default\.weight$")
_HEAD_RE = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+)\.modules_to_save\.default\.(?P<p>.+)$")


def scaling(alpha: float, rank: int) -> float:
    """s = alpha / R (R = the global rank)."""
    return float(alpha) / float(rank)


def delta_w(B: torch.Tensor, A: torch.Tensor, s: float) -> torch.Tensor:
    """ΔW = s · B A, shape m×n (the dense update; use only where a dense matrix is wanted)."""
    return s * (B @ A)


def lora_param_map(model: torch.nn.Module) -> dict[str, dict[str, torch.nn.Parameter]]:
    out: dict[str, dict[str, torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        m = _LORA_RE.match(name)
        if m:
            out.setdefault(m["mod"], {})[m["ab"]] = p
    return out


def head_param_map(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    out = {}
    for name, p in model.named_parameters():
        m = _HEAD_RE.match(name)
        if m:
            out[f"{m['mod']}.{m['p']}"] = p
    return out


ParamMaps = tuple[dict[str, dict[str, torch.nn.Parameter]], dict[str, torch.nn.Parameter]]


def param_maps(model: torch.nn.Module) -> ParamMaps:
    """(:func:`lora_param_map`, :func:`head_param_map`) of ``model``: computed once by a
    caller that loads states often (a walk over the model's modules costs milliseconds)."""
    return lora_param_map(model), head_param_map(model)


def get_state(model: torch.nn.Module, maps: ParamMaps | None = None) -> dict:
    """Copy of the model's LoRA factors and head (detached, cloned, on CPU). ``maps``:
    the model's :func:`param_maps`, when the caller holds them."""
    fmap, hmap = param_maps(model) if maps is None else maps
    factors = {
        k: {ab: p.detach().to("cpu", copy=True) for ab, p in v.items()} for k, v in fmap.items()
    }
    head = {k: p.detach().to("cpu", copy=True) for k, p in hmap.items()}
    return {"factors": factors, "head": head}


def set_state(model: torch.nn.Module, state: dict, maps: ParamMaps | None = None) -> None:
    """Load factors and head into the model in place (shapes must match). ``maps``: as
    in :func:`get_state`."""
    fmap, hmap = param_maps(model) if maps is None else maps
    with torch.no_grad():
        for k, ab in state["factors"].items():
            if k not in fmap:
                raise ValueError(f"LoRA module {k!r} is not in the model")
            for which, t in ab.items():
                p = fmap[k][which]
                if tuple(p.shape) != tuple(t.shape):
                    raise ValueError(
                        f"LoRA {which} of {k!r}: shape {tuple(t.shape)} does not fit {tuple(p.shape)}"
                    )
                p.copy_(t)
        for k, t in state.get("head", {}).items():
            if k not in hmap:
                raise ValueError(f"head parameter {k!r} is not in the model")
            if tuple(hmap[k].shape) != tuple(t.shape):
                raise ValueError(f"head parameter {k!r}: shape {tuple(t.shape)} does not fit")
            hmap[k].copy_(t)


def clone_state(state: dict) -> dict:
    return {
        "factors": {k: {ab: t.clone() for ab, t in v.items()} for k, v in state["factors"].items()},
        "head": {k: t.clone() for k, t in state.get("head", {}).items()},
    }


def flatten_state(state: dict) -> dict[str, torch.Tensor]:
    """Flat name → tensor view of a state (for safetensors and generic arithmetic)."""
    flat = {}
    for k, ab in state["factors"].items():
        for which, t in ab.items():
            flat[f"factors/{k}/{which}"] = t
    for k, t in state.get("head", {}).items():
        flat[f"head/{k}"] = t
    return flat


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict:
    state: dict = {"factors": {}, "head": {}}
    for key, t in flat.items():
        kind, rest = key.split("/", 1)
        if kind == "factors":
            mod, which = rest.rsplit("/", 1)
            state["factors"].setdefault(mod, {})[which] = t
        elif kind == "head":
            state["head"][rest] = t
        else:
            raise ValueError(f"unknown state key {key!r}")
    return state


def weighted_average(states: list[dict], weights: list[float], keys=("A", "B"), head=True) -> dict:
    """Σ_k p_k state_k entrywise (weights normalized to sum 1) for the chosen factors."""
    tot = float(sum(weights))
    ps = [w / tot for w in weights]
    out = clone_state(states[0])
    for k, ab in out["factors"].items():
        for which in keys:
            ab[which] = sum(p * s["factors"][k][which] for p, s in zip(ps, states))
    if head:
        for k in out["head"]:
            out["head"][k] = sum(p * s["head"][k] for p, s in zip(ps, states))
    return out


def state_sub(a: dict, b: dict) -> dict[str, torch.Tensor]:
    fa, fb = flatten_state(a), flatten_state(b)
    return {k: fa[k] - fb[k] for k in fa}


def effective_distance(s1: dict, s2: dict, s: float) -> float:
    """sqrt(Σ_layers ‖s·B1A1 − s·B2A2‖_F²), computed in factored form (no m×n matrix):
    ‖X−Y‖² = ‖X‖² + ‖Y‖² − 2⟨X,Y⟩ with ⟨B1A1,B2A2⟩ = tr((B2ᵀB1)(A1A2ᵀ))."""
    tot = 0.0
    for k in s1["factors"]:
        B1, A1 = s1["factors"][k]["B"].double(), s1["factors"][k]["A"].double()
        B2, A2 = s2["factors"][k]["B"].double(), s2["factors"][k]["A"].double()
        n11 = torch.trace((B1.T @ B1) @ (A1 @ A1.T))
        n22 = torch.trace((B2.T @ B2) @ (A2 @ A2.T))
        n12 = torch.trace((B2.T @ B1) @ (A1 @ A2.T))
        tot += float(max(n11 + n22 - 2 * n12, torch.tensor(0.0, dtype=torch.float64)))
    return (s * s * tot) ** 0.5
