"""A utility-claims decision (:func:`analysis.utility_claims.decide`) drawn and tabulated:
balanced accuracy against ε per method (:func:`plot`) and the cells and claims as Markdown
(:func:`table_md`).
"""

from __future__ import annotations

import math

__all__ = ["plot", "table_md"]


def plot(doc: dict, out) -> dict[str, str] | None:
    """Balanced accuracy vs ε per method (95 % intervals), one panel per grid, and per
    partition for the heterogeneous-rank grids (IID, Dirichlet(0.5), Dirichlet(0.1)).
    Methods with no cell of two or more seeds are left out (the table has them)."""
    from analysis import figures

    series: dict[str, dict[str, list[tuple[float, dict]]]] = {}
    for c in doc["cells"]:
        method, _, cond = c["group"].partition("/")
        if c["balanced_mean"] is None:
            continue
        panel = c["grid"]
        if cond.startswith("eps"):
            x = float(cond[3:])
        elif cond == "nodp":
            x = math.inf
        else:  # hetero: one panel per partition
            part, _, tag = cond.rpartition("/")
            if not tag.startswith("eps") and tag != "nodp":
                continue
            x = float(tag[3:]) if tag.startswith("eps") else math.inf
            panel = f"{c['grid']} · {part}"
        series.setdefault(panel, {}).setdefault(method, []).append((x, c))
    # a method measured on one seed only (a dplearn candidate tried once) has no interval
    # anywhere: it stays in the table, not in the figure
    series = {
        panel: kept
        for panel, methods in series.items()
        if (kept := {m: pts for m, pts in methods.items() if any(c["n"] >= 2 for _, c in pts)})
    }
    if not series:
        return None
    ncols = min(2, len(series))  # each panel 5 × 3.6 inches, two per row
    nrows = math.ceil(len(series) / ncols)
    fig, axes = figures.subplots(ncols=ncols, nrows=nrows, width=5.0, height=3.6)
    for ax in axes[len(series) :]:
        ax.set_visible(False)
    part_order = {"iid": 0, "dirichlet0.5": 1, "dirichlet0.1": 2}

    def panel_key(name: str):
        grid, _, part = name.partition(" · ")
        return grid, part_order.get(part, 9), part

    for ax, (grid, methods) in zip(axes, sorted(series.items(), key=lambda kv: panel_key(kv[0]))):
        finite = sorted({x for pts in methods.values() for x, _ in pts if math.isfinite(x)})
        x_nodp = (max(finite) * 1.6) if finite else 1.0
        for i, (method, pts) in enumerate(sorted(methods.items())):
            pts = sorted(pts, key=lambda p: p[0])
            xs = [x if math.isfinite(x) else x_nodp for x, _ in pts]
            ys = [c["balanced_mean"] for _, c in pts]
            lo = [
                c["balanced_mean"] - (c["balanced_ci95"][0] or c["balanced_mean"]) for _, c in pts
            ]
            hi = [
                (c["balanced_ci95"][1] or c["balanced_mean"]) - c["balanced_mean"] for _, c in pts
            ]
            jitter = 1 + 0.02 * (i - len(methods) / 2)
            ax.errorbar(
                [x * jitter for x in xs], ys, yerr=[lo, hi], marker="o", ms=3, capsize=2,
                label=method, lw=1,
            )  # fmt: skip
        ax.set_xscale("log")
        nodp = any(not math.isfinite(x) for pts in methods.values() for x, _ in pts)
        ticks = finite + ([x_nodp] if nodp else [])
        ax.set_xticks(ticks, [f"{t:g}" for t in finite] + (["no DP"] if nodp else []))
        ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)  # a lone ε is not zoomed onto
        ax.minorticks_off()
        ax.set_xlabel("ε (sample level)" if "fedpower" not in grid else "ε (client level)")
        ax.set_ylabel("balanced accuracy (mean, 95% CI)")
        ax.set_title(grid, fontsize=9)
        ax.axhline(0.5, color="0.6", lw=0.8, ls=":")
        ax.legend(fontsize=6, loc="lower right")
    return figures.save_figure(fig, out, "claims_utility")


def table_md(doc: dict) -> str:
    """The cells as a Markdown table (mean ± std [95 % CI], n, seconds per run)."""

    def f(m, s, ci):
        if m is None:
            return "–"
        txt = f"{m:.3f}" if s is None else f"{m:.3f} ± {s:.3f}"
        if ci and ci[0] is not None:
            txt += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
        return txt

    lines = [
        "| grid | group | n | balanced accuracy | accuracy | s/run |",
        "|---|---|---|---|---|---|",
    ]
    for c in doc["cells"]:
        secs = "–" if c["seconds_mean"] is None else f"{c['seconds_mean']:.0f}"
        lines.append(
            f"| {c['grid']} | {c['group']} | {c['n']} | "
            f"{f(c['balanced_mean'], c['balanced_std'], c['balanced_ci95'])} | "
            f"{f(c['accuracy_mean'], c['accuracy_std'], c['accuracy_ci95'])} | {secs} |"
        )
    lines += ["", "| claim | verdict | A − B (mean [95% CI]) | pairs |", "|---|---|---|---|"]
    mia = []
    for c in doc["claims"]:
        m = c["measured"]
        if "diff_mean" not in m:
            mia.append(c)
            continue
        d = "–" if m["diff_mean"] is None else f"{m['diff_mean']:+.3f}"
        if m["diff_ci95"][0] is not None:
            d += f" [{m['diff_ci95'][0]:+.3f}, {m['diff_ci95'][1]:+.3f}]"
        lines.append(f"| {c['id']} | {c['verdict']} | {d} | {m['pairs']} |")
    if mia:

        def g(x):
            return "–" if x is None else f"{x:.3f}"

        lines += [
            "",
            "| claim | verdict | runs' AUC intervals: lowest lower end – highest upper end "
            "| AUC, mean over seeds | seeds |",
            "|---|---|---|---|---|",
        ]
        for c in mia:
            m = c["measured"]
            lines.append(
                f"| {c['id']} | {c['verdict']} | {g(m['smallest_run_auc_lower'])} – "
                f"{g(m['largest_run_auc_upper'])} | {g(m['auc']['mean'])} | {m['seeds']} |"
            )
    return "\n".join(lines) + "\n"
