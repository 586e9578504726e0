"""Canary sets for trainings the toolkit did not run (``fedlora canaries new``): making,
writing, loading and verifying them. The canaries themselves are drawn from the set's key by
:mod:`audit.canaries.draw`. The audit of such a training's observations is
:mod:`audit.canaries.outside`; the hooks that place the canaries are :mod:`audit.canaries.hooks`.

A canary set is a folder:

- ``canaries.json`` (PUBLIC): the kind, the count M, the key's public id, and what the
  training side needs to place the canaries: for ``gradient`` the clip norm C, the factor
  K (:data:`fl.privacy.gradient_canaries.PRE_CLIP`), the trainable parameters (name,
  shape, group) and each canary's coordinate; for ``input`` the (text, label) records; for
  ``client`` the clip C, the dimension d of the flattened update the server clips, the
  participation (every round or Poisson at a rate) and ``directions.npz``.
- ``directions.npz`` (PUBLIC, ``client`` only): the canaries' unit directions.
- ``private/`` (0700; OPERATOR ONLY): ``inclusion.json`` (0600, the secret bits b_j ~
  Bernoulli(½)) and, unless ``--key FILE`` named an existing key, ``noise.key`` (0600).

The canaries themselves may be published (the one-run theorem needs only the inclusion
bits to be secret and independent of everything else); the bits may not, until the audit.
The training side has to know the bits (it adds the included canaries), so the hooks run
on the operator's side and read ``private/``; the Poisson coins of gradient canaries and
of Poisson-sampled canary clients are drawn by the hooks from the key's streams, one coin
per canary per step (round), included or not.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from audit.canaries.draw import (
    check_params,
    client_canaries,
    gradient_coordinates,
    mislabelled,
    numel,
    random_texts,
    read_params,
)
from fl.errors import UsageError

FORMAT = "fedlora-canaries/1"
PUBLIC_FILE = "canaries.json"
DIRECTIONS_FILE = "directions.npz"
PRIVATE_DIR = "private"
BITS_FILE = "inclusion.json"
KINDS = ("gradient", "input", "client")
#: stream names under the set's key (the draws' streams are in :mod:`audit.canaries.draw`;
#: canary clients use the engine's ``("canary-clients",)`` and ``("canary-client-coins", r)``)
BITS_STREAM = ("outside-canaries", "included")
COIN_STREAM = "outside-gradient-coins"
MAX_COUNT = 10_000_000
#: isotropic client canaries store M × d float32 directions
MAX_ISOTROPIC = 50_000_000
PARTICIPATION = ("every_round", "poisson")


# --------------------------------------------------------------------------- inputs


def _count(m) -> int:
    if isinstance(m, bool) or not isinstance(m, int | np.integer):
        raise UsageError(f"--count must be an integer, got {m!r}")
    if not 1 <= m <= MAX_COUNT:
        raise UsageError(f"--count must be in [1, {MAX_COUNT}], got {m}")
    return int(m)


def _clip(c) -> float:
    if c is None:
        raise UsageError("--clip is required (the clipping norm C of the training)")
    c = float(c)
    if not (math.isfinite(c) and c > 0):
        raise UsageError(f"--clip must be finite and > 0, got {c}")
    return c


# --------------------------------------------------------------------------- the set


def _key(key_file):
    from fl.privacy import rng as R

    return (R.NoiseKey.read(key_file), False) if key_file else (R.NoiseKey.generate(), True)


def _bits(key, m: int) -> np.ndarray:
    from fl.privacy import rng as R

    return R.bernoulli_mask(key.stream(*BITS_STREAM), m, 0.5).numpy().astype(bool)


def _npz_bytes(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _out_dir(out) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder; refusing to overwrite")
    return out


def new_canary_set(
    kind: str,
    count: int,
    out,
    *,
    key_file=None,
    params=None,
    clip: float | None = None,
    num_classes: int | None = None,
    words: int = 12,
    source=None,
    dim: int | None = None,
    participation: str = "every_round",
    rate: float | None = None,
) -> Path:
    """Make a canary set in the new folder ``out`` (module doc) and return it. Every input
    is checked before anything is written (a UsageError names the bad one); the folder is
    built beside ``out`` and renamed into place, so a failure leaves nothing."""
    if kind not in KINDS:
        raise UsageError(f"--kind must be one of {KINDS}, got {kind!r}")
    m = _count(count)
    out = _out_dir(out)
    doc: dict = {"format": FORMAT, "kind": kind, "count": m}
    extra_files: dict[str, bytes] = {}
    if kind == "gradient":
        if params is None:
            raise UsageError(
                "--kind gradient needs --params FILE (the trainable parameters: "
                "audit.canaries.hooks.write_params(model, FILE))"
            )
        plist = read_params(params) if not isinstance(params, list) else check_params(params)
        c = _clip(clip)
        key, fresh = _key(key_file)
        from fl.privacy.gradient_canaries import PRE_CLIP

        coords = gradient_coordinates(key, m, plist)
        doc["gradient"] = {
            "clip": c,
            "pre_clip": PRE_CLIP,
            "coin_stream": COIN_STREAM,
            "params": plist,
            "coordinates": coords,
            "note": "canary j enters a step it is sampled in (Poisson coin at the training's "
            "sampling rate, included canaries only) as one more per-sample gradient "
            "pre_clip·C·e_j at its coordinate, before the training's clip",
        }
        bits = _bits(key, m)
    elif kind == "input":
        if num_classes is None or isinstance(num_classes, bool) or num_classes < 2:
            raise UsageError(f"--num-classes must be an integer >= 2, got {num_classes}")
        if source is None and not 1 <= int(words) <= 256:
            raise UsageError(f"--words must be in [1, 256], got {words}")
        key, fresh = _key(key_file)
        if source is None:
            recs, how = random_texts(key, m, int(num_classes), int(words)), "random_text"
        else:
            recs, how = mislabelled(key, m, int(num_classes), source), "mislabel"
        doc["input"] = {
            "how": how,
            "num_classes": int(num_classes),
            "records": recs,
            "note": "add record j to the training data when it is included (one more "
            "record; never replacing one); score each canary by its loss under the "
            "trained model",
        }
        bits = _bits(key, m)
    else:
        c = _clip(clip)
        if dim is None and params is not None:
            plist = read_params(params) if not isinstance(params, list) else check_params(params)
            dim = sum(numel(p["shape"]) for p in plist)
        if dim is None or isinstance(dim, bool) or not 1 <= int(dim) <= 10**10:
            raise UsageError(f"--dim must be an integer >= 1 (or give --params), got {dim}")
        dim = int(dim)
        if participation not in PARTICIPATION:
            raise UsageError(f"--participation must be one of {PARTICIPATION}")
        if participation == "poisson":
            if rate is None or not (math.isfinite(rate) and 0 < rate <= 1):
                raise UsageError(f"--rate must be in (0, 1] for Poisson participation, got {rate}")
        elif rate is not None:
            raise UsageError("--rate belongs to --participation poisson")
        if m > dim and m * dim > MAX_ISOTROPIC:
            raise UsageError(
                f"--count {m} canary clients over --dim {dim}: more canaries than coordinates "
                f"need stored isotropic directions (M·d > {MAX_ISOTROPIC}); lower --count"
            )
        key, fresh = _key(key_file)
        _, bits, dirs = client_canaries(key, m, c, dim, participation, float(rate or 1.0))
        extra_files[DIRECTIONS_FILE] = _npz_bytes(dirs)
        doc["client"] = {
            "clip": c,
            "dim": dim,
            "participation": participation,
            "rate": float(rate) if participation == "poisson" else 1.0,
            "directions": str(dirs["mode"]),
            "directions_file": DIRECTIONS_FILE,
            "directions_sha256": hashlib.sha256(extra_files[DIRECTIONS_FILE]).hexdigest(),
            "note": "canary j's update is C times its unit direction (directions.npz: "
            "disjoint supports 'support'/'signs' or isotropic 'dirs'); an included canary "
            "that takes part in a round adds it to the clipped sum before the server's noise",
        }
    doc["key_id"] = key.key_id
    doc["private"] = f"{PRIVATE_DIR}/{BITS_FILE} holds the inclusion bits (operator only)" + (
        f"; {PRIVATE_DIR}/noise.key the key" if fresh else "; the key is the --key file"
    )
    public = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    sha = set_sha256(public.encode(), extra_files.get(DIRECTIONS_FILE))
    private = json.dumps(
        {"key_id": key.key_id, "set_sha256": sha, "included": [int(b) for b in bits]}
    )
    _write_set(out, public, extra_files, private, key if fresh else None)
    return out


def set_sha256(public: bytes, directions: bytes | None = None) -> str:
    """The set's fingerprint: sha256 of ``canaries.json`` (and ``directions.npz``)."""
    h = hashlib.sha256(public)
    if directions is not None:
        h.update(hashlib.sha256(directions).digest())
    return h.hexdigest()


