"""The run directory (docs/run_directory.md): its layout and file formats, in one place.

Every package reads and writes a run's files through this module:

- ``manifest.json``  the run's manifest (:mod:`fl.run.manifest`), schema :data:`SCHEMA_VERSION`;
  a release bundle holds a public one (``"visibility": "public"``, :func:`is_release`);
- ``config.json``    the training configuration;
- ``splits.json``    member / non-member / test ids, client shards, canaries;
- ``ledger.json``    the privacy ledger;
- ``metrics.jsonl``  one JSON object per completed round (a kill can leave a torn last
  line; readers skip it);
- ``run.log``        the human-readable log;
- ``adapter/``, ``checkpoint/``, ``private/`` (the noise key), ``release/`` (the bundle).

JSON values are made plain by :func:`jsonable`; file checksums are
:func:`fl.io.file_sha256`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from fl.errors import UsageError
from fl.io import atomic_write_text, read_json

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST",
    "CONFIG",
    "SPLITS",
    "LEDGER",
    "METRICS",
    "RUN_LOG",
    "ADAPTER",
    "ADAPTER_WEIGHTS",
    "CHECKPOINT",
    "PRIVATE",
    "RELEASE",
    "jsonable",
    "read_manifest",
    "is_release",
    "read_config",
    "read_splits",
    "read_metrics",
    "append_metrics",
    "truncate_metrics",
    "StartUndo",
]

#: version of the manifest's schema (``manifest.json`` ``"schema_version"``)
SCHEMA_VERSION = 1

MANIFEST = "manifest.json"
CONFIG = "config.json"
SPLITS = "splits.json"
LEDGER = "ledger.json"
METRICS = "metrics.jsonl"
RUN_LOG = "run.log"
ADAPTER = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CHECKPOINT = "checkpoint"
PRIVATE = "private"
RELEASE = "release"


def jsonable(obj):
    """``obj`` as plain JSON data: dict keys → str, tuples → lists, tensors → lists,
    numpy scalars → Python numbers, NaN → None and ±Inf → "inf" / "-inf"."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating | float):
        f = float(obj)
        return f if math.isfinite(f) else (None if math.isnan(f) else ("inf" if f > 0 else "-inf"))
    return obj


# --------------------------------------------------------------------------- manifest


def read_manifest(run: str | Path, *, check_schema: bool = False) -> dict:
    """``RUN/manifest.json`` as a dict (a run directory or a release bundle).

    UsageError if ``run`` is not a folder, has no manifest, the manifest is not a JSON
    object, or (``check_schema``) its ``schema_version`` is not :data:`SCHEMA_VERSION`."""
    run = Path(run)
    if not run.is_dir():
        raise UsageError(f"run directory not found: {run}")
    path = run / MANIFEST
    if not path.is_file():
        raise UsageError(f"{run} has no {MANIFEST} (not a finished run directory)")
    m = read_json(path)
    if not isinstance(m, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    if check_schema:
        ver = m.get("schema_version")
        if ver != SCHEMA_VERSION:
            raise UsageError(
                f"{path}: unsupported schema_version {ver!r} (expected {SCHEMA_VERSION})"
            )
    return m


def is_release(path_or_manifest: str | Path | dict) -> bool:
    """Whether a folder (or an already read manifest) is a release bundle: its manifest
    is the public one."""
    m = path_or_manifest
    if not isinstance(m, dict):
        p = Path(m) / MANIFEST
        if not p.is_file():
            return False
        try:
            m = read_json(p)
        except UsageError:
            return False
    return isinstance(m, dict) and m.get("visibility") == "public"


# --------------------------------------------------------------------------- config, splits


def _read_object(path: Path) -> dict:
    d = read_json(path)
    if not isinstance(d, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    return d


def read_config(run: str | Path) -> dict | None:
    """``RUN/config.json`` (None if the run has none)."""
    path = Path(run) / CONFIG
    return _read_object(path) if path.is_file() else None


def read_splits(run: str | Path) -> dict | None:
    """``RUN/splits.json`` (None if the run has none, e.g. a release bundle)."""
    path = Path(run) / SPLITS
    return _read_object(path) if path.is_file() else None


# --------------------------------------------------------------------------- metrics


def _metrics_rows(path: Path, strict: bool) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if strict:
                raise UsageError(f"{path}: line {i} is not valid JSON") from None
            continue  # a torn last line from a kill
        if not isinstance(row, dict):
            if strict:
                raise UsageError(f"{path}: line {i} is not a JSON object")
            continue
        rows.append(row)
    return rows


def read_metrics(run: str | Path, *, strict: bool = False) -> list[dict] | None:
    """Rows of ``RUN/metrics.jsonl`` (None if the file is missing).

    Lines that are not JSON objects (a torn last line from a kill) are skipped, or with
    ``strict`` raise UsageError naming the line."""
    path = Path(run) / METRICS
    if not path.is_file():
        return None
    return _metrics_rows(path, strict)


def append_metrics(run: str | Path, row: dict) -> None:
    """Append one round's row to ``RUN/metrics.jsonl`` (made :func:`jsonable`; fsynced)."""
    with open(Path(run) / METRICS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(jsonable(row)) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def truncate_metrics(run: str | Path, completed: int) -> list[dict]:
    """Keep the rows of rounds ``<= completed`` (rewritten atomically; a torn line is
    dropped); returns them."""
    path = Path(run) / METRICS
    rows = [
        r
        for r in (_metrics_rows(path, strict=False) if path.exists() else [])
        if r.get("round", 1e9) <= completed
    ]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


# --------------------------------------------------------------------------- a failed start


class StartUndo:
    """What a fresh start found at its run directory, so that a start that fails before
    its first round leaves the directory as it found it: absent (with any parent folder
    the start created), or holding exactly the entries it held (a fresh start accepts
    only an empty folder, hidden entries and a ``private/`` folder). Entries that were
    there are never touched; everything the start added is removed."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        # the topmost folder this start will create (out itself or a missing parent)
        self.created_root: Path | None = None
        p = self.out.absolute()
        while not os.path.lexists(p):
            self.created_root = p
            if p.parent == p:
                break
            p = p.parent
        self.before: set[str] = set()
        if self.created_root is None and self.out.is_dir():
            for root, dirs, files in os.walk(self.out):
                rel = Path(root).relative_to(self.out)
                self.before.update(str(rel / n) for n in dirs + files)

    def rollback(self) -> None:
        """Remove what the start added (best effort: a failure here must not hide the
        error that made the start fail)."""
        if self.created_root is not None:
            shutil.rmtree(self.out, ignore_errors=True)
            p = self.out.absolute().parent
            root = self.created_root
            while p == root or root in p.parents:
                try:
                    p.rmdir()  # only if empty: never removes anything else
                except OSError:
                    break
                p = p.parent
            return
        if not self.out.is_dir():
            return
        for root, dirs, files in os.walk(self.out, topdown=True):
            rel = Path(root).relative_to(self.out)
            for n in files:
                if str(rel / n) not in self.before:
                    try:
                        (Path(root) / n).unlink()
                    except OSError:
                        pass
            keep = []
            for n in dirs:
                path = Path(root) / n
                if str(rel / n) in self.before:
                    keep.append(n)
                elif path.is_symlink():
                    path.unlink(missing_ok=True)
                else:
                    shutil.rmtree(path, ignore_errors=True)
            dirs[:] = keep
