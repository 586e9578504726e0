"""Checkpoints of a run (``RUN/checkpoint/``): after every completed round, the method's
tensors and the clients' persistent state (one safetensors file) and a JSON meta file
(completed rounds, checksum, method meta, ledger, σ, config). ``--resume`` loads the
newest one and refuses a different configuration or a corrupt state file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fl.errors import UsageError
from fl.io import atomic_write_json, file_sha256, read_json
from fl.privacy.ledger import Ledger
from fl.run.config import result_fields


def save_checkpoint(out: Path, completed: int, method, client_states: dict, ledger, sigma, cfg):
    """Write the checkpoint after round ``completed`` and delete older ones."""
    ck = out / "checkpoint"
    ck.mkdir(exist_ok=True)
    tensors, meta = method.state_dict()
    client_meta = {
        cid: _encode_nested(st, tensors, f"client/{cid}") for cid, st in client_states.items()
    }
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    st_path = ck / f"state-{completed:05d}.safetensors"
    tmp = st_path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    _fsync_file(tmp)
    os.replace(tmp, st_path)
    doc = {
        "version": 1,
        "completed_rounds": completed,
        "state_file": st_path.name,
        "state_sha256": file_sha256(st_path),
        "method_meta": meta,
        "client_meta": client_meta,
        "ledger": ledger.state_dict(),
        "sigma": sigma,
        "config": cfg.to_dict(),
    }
    atomic_write_json(ck / f"meta-{completed:05d}.json", doc)
    for old in ck.glob("*-*.*"):
        stem = old.name.split("-", 1)[1].split(".", 1)[0]
        if stem.isdigit() and int(stem) < completed:
            old.unlink(missing_ok=True)


def load_checkpoint(out: Path, cfg, method, sigma: float):
    """Load the newest checkpoint into ``method``; returns (completed rounds, client
    states, ledger), or None when there is no completed round."""
    ck = out / "checkpoint"
    metas = sorted(ck.glob("meta-*.json"), reverse=True) if ck.is_dir() else []
    if not metas:
        return None
    doc = read_json(metas[0])
    st_path = ck / str(doc.get("state_file", ""))
    if not st_path.is_file() or file_sha256(st_path) != doc.get("state_sha256"):
        raise UsageError(f"checkpoint {st_path} is missing or corrupt (checksum mismatch)")
    saved_cfg = doc.get("config", {})
    mine = cfg.to_dict()
    # a field added after the checkpoint was written has its default there
    defaults = type(cfg)().to_dict()
    diffs = [k for k in result_fields() if saved_cfg.get(k, defaults[k]) != mine[k]]
    if diffs:
        raise UsageError(f"--resume with a different configuration (fields {diffs}); refusing")
    tensors = load_file(str(st_path))
    method.load_state_dict(
        {k: v for k, v in tensors.items() if not k.startswith("client/")}, doc["method_meta"]
    )
    client_states = {
        cid: _decode_nested(cm, tensors) for cid, cm in doc.get("client_meta", {}).items()
    }
    ledger = Ledger.from_state_dict(doc["ledger"])
    if abs(float(doc.get("sigma", sigma)) - sigma) > 1e-12:
        raise UsageError(
            "checkpoint's noise multiplier differs from the recalibrated one; refusing"
        )
    return int(doc["completed_rounds"]), client_states, ledger


def _encode_nested(obj, tensors: dict, prefix: str):
    """JSON-able copy of ``obj`` with every tensor moved into ``tensors`` (by key)."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {
            "__dict__": [[k, _encode_nested(v, tensors, f"{prefix}/{k}")] for k, v in obj.items()]
        }
    if isinstance(obj, list | tuple):
        return [_encode_nested(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    return obj


def _decode_nested(obj, tensors: dict):
    if isinstance(obj, dict) and "__tensor__" in obj:
        key = obj["__tensor__"]
        if key not in tensors:
            raise UsageError(f"checkpoint is missing tensor {key!r}")
        return tensors[key]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {k: _decode_nested(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_decode_nested(v, tensors) for v in obj]
    return obj


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
