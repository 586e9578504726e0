"""The statistics the utility claims are decided with (:mod:`analysis.utility_claims`): the
Student-t interval of a mean, paired differences over common seeds, and the verdicts
"A beats B" and "A reaches B" read from a paired interval (holds / does not hold /
inconclusive, with the margin ``MARGIN``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

#: a gain smaller than this (one point of balanced accuracy) is no improvement
MARGIN = 0.01

__all__ = [
    "MARGIN",
    "mean_ci",
    "paired",
    "t_quantile",
    "verdict_better",
    "verdict_reaches",
    "verdict_word",
]


def t_quantile(df: int, p: float = 0.975) -> float:
    """Student-t quantile (scipy's, kept behind one function)."""
    from scipy import stats

    return float(stats.t.ppf(p, df))


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean, sample std and the Student-t interval of the mean (``None`` bounds for n < 2)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci": [None, None]}
    m = statistics.fmean(vals)
    if n < 2:
        return {"n": 1, "mean": m, "std": None, "ci": [None, None]}
    sd = statistics.stdev(vals)
    half = t_quantile(n - 1, 0.5 + level / 2) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "std": sd, "ci": [m - half, m + half]}


def paired(cell_a: dict | None, cell_b: dict | None) -> dict:
    """A − B over the seeds both cells ran: mean, std, 95 % interval, the seeds."""
    if not cell_a or not cell_b:
        return {**mean_ci([]), "pairs": []}
    common = sorted(set(cell_a["seeds"]) & set(cell_b["seeds"]))
    diffs = {s: cell_a["seeds"][s] - cell_b["seeds"][s] for s in common}
    pairs = [s for s, d in diffs.items() if math.isfinite(d)]
    return {**mean_ci([diffs[s] for s in pairs]), "pairs": pairs}


def verdict_better(diff: dict, margin: float = MARGIN) -> bool | None:
    """True (holds), False (does not hold) or None (inconclusive) for "A beats B"."""
    lo, hi = diff["ci"]
    if diff["n"] < 3 or lo is None:
        return None
    if lo > 0:
        return True
    if hi < margin:
        return False
    return None


def verdict_reaches(diff: dict, margin: float = MARGIN) -> bool | None:
    """ "A reaches B" (non-inferiority): True when the paired interval of A − B lies
    above −``margin`` (A is at most one point behind, at 95 %), False when it lies
    below −``margin`` (A is more than a point behind), None otherwise or with fewer
    than 3 pairs. An interval inside (−margin, 0) refutes neither."""
    lo, hi = diff["ci"]
    if diff["n"] < 3 or lo is None:
        return None
    if lo > -margin:
        return True
    if hi < -margin:
        return False
    return None


def verdict_word(holds: bool | None) -> str:
    return {True: "holds", False: "does not hold", None: "inconclusive"}[holds]
