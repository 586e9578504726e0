"""The accountant comparison's summary, table and minimal reproductions
(:mod:`benchmarks.auditing.accountants`)."""

from __future__ import annotations

import math

from benchmarks.auditing.accountants_core import (
    FLWR_POPULATION,
    H_REF,
    PLD_MAX_POINTS,
    REL_TOL,
    short_text,
)


def _cell_text(r: dict) -> str:
    return f"σ={r['sigma']:g}, q={r['q']:g}, steps={r['steps']}, δ={r['delta']:g}"


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


#: the overstatement ratio is also reported over cells whose PLD ε is at least this (near ε = 0
#: any additive slack, e.g. a PRV's eps_error, gives an unbounded ratio)
EPS_MEANINGFUL = 1.0


def _finding_text(r: dict) -> dict:
    return {
        "cell": _cell_text(r),
        "epsilon": r["epsilon"],
        "pld_optimistic": r["pld_optimistic"],
        "pld_pessimistic": r["pld_pessimistic"],
        "ratio_to_lower": r["ratio_to_lower"],
        "gap": r["pld_optimistic"] - r["epsilon"],
        "reproduction": reproduction(r),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per accountant: counts, the largest ratio each way (with its cell), the findings."""
    out = []
    keys = list(dict.fromkeys((r["library"], r["accountant"]) for r in rows))
    for lib, name in keys:
        rs = [r for r in rows if (r["library"], r["accountant"]) == (lib, name)]
        ok = [r for r in rs if r["status"] == "ok"]
        with_ratio = [r for r in ok if r.get("ratio") is not None]
        finite = [r for r in with_ratio if math.isfinite(r["ratio"])]
        big = [r for r in finite if r["pld_pessimistic"] >= EPS_MEANINGFUL]
        lo = min(with_ratio, key=lambda r: r["ratio"], default=None)
        hi = max(finite, key=lambda r: r["ratio"], default=None)
        hi_big = max(big, key=lambda r: r["ratio"], default=None)
        findings = [r for r in ok if r.get("finding")]
        worst = min(findings, key=lambda r: r["ratio_to_lower"] or 0.0, default=None)
        widest = max(findings, key=lambda r: r["pld_optimistic"] - r["epsilon"], default=None)
        reasons: dict[str, int] = {}
        for r in rs:
            if r["status"] in ("refused", "skipped"):
                k = f"{r['status']}: {_reason_kind(r['reason'])}"
                reasons[k] = reasons.get(k, 0) + 1
        out.append(
            {
                "library": lib,
                "accountant": name,
                "cells": len(rs),
                "compared": len(ok),
                "refused": sum(r["status"] == "refused" for r in rs),
                "skipped": sum(r["status"] == "skipped" for r in rs),
                "not_applicable": sum(r["status"] == "n/a" for r in rs),
                "infinite": sum(math.isinf(r["epsilon"]) for r in ok),
                "min_ratio": lo and lo["ratio"],
                "min_ratio_cell": lo and _cell_text(lo),
                "max_ratio": hi and hi["ratio"],
                "max_ratio_cell": hi and _cell_text(hi),
                "max_ratio_eps_ge_1": hi_big and hi_big["ratio"],
                "max_ratio_eps_ge_1_cell": hi_big and _cell_text(hi_big),
                "findings": len(findings),
                "unresolved": sum(bool(r.get("unresolved")) for r in ok),
                "worst_finding": worst and _finding_text(worst),
                "widest_finding": widest and _finding_text(widest),
                "reasons": reasons,
            }
        )
    return out


def _reason_kind(reason: str) -> str:
    """A refusal's reason without its numbers, so that like refusals count together."""
    if "exceeds this benchmark's cap" in reason:
        return reason.split(" of ")[0] + " over the benchmark's memory cap"
    if "is not installed" in reason:
        return "extra not installed"
    return short_text(reason.split(":")[0] + ": " + reason.split(":", 1)[-1].split(".")[0], 90)


_LOWER = {
    "exact": "import math, dp_accounting\n"
    "print(dp_accounting.get_epsilon_gaussian({sigma} / math.sqrt({steps}), {delta}))"
    "  # exact ε (q = 1)",
    "pld": "from dp_accounting.pld import privacy_loss_distribution as pld\n"
    "low = pld.from_gaussian_mechanism({sigma}, sampling_prob={q}, pessimistic_estimate=False,\n"
    "    use_connect_dots=False, value_discretization_interval={h})"
    "{compose}\n"
    "print(low.get_epsilon_for_delta({delta}))  # a lower bound on the true ε",
}
_LIBRARY = {
    ("opacus", "rdp"): "from opacus.accountants import RDPAccountant\nacc = RDPAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}))",
    ("opacus", "prv"): "from opacus.accountants import PRVAccountant\nacc = PRVAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}))",
    ("opacus", "gdp"): "from opacus.accountants import GaussianAccountant\n"
    "acc = GaussianAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}, poisson=True))",
    ("flwr", "rdp"): "from flwr.serverapp import (GaussianPrivacyEvent, NeighboringRelation,\n"
    "    PrivacyConfig, RdpAccountant, SamplingMethod)\n"
    "cfg = PrivacyConfig({delta}, {pop}, NeighboringRelation.ADD_OR_REMOVE_ONE,\n"
    "    SamplingMethod.{sampling})\n"
    "acc = RdpAccountant(cfg)\nacc.compose(GaussianPrivacyEvent({sigma}, {m}, {pop}), count={steps})\n"
    "print(acc.get_epsilon({delta}))",
    ("flwr", "localdp"): "import math  # flwr LocalDpMod(clipping_norm, sensitivity=1, epsilon, "
    "delta={delta}) adds\n"
    "# noise of std sqrt(2 ln(1.25/δ))/ε (flwr/clientapp/mod/localdp_mod.py): std {sigma} is "
    "claimed as\n"
    "print(math.sqrt(2 * math.log(1.25 / {delta})) / {sigma})",
    ("pfl", "pld"): "from pfl.privacy import PLDPrivacyAccountant\n"
    "print(PLDPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("pfl", "prv"): "from pfl.privacy import PRVPrivacyAccountant\n"
    "print(PRVPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("pfl", "rdp"): "from pfl.privacy import RDPPrivacyAccountant\n"
    "print(RDPPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("fedlora-audit", "pld"): "from fl.privacy.accounting import epsilon\n"
    "print(epsilon({sigma}, {q}, {steps}, {delta}, 'pld'))",
    ("fedlora-audit", "rdp"): "from fl.privacy.accounting import epsilon\n"
    "print(epsilon({sigma}, {q}, {steps}, {delta}, 'rdp'))",
}


def reproduction(r: dict) -> str:
    """A few lines of Python that print the library's ε and the reference lower bound."""
    v = dict(
        sigma=r["sigma"],
        q=r["q"],
        steps=r["steps"],
        delta=r["delta"],
        h=r.get("h_optimistic"),
        pop=FLWR_POPULATION,
        m=round(r["q"] * FLWR_POPULATION),
        sampling="POISSON" if r["q"] < 1 else "NO_AMPLIFICATION",
        compose="" if r["steps"] == 1 else f".self_compose({r['steps']})",
    )
    lib = _LIBRARY[(r["library"], r["accountant"])].format(**v)
    low = _LOWER[r["reference"]].format(**v)
    return f"{lib}  # library: {r['epsilon']:.6g}\n{low}  # {r['pld_optimistic']:.6g}"


def table(meta: dict, summary: list[dict]) -> str:
    lines = [
        "# Library accountants checked against dp-accounting's PLD",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']}",
        f"- date: {meta['date']}",
        f"- commit: {meta['commit']}{' (with uncommitted changes)' if meta.get('dirty') else ''}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        f"- grid: σ ∈ {list(meta['grid']['sigmas'])}, q ∈ {list(meta['grid']['qs'])}, "
        f"steps ∈ {list(meta['grid']['steps'])}, δ ∈ {list(meta['grid']['deltas'])} "
        f"({meta['cells_per_accountant']} cells per accountant)",
        f"- wall time: {meta['wall_s']:.0f} s",
        "",
        f"Criterion: **finding** = library ε < PLD optimistic ε (a lower bound on the true ε) − "
        f"{REL_TOL:g}·max(1, ε_opt). ratio = library ε / PLD pessimistic ε (an upper bound; h = "
        f"{H_REF:g} or finer, coarser only above {PLD_MAX_POINTS:.0e} points); q = 1 is "
        "referenced to the exact Gaussian ε(δ) of σ/√steps. 'unresolved': below the upper "
        "bound, above the lower bound. 'skipped': the library would build a PRV domain or PLD "
        "over this benchmark's memory cap. min/max ratio leave out cells whose reference ε is 0; "
        f"near ε = 0 an additive slack gives any ratio, hence the column at ε_PLD ≥ "
        f"{EPS_MEANINGFUL:g}.",
        "",
        "| library | accountant | version | compared | refused | skipped | n/a | min ratio "
        "(cell) | max ratio (cell) | max ratio where ε_PLD ≥ 1 (cell) | ε = ∞ | findings "
        "| unresolved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['library']} | {s['accountant']} | {meta['accountant_versions'][s['library'] + '/' + s['accountant']]} "
            f"| {s['compared']} | {s['refused']} | {s['skipped']} | {s['not_applicable']} "
            f"| {_fmt(s['min_ratio'])} ({s['min_ratio_cell'] or '–'}) "
            f"| {_fmt(s['max_ratio'])} ({s['max_ratio_cell'] or '–'}) "
            f"| {_fmt(s['max_ratio_eps_ge_1'])} ({s['max_ratio_eps_ge_1_cell'] or '–'}) "
            f"| {s['infinite']} "
            f"| **{s['findings']}** | {s['unresolved']} |"
        )
    lines += ["", "## Refused and skipped cells", ""]
    for s in summary:
        for k, n in s["reasons"].items():
            lines.append(f"- {s['library']}/{s['accountant']}: {n} × {k}")
    lines += ["", "## Findings (understatements), the worst of each accountant", ""]
    any_finding = False
    for s in summary:
        w = s["worst_finding"]
        if not w:
            continue
        any_finding = True
        v = s["widest_finding"]
        lines += [
            f"### {s['library']}/{s['accountant']}: {s['findings']} cells",
            "",
            f"Worst by ratio, at {w['cell']}: library ε = {w['epsilon']:.6g}, PLD lower bound "
            f"{w['pld_optimistic']:.6g}, upper bound {w['pld_pessimistic']:.6g} (library / "
            f"lower = {_fmt(w['ratio_to_lower'])}). Largest gap, at {v['cell']}: library ε = "
            f"{v['epsilon']:.6g} against a lower bound of {v['pld_optimistic']:.6g} "
            f"({v['gap']:.4g} below).",
            "",
            "```python",
            w["reproduction"],
            "```",
            "",
        ]
    if not any_finding:
        lines.append("None.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main
