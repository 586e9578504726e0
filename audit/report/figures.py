"""The figures the report draws itself (:mod:`audit.report.build` places them).

- :func:`privacy_figure`, the figure the job exists for: per run, ε claimed, ε recomputed
  from the ledger, the certified one-run lower bound (its one-sided interval [lb, ∞)) and
  the noise-implied ε when the run audit gives one, on one ε axis, beside the run's utility.
  One row per run, each marker kind at its own height in the row, so that no run and no
  marker hides another (runs of equal utility and equal ε are the rule, not the
  exception: one ε budget per job).
- :func:`roc_figure`: a run's attacks' ROC curves on log–log axes (TPR at low FPR is what
  the field reads), from the curves in attacks.json, with the diagonal; FPRs below
  1 / (non-members) cannot be measured and are shaded.
- :func:`accuracy_figure`: accuracy per round, only for runs with more than one round
  evaluated (a curve of one point is a dot on an axis made up around it).
- :func:`claims_figure`: the papers' claims, counted by verdict per paper (the table
  lists them one by one).

Each returns a matplotlib figure (object API, no pyplot state) or None when there is
nothing to draw; :func:`audit.report.document.save_figure` writes it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "accuracy_figure",
    "accuracy_series",
    "claims_figure",
    "implied_epsilon",
    "num",
    "privacy_figure",
    "roc_figure",
]

#: marker kinds of the privacy figure: key → (legend label, offset in the row, style)
_EPS_MARKS = {
    "claimed": ("ε claimed", -0.27, dict(marker="o", mfc="none", mec="k", ms=8, mew=1.5)),
    "recomputed": ("ε recomputed (ledger)", -0.09, dict(marker="s", color="C0", ms=7)),
    "implied": ("ε implied by the noise", 0.09, dict(marker="D", color="C2", ms=6)),
}
_LB_OFFSET = 0.27


def _new_figure(figsize, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, **kw)
    FigureCanvasAgg(fig)
    return fig


def num(v) -> float | None:
    """A number of a run's JSON (``"inf"`` strings too) as a float; None otherwise."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str) and v.lower() in ("inf", "infinity"):
        return math.inf
    return None


def implied_epsilon(audit: dict | None) -> float | None:
    """The noise-implied ε of a run audit (the ledger's ε with σ scaled by the noise the
    conformance tests observed), when the audit carries one: ``one_run.implied_epsilon``,
    else ``one_run.conformance.implied_epsilon``, else a top-level ``conformance``."""
    a = audit or {}
    one = a.get("one_run") or {}
    for src in (one, one.get("conformance") or {}, a.get("conformance") or {}):
        v = num(src.get("implied_epsilon")) if isinstance(src, dict) else None
        if v is not None:
            return v
    return None


