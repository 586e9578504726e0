"""Payload ⇄ Flower ``RecordDict`` conversion.

A method's payloads and replies are nested dicts (str or int keys) and lists of tensors, numbers,
strings, booleans and ``None`` (``fl.methods.base``). On the wire they become one
``RecordDict`` with three records under a prefix ``<p>``:

- ``<p>.arrays`` (``ArrayRecord``): every tensor / ndarray, keyed by its path
  (keys joined with ``"/"``; ``"/"`` and ``"%"`` inside a key are percent-escaped);
- ``<p>.values`` (``ConfigRecord``): every scalar leaf (int, float, str, bool, bytes),
  keyed by its path;
- ``<p>.tree`` (``ConfigRecord``): ``"skeleton"``, a JSON string of the structure (dict
  key order, lists/tuples, empty dicts, ``None``, each tensor's torch dtype), so that
  ``decode(encode(x))`` rebuilds ``x`` exactly: same nesting, same dtypes (float64 stays
  float64, bfloat16 travels as its 16-bit pattern), same values bit for bit.

Integers outside int64 (Flower's ConfigRecord range) travel as decimal strings.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

_INT64 = (-(1 << 63), (1 << 63) - 1)

# torch dtypes numpy cannot represent: sent as their bit pattern.
_BITCAST = {torch.bfloat16: torch.int16}


def _esc(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _skeleton(obj: Any, path: str, arrays: dict, values: dict):
    """The JSON skeleton of ``obj``; fills ``arrays`` and ``values`` by path."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dt = str(t.dtype).removeprefix("torch.")
        if t.dtype in _BITCAST:
            t = t.view(_BITCAST[t.dtype])
        arrays[path] = Array(t.numpy())
        return {"t": path, "dtype": dt}
    if isinstance(obj, np.ndarray):
        arrays[path] = Array(np.ascontiguousarray(obj))
        return {"np": path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            # int keys occur in optimizer state dicts; JSON keeps them ints in the skeleton
            if isinstance(k, bool) or not isinstance(k, str | int):
                raise TypeError(f"payload dict keys must be str or int, got {k!r} at {path or '/'}")
            sub = _esc(str(k))
            items.append([k, _skeleton(v, f"{path}/{sub}" if path else sub, arrays, values)])
        return {"d": items}
    if isinstance(obj, list | tuple):
        kind = "l" if isinstance(obj, list) else "tu"
        return {
            kind: [
                _skeleton(v, f"{path}/{i}" if path else str(i), arrays, values)
                for i, v in enumerate(obj)
            ]
        }
    if obj is None:
        return {"none": 1}
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, bool):
        values[path] = obj
        return {"v": path}
    if isinstance(obj, int):
        if _INT64[0] <= obj <= _INT64[1]:
            values[path] = obj
            return {"v": path}
        return {"bigint": str(obj)}
    if isinstance(obj, float | str | bytes):
        values[path] = obj
        return {"v": path}
    raise TypeError(f"cannot send a {type(obj).__name__} at {path or '/'} in a Flower record")


def encode(obj: Any, rd: RecordDict | None = None, prefix: str = "payload") -> RecordDict:
    """Put ``obj`` (nested dicts/lists of tensors and scalars) into ``rd`` (a new
    ``RecordDict`` if None) under ``prefix``; returns ``rd``."""
    rd = RecordDict() if rd is None else rd
    arrays: dict[str, Array] = {}
    values: dict[str, Any] = {}
    skel = _skeleton(obj, "", arrays, values)
    rd[f"{prefix}.arrays"] = ArrayRecord(arrays)
    rd[f"{prefix}.values"] = ConfigRecord(values)
    rd[f"{prefix}.tree"] = ConfigRecord({"skeleton": json.dumps(skel)})
    return rd


def _build(sk: dict, arrays, values):
    if "t" in sk:
        a = arrays[sk["t"]].numpy()
        dt = getattr(torch, sk["dtype"])
        t = torch.from_numpy(np.array(a, copy=True))
        return t.view(dt) if dt in _BITCAST else t.to(dt)
    if "np" in sk:
        return np.array(arrays[sk["np"]].numpy(), copy=True)
    if "d" in sk:
        return {k: _build(v, arrays, values) for k, v in sk["d"]}
    if "l" in sk:
        return [_build(v, arrays, values) for v in sk["l"]]
    if "tu" in sk:
        return tuple(_build(v, arrays, values) for v in sk["tu"])
    if "none" in sk:
        return None
    if "bigint" in sk:
        return int(sk["bigint"])
    if "v" in sk:
        return values[sk["v"]]
    raise ValueError(f"bad payload skeleton node {sk!r}")


def decode(rd: RecordDict, prefix: str = "payload") -> Any:
    """Inverse of :func:`encode`."""
    try:
        skel = json.loads(rd[f"{prefix}.tree"]["skeleton"])
        arrays = rd[f"{prefix}.arrays"]
        values = rd[f"{prefix}.values"]
    except KeyError as exc:
        raise ValueError(f"Flower record has no payload {prefix!r} ({exc})") from None
    return _build(skel, arrays, values)


def has(rd: RecordDict, prefix: str) -> bool:
    return f"{prefix}.tree" in rd


def remove(rd: RecordDict, prefix: str) -> None:
    for part in ("arrays", "values", "tree"):
        rd.pop(f"{prefix}.{part}", None)


__all__ = ["encode", "decode", "has", "remove"]
