"""Neighbour replay of a training script, with nothing in the script changed.

``fedlora audit-script train.py --claim claim.toml`` runs the user's script several times
in this process: once on its own data D with every release recorded, then once per
neighbour D′. The libraries are patched at import, not the script:

* **Opacus** — every optimizer's ``add_noise`` (flat, per-layer, ghost/fast-gradient,
  adaptive: whatever the installed release defines) is wrapped: the value entering it
  (``p.summed_grad``, else ``p.grad``) is q(D), what it leaves in ``p.grad`` minus q(D)
  is the noise it added; both pass through :func:`fl.privacy.tap.release`, one release per
  optimizer step (every parameter a part). ``PrivacyEngine.make_private`` gets the
  neighbour's dataset in place of the script's (the same loader settings), and the
  optimizer's expected batch size is held at D's (Opacus derives it from the dataset's
  size, which its analysis treats as public; said in ``held_fixed``).
* **Samplers** — Opacus's Poisson ``UniformWithReplacementSampler`` and torch's
  ``RandomSampler`` (a shuffled loader) record the indices they draw on D; on D′ they
  yield D's draws with the removed record's index taken out and the added record put
  into every batch, at its start or its end (the first or the last physical batch of
  ``BatchMemoryManager``), so the records both datasets share keep their coins.
* Before each run the global generators (``random``, numpy, torch) are reset to one
  snapshot, so the model's initialisation is the same; on D′ the outputs of every release
  are D's, so both runs follow one trajectory.

Compared per neighbour (:class:`audit.replay.record.Recorder`): each release's
‖q(D) − q(D′)‖ against the declared sensitivity (the claim's C, else the optimizer's
``max_grad_norm``; add/remove: C, as Opacus accounts), non-finite values, the number and
order of releases, an exception, and what the script printed (a line printed on D′ that
differs from D's is a release without noise). The noise the library added (the tap's
``released − q(D)`` on D) is tested against the claim's σ·C: its scale (χ², two-sided)
and its freshness (correlation of consecutive steps).
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import runpy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audit.coverage import Coverage, decide
from audit.findings import Code

__all__ = [
    "SCRIPT_KINDS",
    "ScriptNeighbour",
    "audit_script",
    "NeighbourDataset",
    "noisy",
    "sampled",
    "dataset",
    "parse_script_kinds",
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


@contextlib.contextmanager
def _patched():
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


def _snapshot():
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore(snap) -> None:
    import torch

    random.setstate(snap[0])
    np.random.set_state(snap[1])
    torch.set_rng_state(snap[2])


def _run(script, argv: list[str], snap) -> tuple[str, str | None]:
    """Run the script as ``__main__`` (or call it, when it is a callable); (what it
    printed, the exception or None)."""
    _restore(snap)
    buf = io.StringIO()
    old_argv = sys.argv
    sys.argv = [str(script), *argv]
    err = None
    try:
        with contextlib.redirect_stdout(buf):
            if callable(script):
                script()
            else:
                runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            err = f"SystemExit({exc.code})"
    except Exception as exc:  # the script's own failure is part of what it releases
        err = f"{type(exc).__name__}: {exc}"
    finally:
        sys.argv = old_argv
    return buf.getvalue(), err


def _noise_tests(rec, sigma: float | None, clip: float) -> dict:
    """The noise the library added on D (released − q(D) at the tap), against N(0, σ²C²):
    the scale (two-sided χ² on every coordinate) and freshness (the correlation of
    consecutive releases' noise, which is N(0, 1/d) for fresh draws)."""
    from scipy import stats

    if not sigma or not rec.releases:
        return {"performed": False, "reason": "no σ in the claim" if not sigma else "no release"}
    ss, n, corr = 0.0, 0, []
    prev = None
    for rel in rec.releases:
        z = np.concatenate(
            [(rel.output[k] - rel.value[k]).double().numpy().ravel() for k in rel.value]
        )
        if not np.isfinite(z).all():
            return {"performed": True, "passed": False, "nonfinite": True, "ratio": None}
        ss += float((z / (sigma * clip)) ** 2 @ np.ones(len(z)))
        n += len(z)
        if prev is not None and len(prev) == len(z) and len(z) > 1:
            denom = float(np.linalg.norm(prev) * np.linalg.norm(z))
            corr.append(float(prev @ z) / denom if denom > 0 else 1.0)
        prev = z
    ratio = math.sqrt(ss / n) if n else float("nan")
    p_lo = float(stats.chi2.cdf(ss, n))
    p_scale = 2 * min(p_lo, 1 - p_lo)
    d = len(prev) if prev is not None else 1
    zc = float(np.mean(corr)) * math.sqrt(len(corr) * d) if corr else 0.0
    p_fresh = float(2 * stats.norm.sf(abs(zc))) if corr else 1.0
    return {
        "performed": True,
        "ratio": ratio,
        "p_scale": p_scale,
        "p_fresh": p_fresh,
        "coordinates": n,
        "passed": p_scale >= 1e-3 and p_fresh >= 1e-3,
        "nonfinite": False,
    }


def audit_script(
    script: str | Path | Callable[[], object],
    claim=None,
    neighbours: str | tuple | None = None,
    argv: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Audit ``script`` by neighbour replay (module doc); ``script`` may also be a
    callable that trains (called once per run, e.g. a benchmark's case). ``claim``: a
    :class:`audit.claims.schema.Claim` (its C is the declared sensitivity; σ, q, steps and
    ε are checked against what ran) or None. Returns ``{"verdict", "exit_code",
    "coverage", "findings", "replay": {...}, "noise", "claim_check", "held_fixed"}``."""
    from audit.replay.record import Recorder
    from fl.privacy.tap import tapped

    if not callable(script):
        script = Path(script)
        if not script.is_file():
            raise ValueError(f"{script}: no such script")
    name = getattr(script, "__name__", None) or Path(str(script)).name
    say = log or (lambda s: None)
    nbs = parse_script_kinds(neighbours) if not isinstance(neighbours, tuple) else neighbours
    global _S
    _S = _State()
    _S.sensitivity = float(claim.clipping_norm) if claim and claim.clipping_norm else None
    rec = Recorder()
    _S.recorder = rec
    snap = _snapshot()
    findings: list[dict] = []
    results = []
    t0 = time.time()
    with _patched(), tapped(rec):
        say(f"audit-script: running {name} on its data (D), releases recorded")
        out_d, err_d = _run(script, argv or [], snap)
        if err_d:
            raise ValueError(f"{script} failed on its own data: {err_d}")
        seconds = {"D": round(time.time() - t0, 2)}
        counts = np.zeros(max([max(b, default=-1) for b in _S.batches] + [-1]) + 1)
        for b in _S.batches:
            counts[b] += 1
        _S.typical = int(np.argmax(counts)) if len(counts) else 0
        _S.remove = _S.typical
        # D once more, outputs frozen: every q(D) must come back exactly (else the replay
        # cannot tell a neighbour from noise), and the printed lines that differ between
        # two runs on D (timings) are not compared
        say("audit-script: D again (determinism check)")
        _S.neighbour, _S._cursor, _S.optimizers = ScriptNeighbour("same"), 0, []
        rec.start_replay()
        out_d2, err_d2 = _run(script, argv or [], snap)
        same = rec.compare()
        determinism = {
            "max_distance_over_bound": same["max_ratio"],
            "divergence": same["divergence"] or err_d2,
            "deterministic": not (same["divergence"] or err_d2)
            and (same["max_ratio"] or 0.0) <= 1e-6,
        }
        volatile = volatile_lines(out_d, out_d2)
        for i, nb in enumerate(nbs):
            t1 = time.time()
            say(f"audit-script: neighbour {i + 1}/{len(nbs)}: {nb.describe()}")
            _S.neighbour, _S._cursor, _S.optimizers, _S.skipped = nb, 0, [], None
            rec.start_replay()
            out_dp, err = _run(script, argv or [], snap)
            if _S.skipped:  # a neighbour this dataset cannot hold
                results.append({"neighbour": nb.describe(), "skipped": _S.skipped})
                continue
            cmp = rec.compare()
            diff = first_diff(out_d, out_dp, volatile)
            results.append(
                {
                    "neighbour": nb.describe(),
                    "comparison": cmp,
                    "exception": err,
                    "printed_diff": diff,
                }
            )
            findings += _script_findings(nb, cmp, err, diff)
            seconds[f"N{i}"] = round(time.time() - t1, 2)
    sigma = claim.noise_multiplier if claim else None
    clip = _S.sensitivity or (float(_S.optimizers[0].max_grad_norm) if _S.optimizers else 1.0)
    noise = _noise_tests(rec, sigma, clip)
    cov = Coverage()
    if rec.releases and any("comparison" in r for r in results) and determinism["deterministic"]:
        cov.add("clipping", "replay")
    elif rec.releases and not determinism["deterministic"]:
        cov.skip(
            "clipping",
            "the script is not deterministic on its own data (a second run on D gave other "
            f"q(D): {determinism['divergence'] or determinism['max_distance_over_bound']}), so "
            "a neighbour's difference cannot be told from it",
        )
    else:
        cov.skip(
            "clipping", "no release was intercepted (no Opacus optimizer and no marked noise call)"
        )
    if noise.get("performed"):
        cov.add("noise", "replay (noise read at the tap)")
        if not noise["passed"]:
            code = "mechanism_mismatch"
            if noise.get("nonfinite"):
                code = str(Code.RELEASE_NONFINITE)
            elif noise.get("ratio") == 0:
                code = str(Code.NOISE_ABSENT)
            findings.append(
                {
                    "code": code,
                    "severity": "error",
                    "message": f"the noise the library added is not N(0, (σC)²) at the claim's "
                    f"σ = {sigma}, C = {clip}: observed/claimed {noise.get('ratio')}, "
                    f"p(scale) {noise.get('p_scale')}, p(fresh) {noise.get('p_fresh')} "
                    "(Holm-free: each at 0.001)",
                }
            )
    else:
        cov.skip("noise", noise.get("reason", "not tested"))
    cov.skip(
        "sampling",
        "the replay freezes the sampler's draws; sampling is tested by the "
        "canaries (audit.libraries.opacus)",
    )
    cov.skip(
        "accounting",
        "give --claim and use the canary audit (audit.libraries.opacus) "
        "to recompute ε for what ran",
    )
    if not rec.releases:
        findings.append(
            {
                "code": str(Code.REPLAY_EMPTY),
                "severity": "warning",
                "message": "the script made no release the replay could intercept: nothing compared",
            }
        )
    errors = any(f["severity"] == "error" for f in findings)
    verdict, code = decide(errors, cov)
    return {
        "script": str(name),
        "verdict": verdict,
        "exit_code": code,
        "coverage": cov.to_dict(),
        "findings": findings,
        "replay": {
            "determinism": determinism,
            "printed_compared": volatile is not None,
            "printed_volatile_lines": sorted(volatile or []),
            "releases": len(rec.releases),
            "neighbours": results,
            "seconds": seconds,
            "verdict": "fail"
            if any(r.get("comparison") and not r["comparison"]["passed"] for r in results)
            else ("pass" if rec.releases else "not run"),
        },
        "noise": noise,
        "held_fixed": {
            "dataset_size": "Opacus's expected batch size (int(N·q)) and its Poisson loader's "
            "steps per epoch and rate (1/len(loader)) held at D's: its analysis treats N as "
            "public",
            "generators": "random, numpy and torch reset to one snapshot before every run",
        },
    }


def volatile_lines(a: str, b: str) -> set[int] | None:
    """The line numbers that differ between two runs on D (timings, dates); None when
    even the number of lines differs (then what the script prints is not compared)."""
    la, lb = a.splitlines(), b.splitlines()
    if len(la) != len(lb):
        return None
    return {i for i, (x, y) in enumerate(zip(la, lb)) if x != y}


def first_diff(a: str, b: str, volatile: set[int] | None = frozenset()) -> str | None:
    """The first printed line that differs between D and D′, outside ``volatile``."""
    if a == b or volatile is None:
        return None
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y and i not in volatile:
            return f"line {i + 1}: D printed {x[:120]!r}, D′ printed {y[:120]!r}"
    if len(la) != len(lb):
        return f"D printed {len(la)} lines, D′ {len(lb)}"
    return None


def _script_findings(nb, cmp: dict, err: str | None, diff: str | None) -> list[dict]:
    out = []
    for v in cmp["violations"]:
        measured = "not finite" if v["nonfinite"] else f"{v['distance']:.6g}"
        out.append(
            {
                "code": str(Code.SENSITIVITY_EXCEEDED),
                "severity": "error",
                "message": f"{v['where']}: ‖q(D) − q(D′)‖ = {measured} > {v['bound']:.6g} "
                f"(add/remove, C) for the neighbour '{nb.describe()}'",
            }
        )
    if cmp["n_violations"] > len(cmp["violations"]) and out:
        out[-1]["message"] += f" (and {cmp['n_violations'] - len(cmp['violations'])} more releases)"
    for what in (
        cmp["divergence"],
        None if err is None else f"the script raised {err} on D′ (not on D)",
        None if diff is None else f"what the script printed depends on the data ({diff})",
    ):
        if what:
            out.append(
                {
                    "code": str(Code.DATA_DEPENDENT_RELEASE),
                    "severity": "error",
                    "message": f"neighbour '{nb.describe()}': {what}",
                }
            )
    return out
