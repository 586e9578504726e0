"""Seal a manifest to its run: file hashes and an HMAC under a key derived from the run key.

A run's manifest (operator or public) carries an ``integrity`` block:

    "integrity": {
      "files": {"adapter/adapter_config.json": sha256, "adapter/adapter_model.safetensors":
                sha256, "metrics.jsonl": sha256, ...},   # every file the manifest vouches for
      "mac": {"algorithm": "HMAC-SHA256", "key": MAC_KEY_TEXT, "value": hex}
    }

The MAC covers the canonical JSON of the whole manifest (the file hashes included) with
only ``integrity.mac.value`` left out. Its key is drawn from the run's secret noise key
(:data:`MAC_STREAM`, a keyed stream of :mod:`fl.privacy.rng`: nothing of the noise key
can be learnt from it), so only whoever holds the run key can make or check it:

- without the key, the file hashes catch an edit of one released file (adapter weights,
  ``adapter_config.json``, ``metrics.jsonl``); an edit of the manifest itself cannot be
  caught, and the audit lists the manifest's fields as taken on trust;
- with the key (``fedlora audit --key``), any edit of any field of the manifest (the
  ``device`` that would choose a replay tolerance, the config, σ, the ledger, the
  metrics, the file hashes) fails the MAC.

Runs without DP and ``--insecure-deterministic-noise`` runs have no secret key: their
manifests carry the file hashes and ``"mac": null``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from fl.io import file_sha256

__all__ = [
    "MAC_STREAM",
    "MAC_KEY_TEXT",
    "canonical_bytes",
    "file_hashes",
    "seal",
    "verify_mac",
    "check_files",
]

#: the keyed stream the MAC key is drawn from (``NoiseKey.stream(*MAC_STREAM)``)
MAC_STREAM = ("integrity", "manifest-mac", "v1")
MAC_KEY_TEXT = (
    "32 bytes of the run key's stream " + "/".join(MAC_STREAM) + " (operator only; checked by "
    "`fedlora audit --key`)"
)


def _mac_key(key) -> bytes:
    return key.stream(*MAC_STREAM).raw_bytes(32)


def canonical_bytes(manifest: dict) -> bytes:
    """The bytes the MAC covers: the manifest as JSON with sorted keys and no spaces,
    ``integrity.mac.value`` removed. Read back from disk or built in memory, the same
    manifest gives the same bytes (the writer stores plain JSON data)."""
    doc = json.loads(json.dumps(manifest, allow_nan=True))
    mac = (doc.get("integrity") or {}).get("mac")
    if isinstance(mac, dict):
        mac.pop("value", None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def file_hashes(root: str | Path, names) -> dict[str, str]:
    """``{name: sha256}`` of the files ``root/name`` (names relative, with ``/``)."""
    root = Path(root)
    return {n: file_sha256(root / n) for n in names}


def seal(manifest: dict, key, files: dict[str, str]) -> dict:
    """Add the ``integrity`` block to ``manifest`` (in place; returned): ``files`` as
    given, and the MAC under ``key`` (a :class:`fl.privacy.rng.NoiseKey`; None: no MAC)."""
    manifest.pop("integrity", None)
    manifest["integrity"] = {"files": dict(files), "mac": None}
    if key is not None:
        manifest["integrity"]["mac"] = {"algorithm": "HMAC-SHA256", "key": MAC_KEY_TEXT}
        value = hmac.new(_mac_key(key), canonical_bytes(manifest), hashlib.sha256).hexdigest()
        manifest["integrity"]["mac"]["value"] = value
    return manifest


def verify_mac(manifest: dict, key) -> tuple[bool | None, str]:
    """Check the manifest's MAC with the run key. Returns (True, "") when it verifies,
    (False, why) when it does not, (None, why) when the manifest carries no MAC."""
    integ = manifest.get("integrity")
    if not isinstance(integ, dict):
        return None, "the manifest has no integrity block (written before manifests were sealed)"
    mac = integ.get("mac")
    if mac is None:
        return None, "the manifest's integrity.mac is null (a run without a secret key)"
    if not isinstance(mac, dict) or not isinstance(mac.get("value"), str):
        return False, "integrity.mac is malformed"
    if mac.get("algorithm") != "HMAC-SHA256":
        return False, f"integrity.mac.algorithm is {mac.get('algorithm')!r}, not HMAC-SHA256"
    want = hmac.new(_mac_key(key), canonical_bytes(manifest), hashlib.sha256).hexdigest()
    if hmac.compare_digest(want, mac["value"]):
        return True, ""
    return False, "the MAC does not match the manifest's content under this key"


def check_files(root: str | Path, manifest: dict) -> list[tuple[str, str]]:
    """Files the manifest's ``integrity.files`` vouches for that are missing or differ:
    ``[(name, what)]`` (empty: all match, or nothing is listed)."""
    integ = manifest.get("integrity")
    files = integ.get("files") if isinstance(integ, dict) else None
    if not isinstance(files, dict):
        return []
    root = Path(root).resolve()
    bad = []
    for name, want in sorted(files.items()):
        p = (root / str(name)).resolve()
        if root not in p.parents:
            bad.append((str(name), "names a path outside the run folder"))
        elif not p.is_file():
            bad.append((str(name), "is missing"))
        elif file_sha256(p) != want:
            bad.append((str(name), f"has sha256 {file_sha256(p)[:16]}…, sealed {str(want)[:16]}…"))
    return bad