def _write_set(out: Path, public: str, extra: dict, private: str, key) -> None:
    from fl.io import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)
        (tmp / PUBLIC_FILE).write_text(public, encoding="utf-8")
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
        priv = tmp / PRIVATE_DIR
        priv.mkdir(mode=0o700)
        os.chmod(priv, 0o700)
        atomic_write_text(priv / BITS_FILE, private + "\n")  # mkstemp: 0600
        if key is not None:
            key.write(tmp)
        os.replace(tmp, out)  # onto an absent or empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class CanarySet:
    """A loaded canary set: the public document, the bits (when ``private/`` was read)
    and, for client canaries, the directions."""

    folder: Path
    doc: dict
    sha256: str
    included: np.ndarray | None
    directions: dict = field(default_factory=dict)
    key: object = None

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def count(self) -> int:
        return int(self.doc["count"])

    @property
    def spec(self) -> dict:
        return self.doc[self.kind]


def load_canary_set(folder, *, private: bool = True, key_file=None, verify: bool = True):
    """Read a canary set. ``private``: also its inclusion bits (operator only). The key
    (``key_file``, else ``private/noise.key`` when present) is loaded, and with ``verify``
    the bits (and the coordinates or directions) are re-derived from it and compared:
    a set whose files do not derive from its key is refused."""
    from fl.privacy import rng as R

    d = Path(folder)
    pub = d / PUBLIC_FILE
    if not pub.is_file():
        raise UsageError(f"--canaries {d}: no {PUBLIC_FILE} (make one with `fedlora canaries new`)")
    raw = pub.read_bytes()
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"{pub}: invalid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("kind") not in KINDS:
        raise UsageError(f"{pub}: not a canary set ({FORMAT})")
    m = doc.get("count")
    if not isinstance(m, int) or m < 1 or not isinstance(doc.get(doc["kind"]), dict):
        raise UsageError(f"{pub}: malformed canary set")
    dirs_raw, dirs = None, {}
    if doc["kind"] == "client":
        dp = d / DIRECTIONS_FILE
        if not dp.is_file():
            raise UsageError(f"--canaries {d}: {DIRECTIONS_FILE} is missing")
        dirs_raw = dp.read_bytes()
        if hashlib.sha256(dirs_raw).hexdigest() != doc["client"].get("directions_sha256"):
            raise UsageError(f"{dp}: does not match the sha256 recorded in {PUBLIC_FILE}")
        with np.load(io.BytesIO(dirs_raw), allow_pickle=False) as z:
            dirs = {k: z[k] for k in z.files}
        dirs["mode"] = str(dirs["mode"])
    sha = set_sha256(raw, dirs_raw)
    key = None
    kp = Path(key_file) if key_file else d / PRIVATE_DIR / R.KEY_FILE
    if key_file or kp.is_file():
        key = R.NoiseKey.read(kp)
        if key.key_id != doc.get("key_id"):
            raise UsageError(f"{kp}: not the key of the canary set {d} (key ids differ)")
    included = None
    if private:
        bp = d / PRIVATE_DIR / BITS_FILE
        if not bp.is_file():
            raise UsageError(
                f"--canaries {d}: {PRIVATE_DIR}/{BITS_FILE} is missing (operator only)"
            )
        try:
            bdoc = json.loads(bp.read_text(encoding="utf-8"))
            included = np.asarray(bdoc["included"], dtype=np.int64)
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{bp}: malformed inclusion file") from None
        if bdoc.get("set_sha256") != sha:
            raise UsageError(f"{bp}: belongs to another canary set (set_sha256 differs)")
        if included.shape != (m,) or not np.isin(included, (0, 1)).all():
            raise UsageError(f"{bp}: expected {m} inclusion bits of 0/1")
        included = included.astype(bool)
    cs = CanarySet(d, doc, sha, included, dirs, key)
    _check_spec(cs, pub)
    if verify and key is not None:
        _verify(cs)
    return cs


