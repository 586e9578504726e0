"""Interleaved timing, medians and ratios with a spread (the benchmark harness core).

The machines this runs on are shared and noisy, so a benchmark never reports an
absolute time alone: it times a *baseline* and a *candidate* in the same process,
interleaved A/B/A/B (rep i runs A then B, rep i+1 runs B then A, so a slow period or
a warm cache favours neither side), and reports

    ratio = median_i (t_cand,i / t_base,i)         (paired per repetition)

with the min/max of the paired ratios and a bootstrap 90% interval of the median.
A ratio > 1 means the candidate is slower (time ratio); benchmarks that report a
speed-up say so in their ``ratio_kind``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import numpy as np

__all__ = ["interleaved", "paired_ratio", "summarize", "result", "timed"]


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn`` (perf_counter)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Time every function in ``fns`` ``reps`` times, interleaved.

    Each repetition calls every function once; the order rotates by one position per
    repetition (A B C, B C A, C A B, ...) so no side always runs first. ``warmup``
    untimed rounds come first (allocations, lazy imports, caches). Returns
    name → list of ``reps`` wall times in seconds.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    names = list(fns)
    for _ in range(warmup):
        for nm in names:
            fns[nm]()
    out: dict[str, list[float]] = {nm: [] for nm in names}
    for i in range(reps):
        k = i % len(names)
        for nm in names[k:] + names[:k]:
            out[nm].append(timed(fns[nm]))
    return out


def paired_ratio(
    base: list[float], cand: list[float], n_boot: int = 2000, seed: int = 0
) -> dict[str, float]:
    """Paired ratios r_i = cand_i / base_i: median, min, max and a bootstrap 90%
    interval of the median (resampling the pairs). Times in seconds (> 0)."""
    if len(base) != len(cand) or not base:
        raise ValueError(f"need equal, non-empty lists; got {len(base)} and {len(cand)}")
    r = np.asarray(cand, dtype=float) / np.maximum(np.asarray(base, dtype=float), 1e-12)
    rng = np.random.default_rng(seed)
    boots = np.median(r[rng.integers(0, len(r), size=(n_boot, len(r)))], axis=1)
    return {
        "median": float(np.median(r)),
        "min": float(r.min()),
        "max": float(r.max()),
        "boot_lo": float(np.quantile(boots, 0.05)),
        "boot_hi": float(np.quantile(boots, 0.95)),
        "n": len(r),
    }


def summarize(times: list[float], per: float = 1.0) -> dict[str, float]:
    """Median / min / max of ``times`` divided by ``per`` (e.g. steps per call)."""
    return {
        "median_s": statistics.median(times) / per,
        "min_s": min(times) / per,
        "max_s": max(times) / per,
        "reps": len(times),
    }


def result(
    name: str,
    workload: str,
    baseline: str,
    candidate: str,
    ratio: float | None,
    ratio_kind: str,
    target: str | None = None,
    met: bool | None = None,
    details: dict | None = None,
    spread: dict | None = None,
    available: bool = True,
) -> dict:
    """The dict every benchmark's ``run`` returns (also the JSON record).

    ratio_kind: "time" (candidate time / baseline time; lower is better) or
    "speedup" (baseline time / candidate time; higher is better).
    """
    if ratio_kind not in ("time", "speedup"):
        raise ValueError(f"ratio_kind must be 'time' or 'speedup', got {ratio_kind!r}")
    if ratio is not None and not math.isfinite(ratio):
        ratio = None
    return {
        "name": name,
        "available": available,
        "workload": workload,
        "baseline": baseline,
        "candidate": candidate,
        "ratio": ratio,
        "ratio_kind": ratio_kind,
        "spread": spread,
        "target": target,
        "met": met,
        "details": details or {},
    }


def not_available(name: str, why: str) -> dict:
    """Record for a benchmark whose code under test does not exist (yet)."""
    return result(
        name,
        workload="n/a",
        baseline="n/a",
        candidate="n/a",
        ratio=None,
        ratio_kind="time",
        details={"reason": why},
        available=False,
    )