def privacy_figure(points: list[dict]):
    """``points``: one dict per run (:func:`audit.report.build.privacy_points`): ``run``,
    ``dp``, ``claimed``, ``recomputed``, ``implied``, ``lb``, ``alpha``, ``limit``,
    ``balanced_accuracy``, ``accuracy``, ``perplexity`` (None where unknown).

    ε (claimed, recomputed, certified lower bound, noise-implied) per run on the left,
    utility (balanced accuracy, accuracy) on the right, one row per run; None when no run
    has any ε to show."""
    shown = [p for p in points if any(p[k] is not None for k in ("claimed", "recomputed", "lb"))]
    if not shown:
        return None
    n = len(points)
    # narrow, so that its text stays legible scaled down to a phone's width
    fig = _new_figure((5.2, 1.9 + 0.55 * n), layout="constrained")
    ax, au = fig.subplots(1, 2, sharey=True, width_ratios=[2, 1])
    finite = [
        p[k]
        for p in points
        for k in ("claimed", "recomputed", "implied", "lb", "limit")
        if p.get(k) is not None and math.isfinite(p[k])
    ]
    top = max([1.0, *finite]) * 1.15
    used: dict[str, object] = {}
    alpha = next((p["alpha"] for p in points if p["alpha"] is not None), 0.05)
    for i, p in enumerate(points):
        for key, (label, dy, style) in _EPS_MARKS.items():
            v = p[key]
            if v is None:
                continue
            if math.isfinite(v):
                (h,) = ax.plot([v], [i + dy], ls="none", **style)
            else:  # ∞: at the edge, said in words
                (h,) = ax.plot([top], [i + dy], ls="none", clip_on=False, **style)
                ax.annotate("∞", (top, i + dy), xytext=(6, 0), textcoords="offset points",
                            va="center", fontsize=9, annotation_clip=False)  # fmt: skip
            used.setdefault(label, h)
        lb = p["lb"]
        if lb is not None and math.isfinite(lb):
            y = i + _LB_OFFSET
            ax.plot([lb, top], [y, y], color="C1", lw=3, alpha=0.35, solid_capstyle="butt")
            (h,) = ax.plot([lb], [y], ls="none", marker="|", color="C1", ms=11, mew=2.5,
                           clip_on=False)  # fmt: skip
            used.setdefault(f"certified: ε ≥ bound ({1 - alpha:.0%})", h)
        lim = p.get("limit")
        if lim is not None and math.isfinite(lim):
            (h,) = ax.plot([lim], [i + _LB_OFFSET], ls="none", marker="x", color="k", ms=8,
                           mew=2, clip_on=False)  # fmt: skip
            used.setdefault("limit for one canary (2ε)", h)
        if not p["dp"]:
            ax.text(0.02, i - 0.1, "no DP claimed", transform=ax.get_yaxis_transform(),
                    va="center", fontsize=9, color="0.35", style="italic")  # fmt: skip
    ax.set_xlim(0, top)
    ax.set_xlabel("ε at the run's δ")
    ax.set_title("privacy", fontsize=10)
    # utility
    chance = False
    for i, p in enumerate(points):
        b, acc = p["balanced_accuracy"], p["accuracy"]
        if b is not None:
            (h,) = au.plot([b], [i - 0.09], ls="none", marker="o", color="C3", ms=7)
            used.setdefault("balanced accuracy", h)
            chance = True
        if acc is not None:
            (h,) = au.plot([acc], [i + 0.09], ls="none", marker="o", mfc="none", mec="C3",
                           ms=7, mew=1.5)  # fmt: skip
            used.setdefault("accuracy", h)
        if b is None and acc is None:
            txt = f"perplexity {p['perplexity']:.3g}" if p["perplexity"] is not None else "–"
            au.text(0.5, i, txt, transform=au.get_yaxis_transform(), ha="center",
                    va="center", fontsize=8, color="0.35")  # fmt: skip
    vals = [v for p in points for v in (p["balanced_accuracy"], p["accuracy"]) if v is not None]
    au.set_xlim(min([0.45, *vals]) - 0.03, 1.0)
    if chance:
        (h,) = au.plot([0.5, 0.5], [-0.5, n - 0.5], ls=":", color="0.4", lw=1)
        used.setdefault("chance (balanced)", h)
    au.set_xlabel("test utility")
    au.set_title("utility", fontsize=10)
    for a in (ax, au):
        for i in range(n - 1):
            a.axhline(i + 0.5, color="0.88", lw=0.8)
        a.grid(axis="x", alpha=0.3)
    ax.set_yticks(range(n), [p["run"] for p in points], fontsize=9)
    ax.set_ylim(n - 0.5, -0.5)  # the first run on top, as in the verdict table
    ax.tick_params(axis="y", length=0)
    au.tick_params(axis="y", length=0)
    fig.suptitle("Privacy claimed, recomputed and measured, against utility", fontsize=10)
    order = [lab for lab, _, _ in _EPS_MARKS.values()]
    keys = sorted(used, key=lambda k: order.index(k) if k in order else len(order))
    fig.legend([used[k] for k in keys], keys, loc="outside lower center", ncol=2,
               fontsize=8.5, frameon=False)  # fmt: skip
    return fig


def _log_roc(fpr, tpr, first: float) -> tuple[np.ndarray, np.ndarray]:
    """The ROC points a log–log plot can show: TPR > 0; of the points at FPR 0 only the
    highest, drawn at FPR ``first`` = 1/n (the TPR at FPR 0 is reached there too)."""
    f, t = np.asarray(fpr, dtype=float), np.asarray(tpr, dtype=float)
    keep = t > 0
    zero = np.flatnonzero(keep & (f <= 0))
    if zero.size > 1:  # the vertical run up the left edge: its top only
        keep[zero[:-1]] = False
    f, t = f[keep], t[keep]
    return np.maximum(f, first), t


