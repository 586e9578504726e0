"""Replay: retrain a run from its configuration and noise key, compare with the release.

With the run's key every random draw the DP guarantee relies on (noise, Poisson batches,
cohorts) is reproduced, so a run retrained on the CPU must give the released adapter bit
for bit (within :data:`CUDA_RTOL` of each tensor's scale when the run was made on CUDA)
and the same privacy block; otherwise ``replay_mismatch`` (see :mod:`audit.runaudit`).
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from audit.findings import Code, Findings
from fl import rundir
from fl.errors import UsageError
from fl.io import read_json
from fl.release import public_manifest

__all__ = ["replay", "compare_adapters", "CUDA_RTOL"]

#: Replay tolerance for runs made on CUDA (the replay runs on the CPU): every tensor of
#: the replayed adapter must lie within CUDA_RTOL × (the released tensor's largest
#: magnitude) of the released one. GPU kernels (cuBLAS reductions, atomics in backward
#: passes) are not bit-deterministic and round differently from the CPU's; a run's
#: float32 rounding differences are ~1e-7 per operation and grow over the steps, but the
#: DP noise, the batches and the cohorts are the same draws (from the key), so an honest
#: replay is expected to stay well below 1e-4 (not yet measured on a GPU), while a different σ, C, sampling or data
#: changes the noisy updates at their own scale (≥ 1e-2 relative for a material
#: change; a relative σ edit below ~1e-4 could pass, with a negligible effect on ε).
#: CPU-made runs are compared bit for bit.
CUDA_RTOL = 1e-4
#: privacy-block fields a replay must reproduce
_REPLAY_PRIVACY_FIELDS = (
    "level",
    "noise_multiplier",
    "clipping_norm",
    "delta",
    "target_epsilon",
    "sample_rates",
    "steps_per_round",
    "client_sampling",
    "rounds_completed",
    "epsilon",
    "ledger",
)


def _trained_device(run: Path, m: dict, bundle: bool) -> tuple[str, str]:
    """Where the run trained: ("cpu" | "cuda" | "unknown", how we know)."""

    def kind(dev) -> str | None:
        if not isinstance(dev, str):
            return None
        dev = dev.lower()
        return "cpu" if dev == "cpu" else "cuda" if dev.startswith("cuda") else None

    for where, dev in (
        ("manifest device", m.get("device")),
        ("manifest runtime.device", (m.get("runtime") or {}).get("device")),
    ):
        if kind(dev):
            return kind(dev), where
    if not bundle and (run / "run.log").is_file():
        # The engine's start line: "fedlora train: ... device=cpu"; the last one counts.
        found = re.findall(
            r"^fedlora train:.* device=(\S+)",
            (run / "run.log").read_text(encoding="utf-8", errors="replace"),
            re.M,
        )
        if found and kind(found[-1]):
            return kind(found[-1]), "run.log"
    dev = (m.get("config") or {}).get("device")
    if kind(dev):
        return kind(dev), f"config.device = {dev!r}"
    return "unknown", f"config.device = {dev!r} (the device the run used is not recorded)"


def compare_adapters(released: Path, replayed: Path, rtol: float = 0.0) -> dict:
    """Compare two ``adapter_model.safetensors`` tensor by tensor.

    Returns ``{"equal" (bit for bit), "within_tolerance" (every tensor's max |Δ| <=
    rtol × its largest released magnitude), "max_abs_diff", "max_rel_diff" (max over
    tensors of max |Δ| / scale), "worst_tensor", "problem" (names/shapes/dtypes that
    differ, or None)}``."""
    import torch
    from safetensors.torch import load_file

    try:
        a, b = load_file(str(released)), load_file(str(replayed))
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        return {
            "equal": False,
            "within_tolerance": False,
            "max_abs_diff": None,
            "max_rel_diff": None,
            "worst_tensor": None,
            "problem": f"cannot read {released.name}: {exc}",
        }
    problem = None
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        problem = f"tensor names differ (released only: {only_a[:3]}, replay only: {only_b[:3]})"
    equal, within = problem is None, problem is None
    worst, max_abs, max_rel = None, 0.0, 0.0
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            problem = problem or (
                f"tensor {k}: released {list(x.shape)} {x.dtype}, replay {list(y.shape)} {y.dtype}"
            )
            equal = within = False
            continue
        if torch.equal(x, y):
            continue
        equal = False
        d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        scale = x.double().abs().max().item() if x.numel() else 0.0
        rel = d / scale if scale > 0 else math.inf
        if not (rel <= rtol):  # NaN-safe
            within = False
        if worst is None or not (d <= max_abs):
            worst, max_abs = k, d
        max_rel = rel if not (rel <= max_rel) else max_rel
    return {
        "equal": equal,
        "within_tolerance": within,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst_tensor": worst,
        "problem": problem,
    }


def _diff_paths(a, b, path: str, out: list[str], rel: float = 1e-9) -> None:
    """Paths where two JSON values differ (floats within ``rel`` count as equal)."""
    num = (int, float)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}")
            else:
                _diff_paths(a[k], b[k], f"{path}.{k}", out, rel)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path} ({len(b)} entries in the replay, {len(a)} audited)")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_paths(x, y, f"{path}[{i}]", out, rel)
    elif isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool):
        if isinstance(b, bool) or not math.isclose(float(a), float(b), rel_tol=rel, abs_tol=0.0):
            out.append(path)
    elif a != b:
        out.append(path)


def _get_path(d, path: str):
    for part in re.findall(r"[^.\[\]]+", path.split(" ", 1)[0]):
        if isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return None
    return d


def replay(
    run: Path, m: dict, bundle: bool, key_path: Path, log: Callable[[str], None] | None
) -> tuple[dict, Findings]:
    """Retrain the run from its configuration and key on the CPU; compare with the
    release (adapter bit for bit, privacy block field by field). Returns the replay's
    record (``audit_run``'s ``"replay"``) and its findings."""
    found = Findings()
    from fl.config import TrainConfig
    from fl.engine import train
    from fl.privacy.rng import NoiseKey

    noise = m["privacy"].get("noise")
    if not isinstance(noise, dict) or noise.get("source") != "keyed_csprng":
        src = noise.get("source") if isinstance(noise, dict) else None
        raise UsageError(
            f"{run}: its noise was not drawn from a key (privacy.noise.source = {src!r}); there "
            "is no key to replay with (see the noise_reproducible finding)"
        )
    key = NoiseKey.read(key_path)
    if key.key_id != noise.get("key_id"):
        found.add(
            Code.KEY_MISMATCH,
            f"{key_path} has key id {key.key_id}, but the run's manifest records "
            f"privacy.noise.key_id = {noise.get('key_id')!r}: it is not this run's key (or the "
            "manifest's key id was changed); nothing was replayed.",
        )
        return {"performed": False, "verified": False, "reason": "key_mismatch"}, found
    if bundle:
        cfg_dict, cfg_src = m["config"], "the manifest's config"
    elif (run / rundir.CONFIG).is_file():
        cfg_dict, cfg_src = read_json(run / rundir.CONFIG), "config.json"
    else:
        cfg_dict, cfg_src = m["config"], "the manifest's config (config.json is missing)"
    if not isinstance(cfg_dict, dict):
        raise UsageError(f"{run}: {cfg_src} must be a JSON object")
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.device, cfg.progress = "cpu", False  # neither changes the results
    trained_on, how = _trained_device(run, m, bundle)
    rtol = 0.0 if trained_on == "cpu" else CUDA_RTOL
    say = log or (lambda line: None)
    say(
        f"replay: retraining the whole run on the CPU from {cfg_src} and the key "
        f"({cfg.method}, {cfg.rounds} rounds, {cfg.clients} clients, model {cfg.model}); this "
        "takes about as long as the original training on a CPU"
    )
    if rtol:
        say(
            f"replay: the run was made on {'CUDA' if trained_on == 'cuda' else 'an unrecorded device'}"
            f" ({how}); the replay runs on the CPU and compares within {rtol:g} of each tensor's "
            "scale (GPU kernels are not bit-deterministic)"
        )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlora-replay-") as tmp:
        try:
            # rounds re-run after a stop are re-run as the same attempt (fl.inflight)
            events = ((m.get("privacy") or {}).get("ledger") or {}).get("events") or []
            train(cfg, Path(tmp) / "replay", quiet=True, noise_key=key, reenact=events)
        except UsageError as exc:
            raise UsageError(f"replay of {run} failed: {exc}") from None
        seconds = time.perf_counter() - t0
        rm = read_json(Path(tmp) / "replay" / "manifest.json")
        if bundle:  # compare like with like: a bundle's manifest is the public one
            rm = public_manifest(rm)
        released = run / "adapter" / "adapter_model.safetensors"
        if released.is_file():
            cmp = compare_adapters(
                released, Path(tmp) / "replay" / "adapter" / "adapter_model.safetensors", rtol
            )
        else:
            cmp = {
                "equal": False,
                "within_tolerance": False,
                "max_abs_diff": None,
                "max_rel_diff": None,
                "worst_tensor": None,
                "problem": "the released adapter is missing",
            }
    adapter_ok = cmp["equal"] or (rtol > 0 and cmp["within_tolerance"])
    if not adapter_ok:
        if cmp["problem"]:
            what = cmp["problem"]
        else:
            what = (
                f"largest difference {cmp['max_abs_diff']:.3g} in {cmp['worst_tensor']} "
                f"({cmp['max_rel_diff']:.3g} of its scale"
                + (f"; tolerance {rtol:g}" if rtol else "; a CPU-made run replays bit for bit")
                + ")"
            )
        found.add(
            Code.REPLAY_MISMATCH,
            "Retrained from the stated configuration and the run's key, the run gives an "
            f"adapter that differs from the released one ({what}): the release was not made "
            "by the stated mechanism (σ, C, sampling, data or method differ), so the stated ε "
            "is not established.",
        )
    elif not cmp["equal"]:
        found.add(
            Code.REPLAY_INEXACT,
            f"The replay matches within the tolerance {rtol:g} (largest difference "
            f"{cmp['max_abs_diff']:.3g} in {cmp['worst_tensor']}), not bit for bit: the run "
            f"was made on {'CUDA' if trained_on == 'cuda' else 'an unrecorded device'} ({how}).",
        )
    diffs: list[str] = []
    mine, theirs = m["privacy"], rm.get("privacy") or {}
    for f in _REPLAY_PRIVACY_FIELDS:
        if f in mine or f in theirs:
            _diff_paths(mine.get(f), theirs.get(f), f"privacy.{f}", diffs)
    if diffs:
        shown = []
        for d in diffs[:6]:
            a, b = _get_path({"privacy": mine}, d), _get_path({"privacy": theirs}, d)
            scalar = not isinstance(a, dict | list) and not isinstance(b, dict | list)
            shown.append(f"{d} (audited {a!r}, replay {b!r})" if scalar else d)
        more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
        found.add(
            Code.REPLAY_MISMATCH,
            "The replay's privacy block differs from the audited manifest's in "
            f"{'; '.join(shown)}{more}: the stated mechanism or its accounting is not the one "
            "the configuration and key produce.",
        )
    return {
        "performed": True,
        "verified": bool(adapter_ok and not diffs),
        "exact": bool(cmp["equal"]),
        "max_abs_diff": cmp["max_abs_diff"],
        "max_rel_diff": cmp["max_rel_diff"],
        "worst_tensor": cmp["worst_tensor"],
        "tolerance": rtol,
        "trained_on": trained_on,
        "replayed_on": "cpu",
        "config_source": cfg_src,
        "privacy_fields_differing": diffs,
        "seconds": seconds,
    }, found
