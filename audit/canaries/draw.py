"""The draws of a canary set (:mod:`audit.canaries.canary_set`) from its key: the trainable
parameters it is drawn over (read and checked), the gradient canaries' coordinates, the
input canaries' records (random texts or mislabelled records) and the canary clients'
directions, each from its own stream of the key, as the engine draws its own canaries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fl.errors import UsageError

#: stream names under the set's key
COORD_STREAM = ("outside-canaries", "coordinates")
TEXT_STREAM = ("outside-canaries", "texts")
#: parameter groups gradient canaries are stratified over (the engine's A / B / head)
GROUPS = ("lora_A", "lora_B", "other")
_ENGINE_GROUP = {"lora_A": "A", "lora_B": "B"}

__all__ = [
    "GROUPS",
    "check_params",
    "clean_name",
    "client_canaries",
    "gradient_coordinates",
    "group_of_name",
    "mislabelled",
    "numel",
    "random_texts",
    "read_params",
]


# --------------------------------------------------------------------------- parameters


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
    """The checked parameter list (:func:`read_params`); a UsageError names ``where``."""
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


def numel(shape) -> int:
    """The number of entries of a parameter of this shape."""
    return int(math.prod(shape))


# --------------------------------------------------------------------------- the draws


def gradient_coordinates(key, m: int, params: list[dict]) -> list[dict]:
    """M distinct coordinates of ``params``, stratified over the groups lora_A, lora_B,
    other exactly as the engine stratifies over A, B and the head
    (:func:`fl.privacy.gradient_canaries.choose_coordinates`), from the key's stream
    :data:`COORD_STREAM`: ``[{"param", "index"}]`` in canary order."""
    from fl.privacy.gradient_canaries import choose_coordinates

    total = sum(numel(p["shape"]) for p in params)
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
        (lora if eng else head).append((key_name, numel(p["shape"])))
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