def _check_spec(cs: CanarySet, where) -> None:
    """The kind's fields are there and agree with the count (a hand-edited file)."""
    m, sp = cs.count, cs.spec
    try:
        if cs.kind == "gradient":
            sizes = {p["name"]: numel(p["shape"]) for p in check_params(sp["params"], str(where))}
            co = sp["coordinates"]
            ok = len(co) == m and all(0 <= int(c["index"]) < sizes[c["param"]] for c in co)
            ok = ok and len({(c["param"], int(c["index"])) for c in co}) == m
            ok = ok and math.isfinite(float(sp["clip"])) and float(sp["clip"]) > 0
        elif cs.kind == "input":
            recs = sp["records"]
            ok = len(recs) == m and all(
                isinstance(r["text"], str) and 0 <= int(r["label"]) < int(sp["num_classes"])
                for r in recs
            )
        else:
            d = int(sp["dim"])
            dr = cs.directions
            if dr.get("mode") == "disjoint":
                ok = dr["support"].shape[0] == m and dr["signs"].shape == dr["support"].shape
                ok = ok and (
                    dr["support"].size == 0 or 0 <= dr["support"].min() <= dr["support"].max() < d
                )
            else:
                ok = dr.get("mode") == "isotropic" and dr["dirs"].shape == (m, d)
            ok = ok and sp["participation"] in PARTICIPATION and 0 < float(sp["rate"]) <= 1
            ok = ok and math.isfinite(float(sp["clip"])) and float(sp["clip"]) > 0
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise UsageError(f"{where}: malformed {cs.kind} canary set")


