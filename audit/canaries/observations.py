"""The observation file of a training done elsewhere (``fedlora-canary-observations/1``): what
a hook (:mod:`audit.canaries.hooks`, :mod:`audit.canaries.client_hook`) writes and the outside
audit (:mod:`audit.canaries.outside`) reads — one ``.npz`` of named arrays, loaded without
pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fl.errors import UsageError

__all__ = ["OBS_FORMAT", "read_observations", "write_observations"]

OBS_FORMAT = "fedlora-canary-observations/1"


def write_observations(path, fields: dict) -> Path:
    """Write an observation file (``.npz``; ``.json`` also accepted by the reader)."""
    p = Path(path)
    arrays = {k: np.asarray(v) for k, v in {"format": OBS_FORMAT, **fields}.items()}
    if p.suffix == ".json":
        doc = {k: (v.tolist() if v.ndim else v.item()) for k, v in arrays.items()}
        from fl.io import atomic_write_json

        atomic_write_json(p, doc)
        return p
    if p.suffix != ".npz":
        p = p.with_suffix(p.suffix + ".npz") if p.suffix else p.with_suffix(".npz")
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, p)
    return p


def read_observations(path) -> dict:
    """An observation file as a dict of numpy arrays / Python scalars (``.npz`` or JSON)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--observations: file not found: {p}")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            doc = {k: np.asarray(v) for k, v in raw.items()}
        else:
            with np.load(p, allow_pickle=False) as z:
                doc = {k: z[k] for k in z.files}
    except Exception as exc:  # any unreadable file (bad zip, pickle, JSON, encoding)
        raise UsageError(f"--observations: cannot read {p} ({type(exc).__name__}: {exc})") from None
    if str(doc.get("format", "")) != OBS_FORMAT:
        raise UsageError(f"--observations: {p} is not an observation file ({OBS_FORMAT})")
    return doc
