"""The report's empirical privacy: ε estimates from each attack's saved member/non-member
scores (Clopper–Pearson and GDP, Bonferroni over the run's attacks), the run's certified
lower bound (:func:`best_bound`, the verdict's: the one-run canary audit only), their
figure and the *Empirical privacy* section.

Why the attack scores give estimates, not a bound: the Clopper–Pearson test
FPR + e^ε·FNR ≥ 1 − δ needs independent trials of the mechanism on one neighbouring
pair. A run's members and non-members are different examples scored by one model, split
once (a fixed count, not independent coin flips), so their rates are dependent and the
inequality is not a theorem about them. The one-run audit (Steinke, Nasr & Jagielski
2023) is: its canaries are included by independent fair coins from the secret key, and
its p-value charges δ per canary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.report.analyses import figure_paragraph
from audit.report.document import Paragraph, Section, Table, save_figure


def empirical_bounds(row: dict, alpha: float = 0.05) -> list[dict]:
    """ε estimates (Clopper–Pearson and GDP) from every attack's saved scores (one model's
    members and non-members: estimates, not certified bounds; module docstring): one
    :func:`audit.bounds.hypothesis.epsilon_lower_bound` result per (attack, method), with
    ``"attack"`` and ``"family_alpha"`` added.

    The report takes the largest bound over the run's k attacks, so each attack's bound is
    computed at ``alpha / k`` (Bonferroni): with probability at least 1 − ``alpha`` every
    one of them holds, hence their maximum does. (Per attack at ``alpha`` each, the
    maximum of k bounds would hold with probability only 1 − k·``alpha``.)"""
    if not row.get("scores_path"):
        return []
    from audit.bounds.hypothesis import epsilon_lower_bound

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
    """The Clopper–Pearson estimates per run and attack against the claimed ε; none when
    every one is 0."""
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
        ax.bar(xs, ys, width=width, label=f"{a} (CP estimate)")
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
    ax.set_title("ε estimates from member/non-member scores (one model) vs claimed ε")
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem)


def _canary_kind(one: dict) -> str:
    if one.get("kind") == "gradient":
        return "gradient (white box)"
    if one.get("kind") == "canary_clients":
        est = one.get("estimate") or {}
        shown = ", ".join(f"{k} {v:.3g}" for k, v in est.items() if isinstance(v, int | float))
        return "canary clients" + (
            f" (Gaussian-fit estimate, not a bound: {shown})" if shown else ""
        )
    return "input (loss on the final model)"


def best_bound(row: dict) -> dict | None:
    """The run's certified empirical ε lower bound, ``{"epsilon_lb", "alpha", "source"}``
    (with ``"limit"`` and ``"exceeds"`` from the run audit's claim check when it made one):
    the one-run canary audit (``row["audit"]["one_run"]``), or None without canaries.
    The attacks' member/non-member bounds (:func:`empirical_bounds`) are not used: they are
    estimates from one model (module docstring), shown in the Empirical privacy section."""
    one = (row.get("audit") or {}).get("one_run")
    if not one or one.get("epsilon_lb") is None:  # none, or sampler canaries only
        return None
    kind = {"gradient": "gradient ", "canary_clients": "canary-client "}.get(one.get("kind"), "")
    fdp = (one.get("fdp") or {}).get("epsilon_lb", one.get("epsilon_lb_fdp"))
    out = {
        "epsilon_lb": one["epsilon_lb"],
        "alpha": one["alpha"],
        "source": f"{one['m']} {kind}canaries, one run",
        # each certified on its own at 1 − α (the verdict tests the claim with the larger,
        # each at α/2: claim_check)
        "steinke": one["epsilon_lb"],
        "fdp": fdp if isinstance(fdp, int | float) else None,
    }
    check = one.get("claim_check") or {}
    if check and check.get("epsilon") is not None:
        # the bound the claim is tested with (client level: at δ' = (1 + e^ε)δ)
        out["epsilon_lb"] = check.get("epsilon_lb", out["epsilon_lb"])
        if check.get("delta") != one.get("delta"):
            out["source"] += f", at δ' = {check['delta']:.2g}"
        out["limit"], out["exceeds"] = check["epsilon"], bool(check.get("exceeds"))
    return out


def empirical_section(rows: list[dict], figdir: Path, summary: dict) -> Section:
    """The "Empirical privacy" section: the runs' empirical lower bounds on ε (attack
    scores, one-run canaries) beside the claimed ε, with their figure in ``figdir``."""
    sec = Section("Empirical privacy")
    bt = [
        [r["run"], b["attack"], b["method"], b["epsilon_lb"], r["epsilon_claimed"]]
        for r in rows
        for b in r["bounds"]
    ]
    one_run = []
    for r in rows:
        one = (r.get("audit") or {}).get("one_run")
        if not one:
            continue
        fdp = one.get("fdp") or {}
        check = one.get("claim_check") or {}
        one_run.append(
            [
                r["run"],
                _canary_kind(one),
                one.get("m"),
                one.get("epsilon_lb"),
                fdp.get("epsilon_lb", one.get("epsilon_lb_fdp")),
                check.get("epsilon_lb"),
                check.get("epsilon"),
            ]
        )
    if bt:
        sec.add(
            Table.of(
                ["run", "attack", "bound", "ε estimate (one model; 95% jointly, not certified)",
                 "ε claimed"],
                bt,
            )
        )  # fmt: skip
        fig = _plot_bounds(rows, figdir / "epsilon_bounds")
        if fig:
            sec.add(figure_paragraph(fig[0], "ε estimates from one model's scores vs claimed ε"))
        else:
            sec.add(
                Paragraph.of(
                    "Every Clopper–Pearson estimate is 0: at 95% confidence no attack's "
                    "scores separate members from non-members well enough to suggest any "
                    "ε > 0, so there is no figure (the GDP estimates, which also assume a "
                    "Gaussian privacy profile, are in the table)."
                )
            )
        summary["bounds"] = [
            dict(zip(["run", "attack", "method", "epsilon_lb", "epsilon_claimed"], b)) for b in bt
        ]
    if bt:
        sec.add(
            Paragraph.of(
                "These are estimates, not certified bounds: the test behind them assumes "
                "independent trials of the mechanism on one neighbouring pair, and a run's "
                "members and non-members are different examples scored by one model. The "
                "verdict uses only the one-run canary audit, whose canaries are included by "
                "independent coins from the secret key (Steinke, Nasr & Jagielski 2023)."
            )
        )
    if one_run:
        sec.add(
            Table.of(
                ["run", "canaries", "m", "Steinke et al. ε_lb (95%)", "f-DP ε_lb (95%)",
                 "tested: larger of the two at α/2", "claim allows"],
                one_run,
            )
        )  # fmt: skip
        sec.add(
            Paragraph.of(
                "One-run canary audits (certified lower bounds). Steinke, Nasr & Jagielski "
                "2023 and the f-DP test of Mahloujifar, Melis & Chaudhuri 2024 (family of "
                "(ε, δ) curves: valid for any mechanism) each hold at 95%; the claim is "
                "tested with the larger of the two computed at 97.5% each, which holds at "
                "95% jointly."
            )
        )
    if not bt and not one_run:
        sec.missing = "no attack scores or canaries to bound ε from below."
    return sec


#: claim id (its prefix) → the analysis whose figure the claim rests on
