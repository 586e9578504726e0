"""Replay: retrain a run from its configuration and noise key, compare with the release.

With the run's key every random draw the DP guarantee relies on (noise, Poisson batches,
cohorts) is reproduced, so a run retrained on the CPU must give the released adapter bit
for bit (within :data:`CUDA_RTOL` of each tensor's scale when the run was made on CUDA)
and the same privacy block; otherwise ``replay_mismatch`` (see :mod:`audit.bundle.audit`).

Order: the key must be the run's (``key_mismatch``); the manifest's MAC
(:mod:`fl.run.integrity`) must verify under it (``manifest_mac_mismatch``: nothing is
replayed, the manifest is not the one the run wrote); only then is the run retrained, and
the whole release compared: the adapter, the privacy block (``replay_mismatch``), every
other public field, ``adapter_config.json`` and the public per-round metrics
(``release_mismatch``). A manifest without a MAC (written before manifests were sealed)
is replayed and compared bit for bit, whatever its ``device`` says.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from audit.findings import Code, Findings
from fl.errors import UsageError
from fl.io import read_json
from fl.run import rundir
from fl.run.integrity import verify_mac
from fl.run.release import PUBLIC_METRICS, public_manifest
from fl.run.rundir import read_metrics

__all__ = ["replay", "compare_adapters", "trained_device", "CUDA_RTOL"]

#: Replay tolerance for runs made on CUDA (the replay runs on the CPU): every tensor of
#: the replayed adapter must lie within CUDA_RTOL × (the released tensor's largest
#: magnitude) of the released one. GPU kernels (cuBLAS reductions, atomics in backward
#: passes) are not bit-deterministic and round differently from the CPU's; a run's
#: float32 rounding differences are ~1e-7 per operation and grow over the steps, but the
#: DP noise, the batches and the cohorts are the same draws (from the key), so an honest
#: replay is expected to stay well below 1e-4 (not yet measured on a GPU: no device was lent to the sessions that could), while a different σ, C, sampling or data
#: changes the noisy updates at their own scale (≥ 1e-2 relative for a material
#: change; a relative σ edit below ~1e-4 could pass, with a negligible effect on ε).
#: CPU-made runs are compared bit for bit. The tolerance applies only when the
#: manifest's MAC verifies under the key (an unauthenticated ``device`` field chooses
#: nothing), and the audit then says that it cannot rule out a low-bit channel: 1e-4 of a
#: tensor's scale leaves about 9 mantissa bits of each float32 weight unchecked.
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


def trained_device(run: Path, m: dict, bundle: bool) -> tuple[str, str]:
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


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@contextlib.contextmanager
def _deterministic(device: str):
    """On CUDA: deterministic kernels for the replay (cuBLAS workspace, no atomics)."""
    if device != "cuda":
        yield
        return
    import torch

    old_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    old_mode = torch.are_deterministic_algorithms_enabled()
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_mode)
        if old_env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = old_env


#: fields a replay legitimately changes: when and where it ran, with which versions
_RELEASE_VOLATILE = {"created", "versions", "tool_version", "device", "wall_seconds", "log"}


def _public_rows(rows: list[dict] | None, exact: bool) -> list[dict]:
    keep = PUBLIC_METRICS if exact else ("round", "epsilon")
    return [{k: r[k] for k in keep if k in r} for r in (rows or [])]


def _release_diffs(run: Path, m: dict, rdir: Path, rm: dict, bundle: bool, exact: bool) -> list:
    """Where the audited release differs from the replay's: the public manifest (all
    fields but when/where/with which versions it ran; the config's runtime fields; the
    MAC), ``adapter_config.json`` and the public per-round metrics. With a tolerance
    (``exact`` False) the adapter's hashes and the metrics' accuracy and loss are not
    compared (they follow the adapter, compared within the tolerance)."""
    from fl.run.config import RUNTIME_FIELDS

    if bundle:
        mine, theirs = m, read_json(rdir / "release" / "manifest.json")
    else:
        mine, theirs = public_manifest(m), public_manifest(rm)
        for d, src in ((mine, m), (theirs, rm)):  # the operator's membership record too
            d["data_splits"] = {k: (src.get("data") or {}).get(k) for k in _SPLIT_HASHES}

    def strip(d: dict) -> dict:
        d = json.loads(json.dumps(d))
        for k in _RELEASE_VOLATILE:
            d.pop(k, None)
        for k in RUNTIME_FIELDS:
            (d.get("config") or {}).pop(k, None)
        integ = d.get("integrity") if isinstance(d.get("integrity"), dict) else {}
        integ.pop("mac", None)
        if not exact:
            d.pop("adapter_sha256", None)
            d.pop("metrics", None)
            integ.pop("files", None)
        return d

    out: list[str] = []
    _diff_paths(strip(mine), strip(theirs), "manifest", out)
    # the privacy fields a replay must reproduce are reported on their own (replay_mismatch)
    own = tuple(f"manifest.privacy.{f}" for f in _REPLAY_PRIVACY_FIELDS)
    out = [d for d in out if not d.startswith(own)]
    cfg_a, cfg_b = run / "adapter" / "adapter_config.json", rdir / "adapter" / "adapter_config.json"
    try:
        a_cfg = read_json(cfg_a)
    except UsageError as exc:
        out.append(f"adapter/adapter_config.json ({exc})")
    else:
        sub: list[str] = []
        _diff_paths(a_cfg, read_json(cfg_b), "adapter_config.json", sub)
        out += sub
    rows_a = read_metrics(run, strict=False)
    rows_b = read_metrics(rdir / "release" if bundle else rdir, strict=False)
    sub = []
    _diff_paths(_public_rows(rows_a, exact), _public_rows(rows_b, exact), "metrics.jsonl", sub)
    out += sub
    return out


_SPLIT_HASHES = ("splits_sha256", "members_sha256")


def replay(
    run: Path, m: dict, bundle: bool, key_path: Path, log: Callable[[str], None] | None
) -> tuple[dict, Findings]:
    """Retrain the run from its configuration and key on the CPU; compare with the
    release (adapter bit for bit, privacy block field by field). Returns the replay's
    record (``audit_run``'s ``"replay"``) and its findings."""
    found = Findings()
    from fl.privacy.rng import NoiseKey
    from fl.run.config import TrainConfig
    from fl.run.engine import train

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
    sealed, why_not = verify_mac(m, key)
    if sealed is False:
        found.add(
            Code.MANIFEST_MAC_MISMATCH,
            f"The manifest's MAC does not verify under the run key ({why_not}): the manifest "
            "is not the one the run wrote (a field was edited after the run), so nothing it "
            "states can be relied on; the replay was not run.",
        )
        return {"performed": False, "verified": False, "reason": "manifest_mac_mismatch"}, found
    if sealed is None:
        found.add(
            Code.MANIFEST_UNSEALED,
            f"The manifest cannot be authenticated with the key: {why_not}. The replay still "
            "checks the adapter and the privacy block, but it compares the adapter bit for "
            "bit whatever the manifest's device says (an unauthenticated field chooses no "
            "tolerance).",
        )
    if bundle:
        cfg_dict, cfg_src = m["config"], "the manifest's config"
    elif (run / rundir.CONFIG).is_file():
        cfg_dict, cfg_src = read_json(run / rundir.CONFIG), "config.json"
    else:
        cfg_dict, cfg_src = m["config"], "the manifest's config (config.json is missing)"
    if not isinstance(cfg_dict, dict):
        raise UsageError(f"{run}: {cfg_src} must be a JSON object")
    cfg = TrainConfig.from_dict(cfg_dict)
    # Only an authenticated manifest may say the run was made on CUDA and so relax the
    # comparison: an unsealed one is compared bit for bit.
    trained_on, how = trained_device(run, m, bundle) if sealed else ("cpu", "not authenticated")
    rtol = CUDA_RTOL if trained_on == "cuda" else 0.0
    replay_device = "cpu"
    if trained_on == "cuda" and _cuda_available():
        replay_device = "cuda"  # the closest replay: same kind of kernels, deterministic mode
    cfg.device, cfg.progress = replay_device, False  # neither changes the results on the CPU
    say = log or (lambda line: None)
    say(
        f"replay: retraining the whole run on the CPU from {cfg_src} and the key "
        f"({cfg.method}, {cfg.rounds} rounds, {cfg.clients} clients, model {cfg.model}); this "
        "takes about as long as the original training on a CPU"
    )
    if rtol:
        say(
            f"replay: the run was made on CUDA ({how}, authenticated); the replay runs on "
            f"{replay_device.upper()} and compares within {rtol:g} of each tensor's scale (GPU "
            "kernels are not bit-deterministic; a tolerance cannot rule out a low-bit channel)"
        )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlora-replay-") as tmp:
        try:
            # rounds re-run after a stop are re-run as the same attempt (fl.run.inflight)
            events = ((m.get("privacy") or {}).get("ledger") or {}).get("events") or []
            with _deterministic(replay_device):
                train(cfg, Path(tmp) / "replay", quiet=True, noise_key=key, reenact=events)
        except UsageError as exc:
            raise UsageError(f"replay of {run} failed: {exc}") from None
        seconds = time.perf_counter() - t0
        rdir = Path(tmp) / "replay"
        rm = read_json(rdir / "manifest.json")
        # the whole release: every public field, adapter_config.json, the public metrics
        release_diffs = _release_diffs(run, m, rdir, rm, bundle, exact=rtol == 0)
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
            f"was made on CUDA ({how}, authenticated by the manifest's MAC). A tolerance "
            "cannot rule out information hidden in the weights' low bits (a float32 weight "
            "keeps about 9 mantissa bits below 1e-4 of its scale); only a bit-exact replay does.",
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
    if release_diffs:
        found.add(
            Code.RELEASE_MISMATCH,
            "Retrained from the configuration and the key, the release differs from the "
            f"audited one in {'; '.join(release_diffs[:6])}"
            + (f" and {len(release_diffs) - 6} more" if len(release_diffs) > 6 else "")
            + ": what the bundle states about its run is not what the run produced.",
        )
    return {
        "performed": True,
        "verified": bool(adapter_ok and not diffs and not release_diffs),
        "authenticated": bool(sealed),
        "release_fields_differing": release_diffs,
        "exact": bool(cmp["equal"]),
        "max_abs_diff": cmp["max_abs_diff"],
        "max_rel_diff": cmp["max_rel_diff"],
        "worst_tensor": cmp["worst_tensor"],
        "tolerance": rtol,
        "trained_on": trained_on,
        "replayed_on": replay_device,
        "low_bit_channel_ruled_out": bool(cmp["equal"]),
        "config_source": cfg_src,
        "privacy_fields_differing": diffs,
        "seconds": seconds,
    }, found
