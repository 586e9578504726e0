"""ROC-based metrics for membership-inference attacks, with bootstrap confidence intervals.

Convention throughout: a *higher* score means "more likely a member". All arrays are 1-D with
one entry per example; ``is_member`` is boolean (or 0/1). Rates (FPR, TPR) are fractions in [0, 1].

The ROC is computed here in numpy (no sklearn dependency at runtime) so that tie handling is
explicit: every distinct score value is one threshold, and examples with equal scores cross the
threshold together, which yields the diagonal segments that give ties half credit in the AUC.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["roc_metrics", "roc_curve_np", "plot_roc"]

# TPR@FPR targets that are always reported, whatever the caller asks for.
_DEFAULT_FPRS = (0.001, 0.01)
# Upper bound on the number of ROC points returned, to keep JSON reports small.
_MAX_ROC_POINTS = 2000


def _validate(scores, is_member) -> tuple[np.ndarray, np.ndarray]:
    """Check and convert inputs.

    Args:
        scores: shape (n,), finite real attack scores.
        is_member: shape (n,), bool or {0, 1} membership labels.

    Returns:
        (scores as float64 (n,), labels as bool (n,)).

    Raises:
        ValueError: on shape mismatch, non-1-D input, empty input, non-finite scores, labels
            that are not binary, or a missing class.
    """
    s = np.asarray(scores, dtype=np.float64)
    y_raw = np.asarray(is_member)
    if s.ndim != 1 or y_raw.ndim != 1:
        raise ValueError(
            f"scores and is_member must be 1-D, got shapes {s.shape} and {y_raw.shape}"
        )
    if s.shape[0] != y_raw.shape[0]:
        raise ValueError(
            f"scores and is_member must have the same length, got {s.shape[0]} and {y_raw.shape[0]}"
        )
    if s.shape[0] == 0:
        raise ValueError("scores is empty")
    n_nan = int(np.isnan(s).sum())
    n_inf = int(np.isinf(s).sum())
    if n_nan or n_inf:
        raise ValueError(f"scores must be finite: found {n_nan} NaN and {n_inf} Inf values")
    if y_raw.dtype == bool:
        y = y_raw
    else:
        uniq = np.unique(y_raw)
        if not np.all(np.isin(uniq, [0, 1])):
            raise ValueError(f"is_member must be boolean or 0/1, got values {uniq[:5].tolist()}")
        y = y_raw.astype(bool)
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == y.shape[0]:
        raise ValueError(
            "both classes must be present: got "
            f"{n_pos} members and {y.shape[0] - n_pos} non-members"
        )
    return s, y


def _sorted_blocks(s: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort by decreasing score and locate the last index of each block of equal scores.

    Returns:
        order (n,) permutation sorting scores descending; ys (n,) labels in that order;
        last (d,) index (into the sorted arrays) of the last element of each of the d distinct
        score values, so cumulative counts at ``last`` are counts at threshold ``score >= value``.
    """
    # Stable mergesort so equal scores keep input order (only matters for reproducibility).
    order = np.argsort(-s, kind="mergesort")
    ss = s[order]
    last = np.flatnonzero(np.diff(ss)) if ss.size > 1 else np.empty(0, dtype=np.intp)
    last = np.append(last, ss.size - 1)
    return order, y[order], last


