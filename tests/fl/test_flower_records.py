"""Flower records: every payload the engine sends survives encode/decode bit-exactly
(tensors in the ArrayRecord, scalars in the ConfigRecord); what cannot be sent is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl.flower import records as R


# ------------------------------------------------------------------ record conversion
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(type(k) is type(kb) for k, kb in zip(a, b))
            and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"empty": {}, "nested": {"deeper": {}}},
        {
            "state": {
                "factors": {
                    "base_model.layer.0.query": {
                        "A": torch.randn(4, 8, dtype=torch.float64),
                        "B": torch.randn(8, 4),
                    }
                },
                "head": {"w": torch.randn(2, 3, dtype=torch.float16)},
            },
            "omega_seed": (1 << 63) - 1,
            "huge": 1 << 80,
            "width": 6,
            "loss": float("nan"),
            "inf": float("-inf"),
            "name": "a/b%2Fc",
            "k/with/slash": True,
            "none": None,
            "bytes": b"\x00\x01",
        },
        {
            "bf16": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16),
            "ints": torch.arange(5, dtype=torch.int64),
            "bool": torch.tensor([True, False]),
            "scalar": torch.tensor(3.0, dtype=torch.float64),
            "zero_size": torch.zeros(0, 3),
            "np": np.arange(6, dtype=np.int32).reshape(2, 3),
            "list": [1, 2.5, "x", [torch.ones(2)], {"a": 1}],
            "tuple": (1, "two"),
            "_opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"params": [0]}]},
        },
    ],
)
def test_record_roundtrip(obj):
    rd = R.encode(obj)
    back = R.decode(rd)
    assert _same(obj, back)
    # Tensors travel in the ArrayRecord, scalars in the ConfigRecord.
    n_tensors = len(rd["payload.arrays"])
    assert n_tensors == sum(1 for _ in _leaves(obj) if isinstance(_, torch.Tensor | np.ndarray))


def _leaves(o):
    if isinstance(o, dict):
        for v in o.values():
            yield from _leaves(v)
    elif isinstance(o, list | tuple):
        for v in o:
            yield from _leaves(v)
    else:
        yield o


def test_record_rejects_unsendable():
    with pytest.raises(TypeError, match="cannot send a object"):
        R.encode({"x": object()})
    with pytest.raises(TypeError, match="keys must be str or int"):
        R.encode({(1, 2): 3})