def roc_figure(title: str, attacks: dict):
    """The ROC curves of a run's attacks (``{name: result}`` of attacks.json, each with
    ``roc`` {fpr, tpr}, ``auc``, ``tpr_at_fpr``, ``n_nonmembers``) on log–log axes from
    min(10⁻³, 1/n) to 1, with the diagonal (a guess); FPRs under 1/n (n non-members)
    cannot be measured: shaded, and a curve's highest point at FPR 0 drawn at 1/n
    (:func:`_log_roc`). None without curves."""
    done = {k: a for k, a in attacks.items() if isinstance(a, dict) and (a.get("roc") or {})}
    if not done:
        return None
    n_non = max(int(a.get("n_nonmembers") or 1000) for a in done.values())
    first = 1.0 / max(n_non, 1)  # the smallest FPR above 0 the data can show
    lo = min(1e-3, first)
    entries = len(done) + 1 + (first > lo)
    # the legend below the axes (never over a curve)
    fig = _new_figure((5.0, 4.0 + 0.19 * entries), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    if first > lo:
        ax.axvspan(lo, first, color="0.93", lw=0,
                   label=f"FPR < 1/{n_non}: unmeasurable")  # fmt: skip
    ax.plot([lo, 1], [lo, 1], ls="--", color="0.45", lw=1, label="random guess")
    styles = ("-", "--", "-.", ":")
    for j, (name, a) in enumerate(done.items()):
        f, t = _log_roc(a["roc"]["fpr"], a["roc"]["tpr"], first)
        tpr1 = (a.get("tpr_at_fpr") or {}).get("0.01")
        lab = f"{name}: AUC {a['auc']:.3f}" if "auc" in a else name
        if tpr1 is not None:
            lab += f", TPR {tpr1:.3f} at 1%"
        ax.plot(f, t, lw=1.6, ls=styles[(j // 10) % len(styles)], color=f"C{j % 10}", label=lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.0)
    ax.set_xlabel("false positive rate (log)")
    ax.set_ylabel("true positive rate (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=8, frameon=False)
    return fig


def accuracy_series(rows: list[dict]) -> tuple[list[tuple[str, list]], list[tuple[str, int]]]:
    """``(series, single)``: the runs with accuracy at more than one round, each
    ``(run, [(round, accuracy), ...])``, and the runs evaluated at one round only, each
    ``(run, round)``."""
    series, single = [], []
    for r in rows:
        pts = sorted(
            {m["round"]: m["accuracy"] for m in r.get("metrics") or []
             if m.get("accuracy") is not None and m.get("round") is not None}.items()
        )  # fmt: skip
        if len(pts) > 1:
            series.append((r["run"], pts))
        elif pts:
            single.append((r["run"], pts[0][0]))
    return series, single


def accuracy_figure(series: list[tuple[str, list]]):
    """Accuracy per round of the runs in ``series`` (:func:`accuracy_series`); runs on
    top of each other are told apart by marker and line style and a small sideways shift."""
    if not series:
        return None
    fig = _new_figure((6.4, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    markers = "osD^vP*Xh<>"
    k = len(series)
    for j, (name, pts) in enumerate(series):
        dx = (j - (k - 1) / 2) * min(0.06, 0.3 / k)
        ax.plot([x + dx for x, _ in pts], [y for _, y in pts], marker=markers[j % len(markers)],
                ls=("-", "--", ":", "-.")[j % 4], lw=1.4, ms=6, mfc="none", mew=1.5,
                label=name)  # fmt: skip
    rounds = sorted({x for _, pts in series for x, _ in pts})
    ax.set_xticks(rounds)
    lo, hi = ax.get_ylim()
    if hi - lo < 0.1:  # equal accuracies: an axis of ±0.05 around them, not ±1e-9
        mid = (hi + lo) / 2
        ax.set_ylim(mid - 0.05, mid + 0.05)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title("Test accuracy of the global adapter per round", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if k > 4 else 1)
    return fig


_VERDICT_COLOURS = (("holds", True, "#2ca02c"), ("does not hold", False, "#d62728"),
                    ("inconclusive", None, "#9a9a9a"))  # fmt: skip


def claims_figure(claims: list[dict]):
    """The claims counted by verdict (holds, does not hold, inconclusive), one stacked bar
    per paper; None without claims."""
    papers: dict[str, dict] = {}
    for c in claims:
        h = c.get("holds") if c.get("holds") in (True, False) else None
        papers.setdefault(str(c.get("paper")), {True: 0, False: 0, None: 0})[h] += 1
    if not papers:
        return None
    names = list(papers)
    fig = _new_figure((6.4, 1.4 + 0.42 * len(names)), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    left = np.zeros(len(names))
    for label, key, colour in _VERDICT_COLOURS:
        w = np.array([papers[p][key] for p in names], dtype=float)
        ax.barh(range(len(names)), w, left=left, color=colour, label=label, height=0.62)
        for i, (x0, wi) in enumerate(zip(left, w)):
            if wi:
                ax.text(x0 + wi / 2, i, f"{int(wi)}", ha="center", va="center", fontsize=8,
                        color="white")  # fmt: skip
        left += w
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("claims")
    ax.set_title("The papers' claims by verdict", fontsize=10)
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig
