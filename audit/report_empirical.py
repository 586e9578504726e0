"""The report's empirical privacy: ε lower bounds from each attack's saved scores
(Clopper–Pearson and GDP, Bonferroni over the run's attacks), the best assumption-free
bound of a run with its own confidence (:func:`best_bound`, the verdict's), their figure
and the *Empirical privacy* section."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.report_doc import Paragraph, Section, Table, save_figure
from audit.report_sections import _figure


def empirical_bounds(row: dict, alpha: float = 0.05) -> list[dict]:
    """ε lower bounds (Clopper–Pearson and GDP) from every attack's saved scores: one
    :func:`audit.empirical.epsilon_lower_bound` result per (attack, method), with
    ``"attack"`` and ``"family_alpha"`` added.

    The report takes the largest bound over the run's k attacks, so each attack's bound is
    computed at ``alpha / k`` (Bonferroni): with probability at least 1 − ``alpha`` every
    one of them holds, hence their maximum does. (Per attack at ``alpha`` each, the
    maximum of k bounds would hold with probability only 1 − k·``alpha``.)"""
    if not row.get("scores_path"):
        return []
    from audit.empirical import epsilon_lower_bound

    data = np.load(row["scores_path"])
    is_member = data["is_member"].astype(bool)
    delta = row.get("delta") or 1e-5
    attacks = {}
    for key in data.files:
        # every numeric array aligned with is_member is one attack's scores
        if (
            key == "is_member"
            or data[key].shape != is_member.shape
            or data[key].dtype.kind not in "fi"
        ):
            continue
        s = data[key].astype(float)
        if not np.isfinite(s).all():
            continue
        attacks[key.removeprefix("scores_").removeprefix("score_")] = s
    each = alpha / max(len(attacks), 1)
    out = []
    for name, s in attacks.items():
        for method in ("clopper_pearson", "gdp"):
            b = epsilon_lower_bound(s[is_member], s[~is_member], delta, alpha=each, method=method)
            out.append({"attack": name, **b, "family_alpha": alpha})
    return out


def _plot_bounds(rows: list[dict], path_stem: Path) -> list[Path]:
    """The Clopper–Pearson bounds per run and attack against the claimed ε; none when
    every bound is 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [
        (r["run"], b) for r in rows for b in r.get("bounds", []) if b["method"] == "clopper_pearson"
    ]
    if not any(b["epsilon_lb"] > 0 for _, b in pts):
        return []  # empty bars say nothing
    runs = [r["run"] for r in rows if r.get("bounds")]
    attacks = sorted({b["attack"] for _, b in pts})
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(runs) + 2), 3.6))
    width = 0.8 / max(len(attacks), 1)
    for j, a in enumerate(attacks):
        xs, ys = [], []
        for i, run in enumerate(runs):
            v = [b["epsilon_lb"] for rn, b in pts if rn == run and b["attack"] == a]
            if v:
                xs.append(i + (j - (len(attacks) - 1) / 2) * width)
                ys.append(v[0])
        ax.bar(xs, ys, width=width, label=f"{a} (lower bound)")
    for i, r in enumerate([r for r in rows if r.get("bounds")]):
        c = r.get("epsilon_claimed")
        if isinstance(c, int | float) and math.isfinite(c):
            ax.hlines(
                c,
                i - 0.45,
                i + 0.45,
                colors="k",
                linestyles="--",
                label="claimed ε" if i == 0 else None,
            )
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(runs, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ε (privacy loss, nats)")
    ax.set_title("Empirical ε lower bounds (95% confidence) vs claimed ε")
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem)


def best_bound(row: dict) -> dict | None:
    """The run's highest assumption-free empirical ε lower bound, ``{"epsilon_lb",
    "alpha", "source"}``: Clopper–Pearson over each attack's scores, or the one-run
    canary audit; None without scores or canaries. (GDP bounds assume a Gaussian
    privacy profile and are shown in the Empirical privacy section only.)

    ``alpha`` is the maximum's own failure probability: the attacks' bounds hold jointly
    at 1 − ``family_alpha`` (:func:`empirical_bounds`), and a one-run canary bound at
    1 − its ``alpha``; the larger of the two holds when both do, so with both present the
    union bound adds the two."""
    cp = [b for b in row.get("bounds") or [] if b["method"] == "clopper_pearson"]
    found = [{"epsilon_lb": b["epsilon_lb"], "source": f"{b['attack']}, CP"} for b in cp]
    alpha = max((b.get("family_alpha", b["alpha"]) for b in cp), default=0.0)
    one = (row.get("audit") or {}).get("one_run")
    if one:
        src = f"{one['m']} canaries, one run"
        found.append({"epsilon_lb": one["epsilon_lb"], "source": src})
        alpha += one["alpha"]
    best = max(found, key=lambda b: b["epsilon_lb"], default=None)
    return None if best is None else {**best, "alpha": alpha}


def _empirical_section(rows: list[dict], figdir: Path, summary: dict) -> Section:
    sec = Section("Empirical privacy")
    bt = [
        [r["run"], b["attack"], b["method"], b["epsilon_lb"], r["epsilon_claimed"]]
        for r in rows
        for b in r["bounds"]
    ]
    one_run = [
        [r["run"], (r.get("audit") or {}).get("one_run", {}).get("epsilon_lb")]
        for r in rows
        if (r.get("audit") or {}).get("one_run")
    ]
    if bt:
        sec.add(
            Table.of(
                ["run", "attack", "bound", "ε lower bound (95%, jointly over the attacks)",
                 "ε claimed"],
                bt,
            )
        )  # fmt: skip
        fig = _plot_bounds(rows, figdir / "epsilon_bounds")
        if fig:
            sec.add(_figure(fig[0], "empirical ε lower bounds vs claimed ε"))
        else:
            sec.add(
                Paragraph.of(
                    "Every Clopper–Pearson bound is 0: at 95% confidence no attack's scores "
                    "separate members from non-members well enough to certify any ε > 0, so "
                    "there is no figure (the GDP bounds, which assume a Gaussian privacy "
                    "profile, are in the table)."
                )
            )
        summary["bounds"] = [
            dict(zip(["run", "attack", "method", "epsilon_lb", "epsilon_claimed"], b)) for b in bt
        ]
    if one_run:
        sec.add(Table.of(["run", "one-run ε lower bound (canaries)"], one_run))
    if not bt and not one_run:
        sec.missing = "no attack scores or canaries to bound ε from below."
    return sec


#: claim id (its prefix) → the analysis whose figure the claim rests on
