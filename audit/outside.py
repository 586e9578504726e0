"""Canary audits of trainings the toolkit did not run (``fedlora canaries new``,
``fedlora audit --canaries DIR --observations FILE --claim CLAIM``).

The operator of an outside training (an Opacus or plain PyTorch DP-SGD loop, a Flower
strategy with client-level DP) makes a canary set here, adds the canaries to the training
with the hooks of :mod:`audit.hooks`, which write an observation file, and audits that file
against the claim the training makes. The canaries, the inclusion bits, the Poisson coins
and the directions are those of the toolkit's own engine (docs/audit.md: "Gradient
canaries", "Canary clients", the input canaries of the one-run audit), drawn from a secret
key; the scores and bounds are the ones the run audit uses.

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

Neighbouring relations of the audit (the claim is add/remove, :mod:`audit.claims`):

- gradient canary: one record whose clipped gradient is C·e_j (sample level): ε, δ;
- input canary: one record; at sample level ε, δ; at client level it changes one client's
  data (replace-one-client): 2ε, (1 + e^ε)δ by group privacy, as the run audit;
- canary client: one client under add/remove (client level): ε, δ.

The claim test takes the larger of Steinke et al.'s bound and the f-DP one (family (ε, δ),
valid for any mechanism), each at α/2, so it holds at 1 − α (the run audit's
``_claim_check``).
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

from fl.errors import UsageError

FORMAT = "fedlora-canaries/1"
OBS_FORMAT = "fedlora-canary-observations/1"
PUBLIC_FILE = "canaries.json"
DIRECTIONS_FILE = "directions.npz"
PRIVATE_DIR = "private"
BITS_FILE = "inclusion.json"
KINDS = ("gradient", "input", "client")
#: stream names under the set's key (the engine's own streams where the engine's helpers
#: draw: canary clients use ``("canary-clients",)`` and ``("canary-client-coins", r)``)
BITS_STREAM = ("outside-canaries", "included")
COORD_STREAM = ("outside-canaries", "coordinates")
TEXT_STREAM = ("outside-canaries", "texts")
COIN_STREAM = "outside-gradient-coins"
#: parameter groups gradient canaries are stratified over (the engine's A / B / head)
GROUPS = ("lora_A", "lora_B", "other")
_ENGINE_GROUP = {"lora_A": "A", "lora_B": "B"}
MAX_COUNT = 10_000_000
#: isotropic client canaries store M × d float32 directions
MAX_ISOTROPIC = 50_000_000
PARTICIPATION = ("every_round", "poisson")


def group_of_name(name: str) -> str:
    """The group of a trainable parameter (by PEFT's names): ``lora_A``, ``lora_B`` or
    ``other`` (the head, ``modules_to_save``, anything else)."""
    parts = name.split(".")
    for g in ("lora_A", "lora_B"):
        if g in parts:
            return g
    return "other"


def clean_name(name: str) -> str:
    """A parameter name without Opacus's ``GradSampleModule`` prefix (``_module.``)."""
    while name.startswith("_module."):
        name = name[len("_module.") :]
    return name


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


def read_params(path) -> list[dict]:
    """A parameter list (``hooks.describe`` writes it): JSON ``{"params": [{"name",
    "shape", "group"?}]}`` or a bare list; each shape a list of positive integers, names
    unique; a missing group is taken from the name (:func:`group_of_name`)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--params: cannot read {p}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"--params: {p} is not JSON ({exc})") from None
    return check_params(doc.get("params") if isinstance(doc, dict) else doc, str(p))


def check_params(items, where: str = "params") -> list[dict]:
    if not isinstance(items, list) or not items:
        raise UsageError(f"{where}: expected a non-empty list of parameters")
    out, seen = [], set()
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not isinstance(it.get("name"), str) or not it["name"]:
            raise UsageError(f"{where}: parameter {i} has no name")
        name = it["name"]
        if name in seen:
            raise UsageError(f"{where}: parameter {name!r} listed twice")
        seen.add(name)
        shape = it.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape
        ):
            raise UsageError(f"{where}: parameter {name!r}: shape must be positive integers")
        group = it.get("group", group_of_name(name))
        if group not in GROUPS:
            raise UsageError(f"{where}: parameter {name!r}: group must be one of {GROUPS}")
        out.append({"name": name, "shape": [int(s) for s in shape], "group": group})
    return out


def _numel(shape) -> int:
    return int(math.prod(shape))


# --------------------------------------------------------------------------- the set


def _key(key_file):
    from fl.privacy import rng as R

    return (R.NoiseKey.read(key_file), False) if key_file else (R.NoiseKey.generate(), True)


def _bits(key, m: int) -> np.ndarray:
    from fl.privacy import rng as R

    return R.bernoulli_mask(key.stream(*BITS_STREAM), m, 0.5).numpy().astype(bool)


def gradient_coordinates(key, m: int, params: list[dict]) -> list[dict]:
    """M distinct coordinates of ``params``, stratified over the groups lora_A, lora_B,
    other exactly as the engine stratifies over A, B and the head
    (:func:`fl.privacy.gradient_canaries.choose_coordinates`), from the key's stream
    :data:`COORD_STREAM`: ``[{"param", "index"}]`` in canary order."""
    from fl.privacy.gradient_canaries import choose_coordinates

    total = sum(_numel(p["shape"]) for p in params)
    if m > total:
        raise UsageError(
            f"--count {m} gradient canaries need {m} distinct coordinates, but the parameters "
            f"listed have {total}"
        )
    # the engine's naming: factors/<x>/A, factors/<x>/B, head/<x>
    lora, head, back = [], [], {}
    for i, p in enumerate(params):
        eng = _ENGINE_GROUP.get(p["group"])
        key_name = f"factors/{i}/{eng}" if eng else f"head/{i}"
        (lora if eng else head).append((key_name, _numel(p["shape"])))
        back[key_name] = p["name"]
    coords = choose_coordinates(key.stream(*COORD_STREAM), m, lora, head)
    return [{"param": back[c.param], "index": int(c.index)} for c in coords]


def random_texts(key, m: int, num_classes: int, words: int) -> list[dict]:
    """Random-text input canaries (the engine's ``random_text``): ``words`` tokens
    ``zq1000``–``zq9999`` and a uniform label, from the key's stream :data:`TEXT_STREAM`."""
    from fl.privacy import rng as R

    src = key.stream(*TEXT_STREAM)
    w = R.integers(src, 9000, words * m).reshape(m, words) + 1000
    labels = R.integers(src, num_classes, m)
    return [{"text": " ".join(f"zq{x}" for x in w[j]), "label": int(labels[j])} for j in range(m)]


def mislabelled(key, m: int, num_classes: int, source) -> list[dict]:
    """Mislabel input canaries (the engine's ``mislabel``): M records drawn without
    replacement from ``source`` (JSONL of ``{"text", "label"}``, records the training
    does not otherwise use), each with its label moved to a uniformly chosen other class."""
    from fl.privacy import rng as R

    p = Path(source)
    try:
        lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        raise UsageError(f"--source: cannot read {p}: {exc.strerror or exc}") from None
    recs = []
    for i, ln in enumerate(lines):
        try:
            r = json.loads(ln)
        except ValueError:
            raise UsageError(f"--source: {p} line {i + 1} is not JSON") from None
        ok = isinstance(r, dict) and isinstance(r.get("text"), str)
        lab = r.get("label") if ok else None
        if not ok or isinstance(lab, bool) or not isinstance(lab, int):
            raise UsageError(f"--source: {p} line {i + 1} needs a text and an integer label")
        if not 0 <= lab < num_classes:
            raise UsageError(f"--source: {p} line {i + 1}: label {lab} outside [0, {num_classes})")
        recs.append(r)
    if len(recs) < m:
        raise UsageError(f"--count {m} mislabel canaries need {m} records, {p} has {len(recs)}")
    src = key.stream(*TEXT_STREAM)
    chosen = R.random_subset(src, len(recs), m)
    chosen = chosen[np.argsort(R.integers(src, 1 << 30, m), kind="stable")]
    shift = R.integers(src, num_classes - 1, m)
    return [
        {
            "text": recs[i]["text"],
            "label": int((recs[i]["label"] + 1 + shift[j]) % num_classes),
        }
        for j, i in enumerate(chosen.tolist())
    ]


def client_canaries(key, m: int, clip: float, dim: int, participation: str, rate: float):
    """The engine's canary clients (:class:`fl.privacy.canary_clients.CanaryClients`, dense
    space) over a flattened update of ``dim`` coordinates: (object, bits, directions dict).
    Disjoint supports when M <= d (exactly orthogonal), isotropic directions otherwise."""
    from fl.privacy import rng as R
    from fl.privacy.canary_clients import CanaryClients

    cc = CanaryClients(
        m,
        clip,
        R.RunRandomness(key, seed=0),
        None,
        method="fedavg",
        scheme="poisson" if participation == "poisson" else "all",
        rate=rate,
        rounds=1,
        sigma=1.0,
        delta=1e-5,
    )
    ds = cc.dense(["update"], [(dim,)])
    if ds["mode"] == "disjoint":
        dirs = {
            "mode": np.asarray("disjoint"),
            "support": ds["perm"].numpy().astype(np.int64),
            "signs": ds["signs"].numpy().astype(np.float64),
        }
    else:
        dirs = {"mode": np.asarray("isotropic"), "dirs": ds["dirs"].numpy()}
    return cc, cc.included.astype(bool), dirs


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
                "audit.hooks.write_params(model, FILE))"
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
            dim = sum(_numel(p["shape"]) for p in plist)
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
            sizes = {p["name"]: _numel(p["shape"]) for p in check_params(sp["params"], str(where))}
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


def _scalar(obs: dict, key: str, where: str) -> float:
    if key not in obs or np.asarray(obs[key]).ndim != 0:
        raise UsageError(f"{where}: field {key!r} missing or not a number")
    try:
        v = float(obs[key])
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not a number") from None
    if not math.isfinite(v):
        raise UsageError(f"{where}: field {key!r} is not finite ({v})")
    return v


def _array(obs: dict, key: str, shape: tuple, where: str) -> np.ndarray:
    if key not in obs:
        raise UsageError(f"{where}: field {key!r} missing")
    try:
        a = np.asarray(obs[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not numeric") from None
    if a.ndim != len(shape) or any(s is not None and a.shape[i] != s for i, s in enumerate(shape)):
        want = "×".join("T" if s is None else str(s) for s in shape)
        raise UsageError(f"{where}: field {key!r} has shape {a.shape}, expected {want}")
    if not np.isfinite(a).all():
        raise UsageError(f"{where}: field {key!r} holds non-finite values")
    return a


def _same(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


# --------------------------------------------------------------------------- the audit


def _relation(kind: str, level: str, eps: float, delta: float) -> tuple[float, float, str]:
    """(ε allowed for one canary, δ to bound at, the relation in words)."""
    if kind == "input" and level == "client":
        return (
            2 * eps,
            (1 + math.exp(min(eps, 700.0))) * delta,
            "an input canary changes one client's data: replace-one-client, (2ε, (1 + e^ε)δ) "
            "by group privacy from the claim's add/remove-one-client",
        )
    if kind == "client":
        return eps, delta, "a canary client is one client added or removed: the claim's relation"
    return eps, delta, "a canary is one record added or removed: the claim's relation"


def _bounds(scores, included, delta: float, alpha: float) -> dict:
    """Steinke et al.'s and the f-DP one-run bounds, each at α/2 (jointly 1 − α)."""
    from audit.empirical import epsilon_one_run
    from audit.fdp import fdp_one_run_bound

    if not delta < 1:
        return {"epsilon_lb": 0.0, "bound": "none (δ >= 1)", "steinke": None, "fdp": None}
    st = epsilon_one_run(scores, included, delta, alpha=alpha / 2)
    fd = fdp_one_run_bound(scores, included, delta, alpha=alpha / 2, family="dp")
    st = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in st.items()}
    fd = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in fd.items()}
    s, f = float(st["epsilon_lb"]), float(fd["epsilon_lb"])
    return {
        "epsilon_lb": max(s, f),
        "bound": "f-DP" if f > s else "Steinke et al.",
        "epsilon_lb_steinke": s,
        "epsilon_lb_fdp": f,
        "steinke": {k: st[k] for k in ("m", "r", "v", "k_pos", "k_neg", "alpha", "delta")},
        "fdp": {k: fd[k] for k in ("m", "k_plus", "k_minus", "correct", "alpha", "delta")},
    }


def _check_level(kind: str, claim) -> None:
    if kind == "gradient" and claim.level != "sample":
        raise UsageError(
            f"gradient canaries audit sample-level DP-SGD, but the claim's level is {claim.level!r}"
        )
    if kind == "client" and claim.level != "client":
        raise UsageError(
            f"canary clients audit client-level DP, but the claim's level is {claim.level!r}"
        )


def _check_set(cs: CanarySet, obs: dict, where: str) -> None:
    if str(obs.get("kind", "")) != cs.kind:
        raise UsageError(
            f"{where}: observations of kind {str(obs.get('kind'))!r}, canary set of kind "
            f"{cs.kind!r}"
        )
    if str(obs.get("set_sha256", "")) != cs.sha256:
        raise UsageError(
            f"{where}: the observations belong to another canary set (set_sha256 "
            f"{str(obs.get('set_sha256'))[:12]}…, this set {cs.sha256[:12]}…)"
        )


def _check_sigma_clip(sigma: float, clip: float, claim, spec: dict, where: str) -> None:
    """The observed σ and C against the claim's and the canary set's (one line each)."""
    if not _same(sigma, claim.noise_multiplier):
        raise UsageError(
            f"{where}: noise multiplier σ = {sigma:g} observed, the claim says "
            f"noise_multiplier = {claim.noise_multiplier:g}"
        )
    if not _same(clip, float(spec["clip"])):
        raise UsageError(
            f"{where}: clip C = {clip:g} observed, the canary set's clip is {spec['clip']:g}"
        )
    if claim.clipping_norm is not None and not _same(clip, claim.clipping_norm):
        raise UsageError(
            f"{where}: clip C = {clip:g} observed, the claim says clipping_norm = "
            f"{claim.clipping_norm:g}"
        )


def _gradient_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list) -> tuple:
    from audit import gradient_canaries as GC
    from audit.claims import opacus_sample_rate

    m = cs.count
    x = _array(obs, "obs", (None, m), where)
    if x.shape[0] < 1:
        raise UsageError(f"{where}: no steps observed")
    sigma = _scalar(obs, "sigma", where)
    clip = _scalar(obs, "clip", where)
    q = _scalar(obs, "q", where)
    sp = cs.spec
    _check_sigma_clip(sigma, clip, claim, sp, where)
    if claim.sampling == "poisson":
        rates = [claim.record_rate] + [r for r in [opacus_sample_rate(claim)] if r is not None]
        if not any(_same(q, r) for r in rates):
            raise UsageError(
                f"{where}: sampling rate q = {q:g} observed, the claim's rate is "
                + " or ".join(f"{r:g}" for r in rates)
            )
    elif not _same(q, 1.0):
        raise UsageError(
            f"{where}: sampling rate q = {q:g} observed, but the claim's sampling is "
            f"{claim.sampling!r}: canaries must then take part in every step (q = 1)"
        )
    steps, claimed_steps = x.shape[0], claim.rounds * claim.steps_per_round
    if steps > claimed_steps:
        raise UsageError(
            f"{where}: {steps} DP-SGD steps observed, the claim accounts "
            f"{claimed_steps} (rounds × steps_per_round)"
        )
    if steps < claimed_steps:
        notes.append(
            f"{steps} of the claim's {claimed_steps} steps observed: the bound concerns "
            "the observed steps"
        )
    # the run audit's scorer: records name their group after the last "/" (group_of)
    group = {p["name"]: p["group"] for p in sp["params"]}
    records = [{"param": f"{c['param']}/{group[c['param']]}"} for c in sp["coordinates"]]
    ob = {"ids": np.arange(m), "obs": x, "sigma": claim.noise_multiplier, "clip": clip, "q": q}
    noise = GC.observed_noise(records, [ob])
    scores = GC.canary_scores(records, [ob], GC.DEFAULT_STATISTIC, noise)
    info = {
        "steps": steps,
        "sigma": sigma,
        "clip": clip,
        "q": q,
        "statistic": GC.DEFAULT_STATISTIC,
        "score": GC.STATISTICS[GC.DEFAULT_STATISTIC],
        "noise": {
            g: {
                "observed_over_claimed": r,
                "scored_at": "observed" if r < GC.NOISE_FLOOR else "claimed",
            }
            for g, r in noise.items()
        },
    }
    if "source" in obs:
        info["source"] = str(obs["source"])
    return scores, info


def _input_scores(cs: CanarySet, obs: dict, where: str) -> tuple:
    m = cs.count
    have = [k for k in ("score", "loss") if k in obs]
    if len(have) != 1:
        raise UsageError(f"{where}: give exactly one of the fields 'score' and 'loss' (per canary)")
    a = _array(obs, have[0], (m,), where)
    return (a if have[0] == "score" else -a), {
        "score": "the observation's score"
        if have[0] == "score"
        else "-loss under the trained model"
    }


def _client_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list) -> tuple:
    m = cs.count
    inner = _array(obs, "inner", (None, m), where)
    t = inner.shape[0]
    if t < 1:
        raise UsageError(f"{where}: no rounds observed")
    norms = _array(obs, "norms", (t,), where)
    final_inner = _array(obs, "final_inner", (m,), where)
    final_norm = _scalar(obs, "final_norm", where)
    sigma, clip = _scalar(obs, "sigma", where), _scalar(obs, "clip", where)
    per_round = _scalar(obs, "clients_per_round", where)
    sp = cs.spec
    _check_sigma_clip(sigma, clip, claim, sp, where)
    if int(per_round) != claim.clients_per_round:
        raise UsageError(
            f"{where}: {int(per_round)} clients per round (the server's denominator m) "
            f"observed, the claim says clients_per_round = {claim.clients_per_round}"
        )
    everyone = claim.sampling == "all" or claim.clients_per_round == claim.total_clients
    if sp["participation"] == "every_round" and not everyone:
        raise UsageError(
            f"canary clients take part in every round, but the claim samples "
            f"{claim.clients_per_round} of {claim.total_clients} clients ({claim.sampling!r})"
        )
    if sp["participation"] == "poisson":
        if claim.sampling != "poisson":
            raise UsageError(
                f"canary clients are Poisson-sampled at {sp['rate']:g}, but the claim's "
                f"sampling is {claim.sampling!r}"
            )
        q = claim.clients_per_round / claim.total_clients
        if not _same(float(sp["rate"]), q):
            raise UsageError(
                f"canary clients are Poisson-sampled at {sp['rate']:g}, the claim's rate is "
                f"clients_per_round / total_clients = {q:g}"
            )
    releases = claim.rounds * claim.steps_per_round
    if t > releases:
        raise UsageError(f"{where}: {t} rounds observed, the claim accounts {releases} releases")
    if t < releases:
        notes.append(f"{t} of the claim's {releases} releases observed")
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norms[:, None] > 0, inner / norms[:, None], 0.0)
    fin = final_inner / final_norm if final_norm > 0 else np.zeros(m)
    return {"all_iterates": cos.sum(axis=0), "final_model": fin}, {
        "rounds": t,
        "sigma": sigma,
        "clip": clip,
        "clients_per_round": int(per_round),
        "participation": sp["participation"],
        "rate": float(sp["rate"]),
        "directions": sp["directions"],
    }