def _verify(cs: CanarySet) -> None:
    """Re-derive the set from its key; refuse files that were changed."""
    key, m, where = cs.key, cs.count, cs.folder
    if cs.kind == "client":
        sp = cs.spec
        _, bits, dirs = client_canaries(
            key, m, float(sp["clip"]), int(sp["dim"]), sp["participation"], float(sp["rate"])
        )
        same = all(
            np.array_equal(dirs[k], cs.directions.get(k)) for k in dirs if k != "mode"
        ) and str(dirs["mode"]) == cs.directions.get("mode")
        if not same:
            raise UsageError(f"{where}: the directions do not derive from the set's key")
    else:
        bits = _bits(key, m)
        if cs.kind == "gradient":
            coords = gradient_coordinates(key, m, cs.spec["params"])
            if coords != cs.spec["coordinates"]:
                raise UsageError(f"{where}: the coordinates do not derive from the set's key")
        elif cs.spec.get("how") == "random_text":
            recs = random_texts(
                key, m, int(cs.spec["num_classes"]), len(cs.spec["records"][0]["text"].split())
            )
            if recs != cs.spec["records"]:
                raise UsageError(f"{where}: the canary texts do not derive from the set's key")
    if cs.included is not None and not np.array_equal(bits, cs.included):
        raise UsageError(
            f"{where}/{PRIVATE_DIR}/{BITS_FILE}: the inclusion bits do not derive from the "
            "set's key"
        )


# --------------------------------------------------------------------------- observations


__all__ = [
    "CanarySet",
    "COIN_STREAM",
    "KINDS",
    "load_canary_set",
    "new_canary_set",
]
