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
from pathlib import Path

import numpy as np

from audit.coverage import Coverage, decide
from audit.findings import Code
from audit.replay import patches as P
from audit.replay.patches import (
    SCRIPT_KINDS,
    NeighbourDataset,
    ScriptNeighbour,
    dataset,
    noisy,
    parse_script_kinds,
    sampled,
)

__all__ = [
    "SCRIPT_KINDS",
    "ScriptNeighbour",
    "audit_script",
    "NeighbourDataset",
    "noisy",
    "sampled",
    "dataset",
    "parse_script_kinds",
    "run_script",
]


def _snapshot():
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore(snap) -> None:
    import torch

    random.setstate(snap[0])
    np.random.set_state(snap[1])
    torch.set_rng_state(snap[2])


def run_script(script, argv: list[str]) -> tuple[str, str | None]:
    """Run ``script`` as ``__main__`` (or call it, when it is a callable) with ``argv``;
    (what it printed, its exception as one line, or None). A script's failure is named,
    never re-raised (on D′ it is itself a release)."""
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


def _run(script, argv: list[str], snap) -> tuple[str, str | None]:
    """:func:`run_script` from the generators' snapshot ``snap``."""
    _restore(snap)
    return run_script(script, argv)


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
    _S = P.reset()
    _S.sensitivity = float(claim.clipping_norm) if claim and claim.clipping_norm else None
    rec = Recorder()
    _S.recorder = rec
    snap = _snapshot()
    findings: list[dict] = []
    results = []
    t0 = time.time()
    with P.patched(), tapped(rec):
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
    from audit.replay.record import comparison_findings

    return comparison_findings(
        cmp,
        f"'{nb.describe()}'",
        "add/remove, C",
        [
            None if err is None else f"the script raised {err} on D′ (not on D)",
            None if diff is None else f"what the script printed depends on the data ({diff})",
        ],
    )