def audit_outside(canaries, observations, claim, *, alpha: float = 0.05, key_file=None) -> dict:
    """Audit an outside training: its canary set (folder), observation file and claim
    (:class:`audit.claim_schema.Claim`, a dict, or a file). Returns the result document;
    ``verdict`` is ``"leaks more than claimed"`` when the certified bound exceeds what the
    claimed ε allows one canary, ``"claim understated"`` when the recomputed ε exceeds the
    claimed one (or the claim check has another error), else ``"ok"``.

    Raises:
        UsageError: bad input (one line): missing or malformed files, observations of
            another set, σ / C / q / rounds that disagree with the claim.
    """
    from audit.claim_schema import Claim, load_claim, validate_claim
    from audit.claims import check_claim

    if not (isinstance(alpha, int | float) and 0.0 < alpha < 1.0):
        raise UsageError(f"--alpha must be in (0, 1), got {alpha}")
    c = (
        claim
        if isinstance(claim, Claim)
        else (validate_claim(claim) if isinstance(claim, dict) else load_claim(claim))
    )
    cs = load_canary_set(canaries, key_file=key_file)
    obs = read_observations(observations)
    where = f"--observations {observations}"
    _check_set(cs, obs, where)
    _check_level(cs.kind, c)
    notes: list[str] = []
    checked = check_claim(c)
    y = cs.included
    estimate = None
    if cs.kind == "gradient":
        scores, info = _gradient_scores(cs, obs, c, where, notes)
    elif cs.kind == "input":
        scores, info = _input_scores(cs, obs, where)
    else:
        stats, info = _client_scores(cs, obs, c, where, notes)
        scores = stats["all_iterates"]  # the certified test's statistic, fixed in advance
        from audit.canary_clients import STATISTICS, gaussian_fit

        if min(int(y.sum()), int((~y).sum())) >= 2:
            estimate = {
                k: {"score": STATISTICS[k], **gaussian_fit(v, y, c.delta)} for k, v in stats.items()
            }
        info["statistic"] = "all_iterates"
        info["score"] = STATISTICS["all_iterates"]
    eps_c, eps_r = c.claimed_epsilon, float(checked["epsilon_pld"])
    allowed, d_used, relation = _relation(cs.kind, c.level, eps_c, c.delta)
    b = _bounds(scores, y, d_used, alpha)
    leaks = b["epsilon_lb"] > allowed
    allowed_r, d_r, _ = (
        _relation(cs.kind, c.level, eps_r, c.delta)
        if math.isfinite(eps_r)
        else (
            math.inf,
            c.delta,
            "",
        )
    )
    lb_r = b["epsilon_lb"] if d_r == d_used else _bounds(scores, y, d_r, alpha)["epsilon_lb"]
    exceeds_recomputed = lb_r > allowed_r
    claim_errors = [f for f in checked["findings"] if f.get("severity") == "error"]
    findings = list(checked["findings"])
    if leaks:
        findings.append(
            {
                "code": "empirical_exceeds_claim",
                "severity": "error",
                "message": f"The canary audit bounds ε >= {b['epsilon_lb']:.3g} (at δ = "
                f"{d_used:.3g}; {b['bound']}) with confidence {1 - alpha:g} from {cs.count} "
                f"{cs.kind} canaries, above the {allowed:.4g} that the claimed ε = {eps_c:g} "
                f"allows for one canary ({relation}): the training leaks more than claimed.",
            }
        )
    elif exceeds_recomputed:
        findings.append(
            {
                "code": "empirical_exceeds_mechanism",
                "severity": "warning",
                "message": f"The canary audit bounds ε >= {lb_r:.3g}, above the {allowed_r:.4g} "
                f"that the mechanism as described (ε = {eps_r:.4g}) allows, though within the "
                f"claimed ε = {eps_c:g}: what ran is not the mechanism the claim describes.",
            }
        )
    understated = bool(checked["understated"])
    verdict = (
        "leaks more than claimed"
        if leaks
        else ("claim understated" if understated or claim_errors else "ok")
    )
    res = {
        "kind": "outside_canaries",
        "canary_kind": cs.kind,
        "canaries": str(cs.folder),
        "observations_file": str(observations),
        "set_sha256": cs.sha256,
        "m": cs.count,
        "n_included": int(y.sum()),
        "alpha": alpha,
        "claim": {
            k: checked[k]
            for k in (
                "claimed_epsilon",
                "delta",
                "epsilon_pld",
                "epsilon_rdp",
                "understated",
                "neighbouring",
                "mechanism",
            )
        },
        "observations": info,
        "relation": relation,
        "allowed_epsilon": allowed,
        "delta_bound": d_used,
        **b,
        "leaks_more_than_claimed": bool(leaks),
        "exceeds_recomputed": bool(exceeds_recomputed),
        "labels": {
            "epsilon_lb": "certified: the larger of Steinke et al. (2023) and the f-DP bound "
            "(Mahloujifar et al. 2024, (ε, δ) family), each at α/2: holds with probability "
            ">= 1 - alpha",
        },
        "notes": notes,
        "findings": findings,
        "verdict": verdict,
    }
    if estimate is not None:
        res["estimate"] = estimate
        res["labels"]["estimate"] = "Gaussian-fit estimate (Andrew et al. 2024): not a bound"
    return res


def exit_code(result: dict) -> int:
    """1 when the training leaks more than claimed or the claim check has an error
    finding (e.g. an understated ε), else 0."""
    return 0 if result.get("verdict") == "ok" else 1


__all__ = [
    "CanarySet",
    "KINDS",
    "audit_outside",
    "check_params",
    "clean_name",
    "exit_code",
    "group_of_name",
    "load_canary_set",
    "new_canary_set",
    "read_observations",
    "read_params",
    "write_observations",
]
