"""What ``fedlora audit-script`` patches at import, and the neighbours it tries.

* :data:`SCRIPT_KINDS`, :class:`ScriptNeighbour`, :func:`perturb`, :class:`NeighbourDataset`:
  the neighbours of a training script's dataset (a record removed; a copy, a ×1000-scaled
  record with another label, a NaN or +inf record added at the start or end of every batch);
* :func:`patched`: the library patches — every Opacus optimizer class's ``add_noise``
  wrapped at the release tap, ``PrivacyEngine.make_private`` handed D′ with D's
  dataset-size-derived settings, Opacus's Poisson sampler and torch's ``RandomSampler``
  recording D's draws and replaying them mapped onto D′;
* :func:`dataset`, :func:`sampled`, :func:`noisy`: what a hand-written loop marks.

The driver that runs a script on D and its neighbours is :mod:`audit.replay.script`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "SCRIPT_KINDS",
    "DEFAULT_SCRIPT",
    "ScriptNeighbour",
    "parse_script_kinds",
    "perturb",
    "NeighbourDataset",
    "patched",
    "reset",
    "state",
    "dataset",
    "sampled",
    "noisy",
]


#: kind -> what the added record is (None: the typical record removed)
SCRIPT_KINDS = {
    "remove": "a typical record removed (the one drawn most often)",
    "duplicate": "a copy of a typical record added",
    "scaled": "a typical record with its features × 1000 and another label added (a "
    "gradient far above C)",
    "nan": "a record with NaN features added",
    "inf": "a record with +inf features added",
}
#: ``auto``: a removal and the scaled record at both ends of the batches. ``nan``/``inf`` are
#: in ``all``: whether non-finite features belong to the data domain is the user's claim
#: (Opacus 1.6 lets one NaN record make every release NaN: docs/replay.md)
DEFAULT_SCRIPT = (("remove", "end"), ("scaled", "end"), ("scaled", "start"))


@dataclass(frozen=True)
class ScriptNeighbour:
    kind: str
    at: str = "end"  # where the added record enters every batch: "start" or "end"

    def describe(self) -> str:
        what = SCRIPT_KINDS[self.kind]
        return what if self.kind == "remove" else f"{what}, at the {self.at} of every batch"


def parse_script_kinds(spec: str | None) -> tuple[ScriptNeighbour, ...]:
    """``auto`` (:data:`DEFAULT_SCRIPT`), ``all`` (every kind at both ends), or a comma
    list of ``kind[@start|@end]``."""
    if spec is None or spec.strip() in ("", "auto"):
        return tuple(ScriptNeighbour(k, a) for k, a in DEFAULT_SCRIPT)
    if spec.strip() == "all":
        out = [ScriptNeighbour("remove")]
        out += [
            ScriptNeighbour(k, a) for k in SCRIPT_KINDS if k != "remove" for a in ("end", "start")
        ]
        return tuple(out)
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        kind, _, at = item.partition("@")
        if kind not in SCRIPT_KINDS or at not in ("", "start", "end"):
            raise ValueError(
                f"--neighbours: {item!r} is not kind[@start|@end] with a kind among "
                f"{', '.join(SCRIPT_KINDS)}"
            )
        out.append(ScriptNeighbour(kind, at or "end"))
    return tuple(out)


def perturb(item, kind: str):
    """The record ``item`` (a tensor, or a tuple whose first element holds the features)
    changed as ``kind`` says; integer features (token ids) cannot hold NaN or be scaled:
    a clear error."""
    import torch

    if kind == "duplicate":
        return item
    feats, rest = (item[0], tuple(item[1:])) if isinstance(item, tuple | list) else (item, None)
    if not torch.is_tensor(feats) or not feats.is_floating_point():
        raise ValueError(
            f"neighbour {kind!r} needs floating-point features; this dataset's records hold "
            f"{type(feats).__name__} {getattr(feats, 'dtype', '')} (use remove or duplicate)"
        )
    new = {
        "scaled": feats * 1000.0,
        "nan": torch.full_like(feats, math.nan),
        "inf": torch.full_like(feats, math.inf),
    }[kind]
    if kind == "scaled" and rest and torch.is_tensor(rest[0]) and rest[0].dtype == torch.long:
        # another label too: a saturated softmax on the right class has a gradient near 0
        y = rest[0]
        rest = (1 - y if y.ndim == 0 and int(y) in (0, 1) else y + 1, *rest[1:])
    return new if rest is None else (new, *rest)


class NeighbourDataset:
    """D′ as a view of D: ``remove`` (an index of D) taken out, ``added`` (a record)
    appended as the last index."""

    def __init__(self, base, remove: int | None = None, added=None):
        self.base, self.remove, self.added = base, remove, added
        self._n = len(base) - (remove is not None)

    def __len__(self):
        return self._n + (self.added is not None)

    def __getitem__(self, i):
        if i < 0:
            i += len(self)
        if self.added is not None and i == self._n:
            return self.added
        if self.remove is not None and i >= self.remove:
            i += 1
        return self.base[i]


class _State:
    """What the patches share during one audit."""

    def __init__(self):
        self.recorder = None
        self.neighbour: ScriptNeighbour | None = None
        self.remove: int | None = None
        self.added_index: int | None = None
        self.batches: list[list[int]] = []  # recorded on D (Poisson batches or permutations)
        self._cursor = 0
        self.expected_batch: dict[int, float] = {}
        self.n_private = 0
        self.sensitivity: float | None = None
        self.optimizers: list = []
        self.typical = 0
        self.loader_steps: dict[int, tuple] = {}
        self.skipped: str | None = None

    def map_batch(self, idx: list[int]) -> list[int]:
        if self.neighbour.kind == "same":  # D again: the determinism check
            return list(idx)
        rm = self.remove if self.neighbour.kind == "remove" else None
        out = [i - (rm is not None and i > rm) for i in idx if i != rm]
        if self.added_index is not None:
            out = (
                [self.added_index, *out]
                if self.neighbour.at == "start"
                else [*out, self.added_index]
            )
        return out

    def draw(self, fresh: list[int]) -> list[int]:
        if self.neighbour is None:
            self.batches.append(list(fresh))
            return fresh
        k = self._cursor
        self._cursor += 1
        return self.map_batch(self.batches[k]) if k < len(self.batches) else fresh


_S = _State()


def reset() -> _State:
    """A fresh state for one audit (the patches read it while they are installed)."""
    global _S
    _S = _State()
    return _S


def state() -> _State:
    """The current audit's state."""
    return _S