def _roc_from_weights(
    w_pos: np.ndarray, w_neg: np.ndarray, last: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """ROC points from per-example (sorted) class weights; weights allow bootstrap resampling.

    Args:
        w_pos, w_neg: shape (n,), non-negative multiplicity of each sorted example as a member /
            non-member (one of them is zero for each example).
        last: shape (d,), block ends from :func:`_sorted_blocks`.

    Returns:
        fpr, tpr: shape (d + 1,), starting at (0, 0) (threshold +inf) and ending at (1, 1).
    """
    tps = np.cumsum(w_pos)[last]
    fps = np.cumsum(w_neg)[last]
    tpr = np.concatenate(([0.0], tps / tps[-1]))
    fpr = np.concatenate(([0.0], fps / fps[-1]))
    return fpr, tpr


def roc_curve_np(scores, is_member) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Full ROC curve, one point per distinct score (no intermediate points dropped).

    Args:
        scores: shape (n,), higher = more likely member.
        is_member: shape (n,), bool labels.

    Returns:
        fpr, tpr, thresholds: shape (d + 1,) each, where d is the number of distinct scores.
        Point i is the rates of the rule "score >= thresholds[i]"; thresholds[0] = +inf gives
        (0, 0). Same convention as ``sklearn.metrics.roc_curve(..., drop_intermediate=False)``.
    """
    s, y = _validate(scores, is_member)
    order, ys, last = _sorted_blocks(s, y)
    fpr, tpr = _roc_from_weights(ys.astype(np.float64), (~ys).astype(np.float64), last)
    thresholds = np.concatenate(([np.inf], s[order][last]))
    return fpr, tpr, thresholds


def _summaries(fpr: np.ndarray, tpr: np.ndarray, targets: Sequence[float]) -> dict:
    """AUC, advantage and conservative TPR@FPR from ROC points (fpr, tpr non-decreasing)."""
    # Trapezoid rule: the diagonal segments produced by tied blocks give ties half credit,
    # which equals the Mann-Whitney U statistic.
    auc = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))
    advantage = float(np.max(tpr - fpr))
    tpr_at = {}
    for f in targets:
        # Last operating point with FPR <= target (no interpolation, so never optimistic);
        # tpr is non-decreasing, so that point has the largest admissible TPR.
        idx = np.searchsorted(fpr, f, side="right") - 1
        tpr_at[str(f)] = float(tpr[idx])
    return {"auc": auc, "advantage": advantage, "tpr_at_fpr": tpr_at}


def _downsample(fpr: np.ndarray, tpr: np.ndarray, max_points: int) -> tuple[list, list]:
    """Keep <= max_points ROC points: half log-spaced (low-FPR detail), half linear, plus ends."""
    n = fpr.size
    if n <= max_points:
        return fpr.tolist(), tpr.tolist()
    half = max_points // 2
    idx = np.concatenate(
        (
            np.linspace(0, n - 1, half).round(),
            np.geomspace(1, n - 1, max_points - half - 1).round(),
            [0],
        )
    ).astype(np.intp)
    idx = np.unique(idx)  # sorted, so the curve stays monotone
    return fpr[idx].tolist(), tpr[idx].tolist()


def roc_metrics(
    scores,
    is_member,
    fprs: Iterable[float] = _DEFAULT_FPRS,
    n_bootstrap: int = 200,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict:
    """Membership-inference ROC metrics with stratified bootstrap percentile intervals.

    Args:
        scores: shape (n,), finite attack scores; higher = more likely member.
        is_member: shape (n,), bool or 0/1 ground-truth membership; both classes required.
        fprs: FPR targets (fractions) for TPR@FPR; 0.001 and 0.01 are always included.
        n_bootstrap: number of bootstrap resamples (0 disables ``ci``). Members and
            non-members are resampled separately (class counts fixed) so both are always present.
        seed: seed for the bootstrap ``numpy.random.Generator``.
        alpha: the intervals have nominal coverage 1 - alpha (percentile method).

    Returns:
        dict (JSON-serialisable) with
          ``auc`` (float), ``advantage`` (max_t TPR - FPR), ``balanced_accuracy``
          (max_t (TPR + 1 - FPR) / 2 = (1 + advantage) / 2), ``tpr_at_fpr`` ({str(fpr): tpr},
          TPR of the last ROC point with FPR <= target, i.e. conservative), ``roc``
          ({"fpr": [...], "tpr": [...]}, <= 2000 points, includes (0,0) and (1,1)),
          ``n_members``, ``n_nonmembers``, ``n_bootstrap``, ``alpha``, and ``ci``:
          {"auc": [lo, hi], "advantage": [lo, hi], "tpr_at_fpr": {str(fpr): [lo, hi]}}.

    Raises:
        ValueError: invalid inputs (see :func:`_validate`), alpha outside (0, 1), negative
            n_bootstrap or an FPR target outside [0, 1].
    """
    s, y = _validate(scores, is_member)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_bootstrap < 0:
        raise ValueError(f"n_bootstrap must be >= 0, got {n_bootstrap}")
    targets = sorted({float(f) for f in (*_DEFAULT_FPRS, *fprs)})
    if any(not 0.0 <= f <= 1.0 for f in targets):
        raise ValueError(f"fprs must lie in [0, 1], got {targets}")

    order, ys, last = _sorted_blocks(s, y)
    pos_w = ys.astype(np.float64)
    neg_w = (~ys).astype(np.float64)
    fpr, tpr = _roc_from_weights(pos_w, neg_w, last)
    point = _summaries(fpr, tpr, targets)
    n_pos, n_neg = int(ys.sum()), int((~ys).sum())
    roc_fpr, roc_tpr = _downsample(fpr, tpr, _MAX_ROC_POINTS)

    out = {
        "auc": point["auc"],
        "advantage": point["advantage"],
        "balanced_accuracy": (1.0 + point["advantage"]) / 2.0,
        "tpr_at_fpr": point["tpr_at_fpr"],
        "roc": {"fpr": roc_fpr, "tpr": roc_tpr},
        "n_members": n_pos,
        "n_nonmembers": n_neg,
        "n_bootstrap": int(n_bootstrap),
        "alpha": float(alpha),
    }

    if n_bootstrap > 0:
        rng = np.random.default_rng(seed)
        pos_idx = np.flatnonzero(ys)
        neg_idx = np.flatnonzero(~ys)
        n = ys.size
        aucs = np.empty(n_bootstrap)
        advs = np.empty(n_bootstrap)
        tprs = np.empty((n_bootstrap, len(targets)))
        for b in range(n_bootstrap):
            # Resampling = integer multiplicities on the already-sorted order: no re-sort needed.
            wp = np.bincount(pos_idx[rng.integers(0, n_pos, n_pos)], minlength=n)
            wn = np.bincount(neg_idx[rng.integers(0, n_neg, n_neg)], minlength=n)
            bf, bt = _roc_from_weights(wp.astype(np.float64), wn.astype(np.float64), last)
            summ = _summaries(bf, bt, targets)
            aucs[b] = summ["auc"]
            advs[b] = summ["advantage"]
            tprs[b] = [summ["tpr_at_fpr"][str(f)] for f in targets]
        q = [100 * alpha / 2, 100 * (1 - alpha / 2)]
        out["ci"] = {
            "auc": np.percentile(aucs, q).tolist(),
            "advantage": np.percentile(advs, q).tolist(),
            "tpr_at_fpr": {
                str(f): np.percentile(tprs[:, j], q).tolist() for j, f in enumerate(targets)
            },
        }
    return out


def plot_roc(
    results: Mapping[str, Mapping],
    path_stem: str | Path,
    title: str = "Membership inference ROC",
) -> tuple[Path, Path]:
    """Log-log ROC curves of several attacks on one figure, saved as PNG and SVG.

    Args:
        results: {attack name: output of :func:`roc_metrics`} (needs ``roc``, ``auc``,
            ``tpr_at_fpr["0.01"]`` and ``n_nonmembers``).
        path_stem: output path without suffix; parent directories are created.
        title: figure title.

    Returns:
        (png path, svg path).
    """
    # Object-oriented API on an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("results is empty: nothing to plot")
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)

    # Log axes cannot show 0: clip to half the smallest non-zero FPR achievable.
    n_neg = max(int(r.get("n_nonmembers", 1000)) for r in results.values())
    floor = 0.5 / max(n_neg, 1)

    fig = Figure(figsize=(5.5, 5.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    grid = np.geomspace(floor, 1.0, 200)
    ax.plot(grid, grid, ls="--", color="grey", lw=1, label="random guess")
    for name, r in results.items():
        f = np.clip(np.asarray(r["roc"]["fpr"], dtype=float), floor, 1.0)
        t = np.clip(np.asarray(r["roc"]["tpr"], dtype=float), floor, 1.0)
        tpr1 = r["tpr_at_fpr"].get("0.01", float("nan"))
        ax.plot(f, t, lw=1.5, label=f"{name} (AUC={r['auc']:.3f}, TPR@1%FPR={tpr1:.3f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor, 1.0)
    ax.set_ylim(floor, 1.0)
    ax.set_xlabel("False positive rate")
    ax.set_ylabel("True positive rate")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    png, svg = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")
    fig.savefig(png, dpi=150)
    fig.savefig(svg)
    return png, svg
