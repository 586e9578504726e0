"""Read LoRA factors, scaling and per-round metrics from run directories
(docs/run_directory.md), for the ``--runs`` mode of every analysis.

A run's adapter is ``RUN/adapter/adapter_model.safetensors`` in PEFT format: keys
``base_model.model.<module>.lora_A.weight`` (A, r×n) and ``...lora_B.weight`` (B, m×r)
(``.default`` may appear before ``.weight`` in unsaved state dicts; both are read).
The LoRA scaling is s = alpha / rank from ``manifest.json``'s config, so the effective
update of a module is ΔW = s·B A.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fl.errors import UsageError
from fl.run import rundir

__all__ = [
    "read_manifest",
    "load_factors",
    "run_scaling",
    "read_metrics",
    "module_update_norm_sq",
]

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


def _run_dir(path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"run directory {str(p)!r} does not exist")
    if not (p / rundir.MANIFEST).is_file():
        raise UsageError(f"{str(p)!r} is not a finished run (no {rundir.MANIFEST})")
    return p


def read_manifest(path) -> dict:
    """The run's manifest.json as a dict (UsageError if missing or unreadable)."""
    return rundir.read_manifest(path)


def run_scaling(path) -> float:
    """LoRA scaling s = alpha / rank from the manifest config."""
    cfg = read_manifest(path).get("config", {})
    try:
        alpha, rank = float(cfg["alpha"]), int(cfg["rank"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: manifest config lacks alpha/rank") from exc
    if rank <= 0:
        raise UsageError(f"{path}: manifest rank must be > 0, got {rank}")
    return alpha / rank


def load_factors(path, dtype: torch.dtype = torch.float64) -> dict[str, tuple]:
    """{module name: (B (m×r), A (r×n))} of the run's adapter, unscaled, as ``dtype``.

    Modules are sorted by name. UsageError if the adapter is missing or has no LoRA
    pairs, or a module has only one of A, B."""
    from safetensors.torch import load_file

    p = _run_dir(path) / rundir.ADAPTER / rundir.ADAPTER_WEIGHTS
    if not p.is_file():
        raise UsageError(f"{path}: no {rundir.ADAPTER}/{rundir.ADAPTER_WEIGHTS}")
    tensors = load_file(str(p))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m:
            pairs.setdefault(m["mod"], {})[m["ab"]] = t.to(dtype)
    if not pairs:
        raise UsageError(f"{p}: no LoRA factors (keys '*.lora_A.weight' / '*.lora_B.weight')")
    out = {}
    for mod in sorted(pairs):
        ab = pairs[mod]
        if set(ab) != {"A", "B"}:
            raise UsageError(f"{p}: module {mod!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        out[mod] = (ab["B"], ab["A"])
    return out


def read_metrics(path) -> list[dict]:
    """Rows of the run's metrics.jsonl (a torn last line is skipped)."""
    return rundir.read_metrics(_run_dir(path)) or []


def module_update_norm_sq(B: torch.Tensor, A: torch.Tensor, s: float) -> float:
    """‖s·B A‖_F² of one module (factored)."""
    from fl.linalg import factored_sum_norm

    return (s * float(factored_sum_norm([B], [A], [1.0]))) ** 2