@contextlib.contextmanager
def patched():
    """Install the library patches (module doc) for the block; undone after it."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from fl.privacy import tap

    undo: list[Callable] = []

    def patch(obj, name, new):
        old = obj.__dict__[name]
        setattr(obj, name, new)
        undo.append(lambda: setattr(obj, name, old))

    orig_rs_iter = RandomSampler.__iter__

    def rs_iter(self):
        yield from _S.draw(list(orig_rs_iter(self)))

    patch(RandomSampler, "__iter__", rs_iter)
    try:
        import opacus
        from opacus.optimizers import optimizer as opt_mod
        from opacus.utils import uniform_sampler
    except ImportError:  # no Opacus: only hand-marked releases and torch's sampler
        opacus = None
    if opacus is not None:
        us = uniform_sampler.UniformWithReplacementSampler
        orig_us_iter = us.__iter__

        def us_iter(self):
            for b in orig_us_iter(self):
                yield _S.draw(list(b))

        patch(us, "__iter__", us_iter)
        # every class in opacus.optimizers that defines add_noise (flat, per-layer, ghost, ...)
        import opacus.optimizers as optimizers

        seen = set()
        for name in dir(optimizers):
            cls = getattr(optimizers, name)
            if isinstance(cls, type) and "add_noise" in cls.__dict__ and cls not in seen:
                seen.add(cls)
                patch(cls, "add_noise", _wrap_add_noise(cls.__dict__["add_noise"], tap, torch))
        base = opt_mod.DPOptimizer
        if base not in seen:
            patch(base, "add_noise", _wrap_add_noise(base.__dict__["add_noise"], tap, torch))
        pe = opacus.PrivacyEngine
        orig_mp = pe.make_private

        def make_private(self, *args, **kw):
            loader = kw.get("data_loader")
            if loader is not None:
                _S.n_private = len(loader.dataset)
                if _S.neighbour is not None:
                    kw["data_loader"] = _neighbour_loader(loader, DataLoader, RandomSampler)
            out = orig_mp(self, *args, **kw)
            opt = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            bs = (
                getattr(out[2], "batch_sampler", None)
                if isinstance(out, tuple) and len(out) > 2
                else None
            )
            k = len(_S.optimizers)
            if bs is not None and hasattr(bs, "steps"):
                if _S.neighbour is None:
                    _S.loader_steps[k] = (bs.steps, getattr(bs, "sample_rate", None))
                elif k in _S.loader_steps:  # steps = 1/q from N: held at D's (N public)
                    bs.steps, rate = _S.loader_steps[k]
                    if rate is not None:
                        bs.sample_rate = rate
            if opt is not None:
                k = len(_S.optimizers)
                _S.optimizers.append(opt)
                if _S.neighbour is None:
                    _S.expected_batch[k] = getattr(opt, "expected_batch_size", None)
                elif _S.expected_batch.get(k) is not None:
                    opt.expected_batch_size = _S.expected_batch[k]  # N held public
            return out

        patch(pe, "make_private", make_private)
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def dataset(base):
    """Mark a hand-written training's dataset: returns it unchanged; under
    ``fedlora audit-script`` on a neighbour run, D′ (:class:`NeighbourDataset`)."""
    if _S.recorder is None or _S.neighbour is None:
        _S.n_private = len(base)
        return base
    return _neighbour_view(base)


def _neighbour_view(base):
    nb = _S.neighbour
    if nb.kind == "same":
        _S.added_index = None
        return base
    remove = _S.remove if nb.kind == "remove" else None
    try:
        added = None if nb.kind == "remove" else perturb(base[_S.typical], nb.kind)
    except ValueError as exc:  # this dataset cannot hold the neighbour: skipped, said so
        _S.skipped = str(exc)
        raise
    ds = NeighbourDataset(base, remove, added)
    _S.added_index = None if added is None else len(ds) - 1
    return ds


def _neighbour_loader(loader, DataLoader, RandomSampler):
    ds = _neighbour_view(loader.dataset)
    if ds is loader.dataset:
        return loader
    return DataLoader(
        ds,
        batch_size=loader.batch_size,
        shuffle=isinstance(loader.sampler, RandomSampler),
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
    )


def _wrap_add_noise(orig, tap, torch):
    def add_noise(self, *a, **kw):
        params = list(self.params)
        value = []
        for p in params:
            v = getattr(p, "summed_grad", None)
            v = p.grad if v is None else v
            value.append(None if v is None else v.detach().reshape(-1).clone())
        out = orig(self, *a, **kw)
        sens = _S.sensitivity if _S.sensitivity is not None else float(self.max_grad_norm)
        for i, (p, v) in enumerate(zip(params, value)):
            if v is None or p.grad is None:
                continue
            noisy = p.grad.detach().reshape(-1)
            released = tap.release("opacus", v, noisy - v, sens, part=str(i))
            p.grad = released.view_as(p).to(p.grad.dtype)
        return out

    add_noise.__wrapped__ = orig
    return add_noise


def noisy(kind: str, value, noise, sensitivity: float):
    """Mark a hand-written noise call: returns ``value + noise``; under
    ``fedlora audit-script`` the replay records q(D) = ``value`` and its ``sensitivity``
    (the ℓ2 bound the accounting assumes) and freezes the output on D′."""
    from fl.privacy.tap import release

    return release(kind, value, noise, sensitivity)


def sampled(indices):
    """Mark a hand-written sampler's draw (a list of dataset indices, one batch): returns
    it unchanged; under ``fedlora audit-script`` it is recorded on D and replayed on D′
    with the neighbour's record taken out or put in (the shared records keep their coins)."""
    if _S.recorder is None:
        return list(indices)
    return _S.draw(list(indices))
