"""Safe file I/O: atomic writes, checksums, JSON with clear errors, a run-directory lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

from fl.errors import UsageError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, rename: readers see the old or
    the new file, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def read_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{p}: not UTF-8 text") from None
    if not text.strip():
        raise UsageError(f"{p}: file is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{p}: invalid JSON at line {exc.lineno} ({exc.msg})") from None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class RunLock:
    """Exclusive lock on a run directory (``.lock``); a second process refuses."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self.fh = None

    def __enter__(self):
        self.fh = open(self.path, "a+")
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.fh.close()
            raise UsageError(
                f"{self.path.parent} is in use by another fedlora process (lock held); refusing"
            ) from None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
        self.fh.close()
        return False
