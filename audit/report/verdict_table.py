"""The verdict table and the privacy figure of a report: one row per run (utility, ε
claimed and recomputed, the certified lower bound, conformance and the noise-implied ε, the
strongest attack, findings, the verdict) and the one-line headline above it. Split from
:mod:`audit.report.build`, which assembles the document."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from audit.findings import Finding
from audit.report.analyses import figure_paragraph
from audit.report.document import Paragraph, Section, Table, save_figure
from audit.report.document import format_cell as _fmt
from audit.report.empirical import best_bound
from audit.report.figures import implied_epsilon, num, privacy_figure
from audit.report.verdict import CHANCE_BALANCED, Evidence, findings_summary, verdict

__all__ = [
    "VERDICT_COLUMNS",
    "conformance_cell",
    "empirical_cell",
    "headline",
    "implied_cell",
    "parse_eps",
    "privacy_points",
    "run_conformance",
    "run_verdict",
    "strongest_attack",
    "verdict_section",
]


def parse_eps(v):
    if v in ("inf", "Infinity"):
        return math.inf
    return v


def verdict_kind(v: str) -> str:
    """A verdict's kind, its words before the first ``(``, ``;`` or ``:``."""
    return re.split(r" \(|;|:", v, maxsplit=1)[0].strip()


def headline(rows: list[dict]) -> str:
    """The line under the report's title: the verdicts counted by kind, and the runs at
    chance-level utility (``6 runs: 5 private as claimed, 1 no DP claimed; 2 at chance``)."""
    kinds = Counter(verdict_kind(r.get("verdict") or "no verdict") for r in rows)
    chance = sum(
        1
        for r in rows
        if isinstance(r.get("balanced_accuracy"), int | float)
        and r["balanced_accuracy"] <= CHANCE_BALANCED
    )
    n = len(rows)
    text = f"{n} run{'s' if n != 1 else ''}: " + ", ".join(f"{c} {k}" for k, c in kinds.items())
    if chance:
        text += f"; {chance} with utility at chance (balanced accuracy ≤ {CHANCE_BALANCED})"
    return text + "."


def strongest_attack(row: dict) -> tuple[str, dict] | None:
    """The attack with the highest AUC in the run's attacks.json, ``(name, result)``."""
    att = (row.get("attacks") or {}).get("attacks") or {}
    done = [(n, a) for n, a in att.items() if isinstance(a, dict) and "auc" in a]
    return max(done, key=lambda na: na[1]["auc"], default=None)


def with_ci(x, ci) -> str:
    if x is None:
        return "–"
    return f"{_fmt(x, 3)} [{_fmt(ci[0], 3)}, {_fmt(ci[1], 3)}]" if ci else _fmt(x, 3)


def utility_cell(r: dict) -> str:
    parts = [
        f"{label} {_fmt(r[k], 3)}"
        for k, label in (("accuracy", "acc."), ("balanced_accuracy", "bal. acc."))
        if r.get(k) is not None
    ]
    if r.get("perplexity") is not None:
        parts.append(f"test ppl {_fmt(r['perplexity'], 4)}")
    return " · ".join(parts) or "–"


def empirical_cell(bound: dict | None) -> str:
    """The verdict table's certified lower bound: the one the claim is tested with, then
    Steinke et al.'s and the f-DP one side by side (each certified on its own)."""
    if not bound:
        return "–"
    cell = f"[{_fmt(bound['epsilon_lb'], 3)}, ∞) at {1 - bound['alpha']:.0%}"
    if bound.get("fdp") is not None:
        cell += (
            f" (Steinke {_fmt(bound['steinke'], 3)}, f-DP {_fmt(bound['fdp'], 3)}; "
            f"each at {1 - bound['alpha']:.0%})"
        )
    return f"{cell} · {bound['source']}"


def run_conformance(r: dict) -> dict | None:
    """The run audit's conformance result (sample level: the gradient and sampler canaries';
    client level: the canary clients'), or None when none was run."""
    one = (r.get("audit") or {}).get("one_run") or {}
    c = one.get("conformance") or (one.get("canary_clients") or {}).get("conformance")
    if c is None and one.get("kind") == "canary_clients":
        c = one.get("conformance")
    return c if isinstance(c, dict) and c.get("tests") is not None else None


def rejected_text(c: dict, key: str = "rejected") -> str | None:
    """The first rejected test in words: ``head scale: noise 0.11× claimed [0.10, 0.12]``
    (``key="weak"``: the first test rejected only at the warning level)."""
    for t in c.get("tests") or []:
        if not t.get(key):
            continue
        what = f"{t['group']} {t['test']}"
        if t.get("observed_over_claimed") is not None and t["test"] in ("scale", "fresh"):
            lo, hi = t.get("ratio_ci") or (None, None)
            ci = f" [{_fmt(lo, 2)}, {_fmt(hi, 2)}]" if lo is not None else ""
            return f"{what}: noise {_fmt(t['observed_over_claimed'], 2)}× claimed{ci}"
        if t["test"] == "clip":
            return f"{what}: a canary adds more than C"
        if t["test"] == "contribution":
            est = t.get("statistic")
            got = f" ({_fmt(est, 2)}·C)" if isinstance(est, int | float) else ""
            return f"{what}: a drawn canary does not add exactly C{got}"
        if t["test"] == "sampling":
            return f"{what}: the batches are not Poisson-sampled"
        return what
    return None


def conformance_cell(c: dict | None) -> str:
    if c is None:
        return "–"
    if c.get("passed"):
        n = len(c.get("tests") or [])
        cell = f"pass ({n} tests, Holm α = {c.get('alpha', 0.05):g})"
        weak = rejected_text(c, "weak")
        if weak:
            cell += f"; weak evidence at α = {c.get('warn_alpha'):g}: {weak}"
        return cell
    more = len(c.get("rejected") or []) - 1
    return (rejected_text(c) or "rejected") + (f" (+{more} more)" if more > 0 else "")


def implied_cell(c: dict | None) -> str:
    if c is None or c.get("implied_epsilon") is None:
        return "–"
    ge = "≥ " if c.get("implied_epsilon_at_least") else ""
    return f"{ge}{_fmt(c['implied_epsilon'], 3)}"


def run_untested(a: dict) -> tuple[str, ...]:
    """The parts of the mechanism a run audit left untested (its ``coverage``, when it
    records one: :meth:`audit.coverage.Coverage.to_dict`); () when it records none."""
    cov = a.get("coverage") if isinstance(a, dict) else None
    if not isinstance(cov, dict):
        return ()
    return tuple(str(p) for p in cov.get("untested") or [] if isinstance(p, str))


def replay_cell(rep: dict | None, dp: bool) -> str:
    """The replay column: ``pass (2 neighbours × 90 releases, largest ‖Δq‖/bound 1.000)``,
    the violation, ``not run`` or ``–`` without DP."""
    if not dp:
        return "–"
    if rep is None:
        return "not run"
    if rep.get("verdict") == "not read":
        return f"not read: {rep.get('error')}"
    from audit.replay.engine import summary_line

    try:
        line = summary_line(rep)
    except (KeyError, TypeError):
        return str(rep.get("verdict"))
    bad = [f["code"] for f in rep.get("findings", []) if f.get("severity") == "error"]
    return line + (f": {', '.join(dict.fromkeys(bad))}" if bad else "")


def run_verdict(r: dict) -> dict:
    """The verdict row's cells for one run (strings), and the verdict itself."""
    a = r.get("audit") or {}
    rep = r.get("replay") if isinstance(r.get("replay"), dict) else None
    # the neighbour replay's findings (a violation is an error) count like the audit's
    found = list(a.get("findings") or []) + list((rep or {}).get("findings") or [])
    findings = tuple(Finding.from_dict(f) for f in found)
    bound = best_bound(r)
    conf = run_conformance(r)
    ev = Evidence(
        dp_claimed=r.get("level") not in (None, "none"),
        epsilon_claimed=r.get("epsilon_claimed"),
        epsilon_recomputed=parse_eps(a.get("epsilon_pld")),
        understated=bool(a.get("understated")),
        findings=findings,
        audit_error=a.get("error") if r.get("audit") is not None else "audit not available",
        empirical_lb=bound["epsilon_lb"] if bound else None,
        alpha=bound["alpha"] if bound else 0.05,
        empirical_limit=bound.get("limit") if bound else None,
        empirical_exceeds=bound.get("exceeds") if bound else None,
        balanced_accuracy=r.get("balanced_accuracy"),
        mismatch=rejected_text(conf) if conf and not conf.get("passed") else None,
        implied_epsilon=conf.get("implied_epsilon") if conf else None,
        implied_at_least=bool(conf.get("implied_epsilon_at_least")) if conf else False,
        untested=run_untested(a),
    )
    strongest = strongest_attack(r)
    name, att = strongest if strongest else ("", {})
    ci = att.get("ci") or {}
    return {
        "run": r["run"],
        "utility": utility_cell(r),
        "epsilon_claimed": r.get("epsilon_claimed") if ev.dp_claimed else "no DP",
        "epsilon_recomputed": ev.epsilon_recomputed,
        "empirical": empirical_cell(bound),
        "conformance": conformance_cell(conf),
        "replay": replay_cell(rep, ev.dp_claimed),
        "implied": implied_cell(conf),
        "auc": f"{with_ci(att.get('auc'), ci.get('auc'))} · {name}" if att else "–",
        "tpr": with_ci(
            (att.get("tpr_at_fpr") or {}).get("0.01"), (ci.get("tpr_at_fpr") or {}).get("0.01")
        ),
        "findings": findings_summary(findings),
        "verdict": verdict(ev),
    }


VERDICT_COLUMNS = {
    "run": "run",
    "utility": "utility",
    "epsilon_claimed": "ε claimed",
    "epsilon_recomputed": "ε recomputed (ledger)",
    "empirical": "empirical ε lower bound",
    "conformance": "conformance (does the run implement its claim?)",
    "replay": "neighbour replay (‖q(D) − q(D′)‖ ≤ bound at every release?)",
    "implied": "noise-implied ε (if Gaussian at the observed scale)",
    "auc": "strongest attack: AUC [95% CI]",
    "tpr": "TPR at 1% FPR [95% CI]",
    "findings": "audit findings",
    "verdict": "verdict",
}


def privacy_points(rows: list[dict]) -> list[dict]:
    """What the privacy figure shows of each run: ``run``, ``dp`` (a DP claim),
    ``claimed``, ``recomputed``, ``implied``, ``lb`` and ``alpha`` (the certified lower
    bound the verdict uses, :func:`audit.report.empirical.best_bound`), ``limit`` (what the
    claim lets the bound reach when that is not the recomputed ε: 2ε at client level),
    ``balanced_accuracy``, ``accuracy``, ``perplexity``; None where unknown."""
    out = []
    for r in rows:
        a = r.get("audit") if isinstance(r.get("audit"), dict) else {}
        bound = best_bound(r) or {}
        dp = r.get("level") not in (None, "none")
        recomputed = num(a.get("epsilon_pld")) if dp else None
        limit = num(bound.get("limit"))
        out.append(
            {
                "run": r["run"],
                "dp": dp,
                "claimed": num(r.get("epsilon_claimed")) if dp else None,
                "recomputed": recomputed,
                "implied": implied_epsilon(a),
                "lb": num(bound.get("epsilon_lb")),
                "alpha": bound.get("alpha"),
                # what one canary may reach when not the recomputed ε (client level: 2ε)
                "limit": limit if limit is not None and limit != recomputed else None,
                "balanced_accuracy": num(r.get("balanced_accuracy")),
                "accuracy": num(r.get("accuracy")),
                "perplexity": num(r.get("perplexity")),
            }
        )
    return out


def verdict_section(rows: list[dict], figdir: Path, summary: dict) -> Section:
    """The verdict table, then the privacy figure, then what both show."""
    sec = Section("Verdict")
    cells = [run_verdict(r) for r in rows]
    for r, c in zip(rows, cells):
        r["verdict"] = c["verdict"]
    sec.add(Table.of(VERDICT_COLUMNS.values(), [[c[k] for k in VERDICT_COLUMNS] for c in cells]))
    points = summary["privacy"] = privacy_points(rows)
    fig = privacy_figure(points)
    if fig is not None:
        path = save_figure(fig, figdir / "privacy")[0]
        summary.setdefault("figures", {})["privacy"] = str(path)
        sec.add(figure_paragraph(path, "privacy claimed, recomputed and measured, against utility"))
    sec.add(
        Paragraph.of(
            "ε in nats at the run's δ; recomputed by the run audit from the composed DP "
            "events (fedlora audit RUN). The empirical lower bound is the one-run audit over "
            "the run's canaries (fedlora train --canaries M; gradient canaries: white-box "
            "Dirac canaries in the clipped sums, --canary-kind gradient), a one-sided interval "
            "on the run's true ε at the confidence shown: the larger of Steinke et al.'s bound "
            "and the f-DP one (Mahloujifar et al.), each at half the error, which the verdict "
            "compares with the claim; each of the two, certified on its own, in brackets; – "
            "where the run has none. The attacks' "
            "member / non-member scores give estimates only (Empirical privacy section), "
            "never this bound. The strongest attack is the one with the highest AUC, chosen "
            "after the fact among the run's attacks, so its bootstrap 95% intervals are "
            "optimistic for it. Findings are counted by severity, the errors named; the Runs "
            "section lists them in full."
        )
    )
    if fig is not None:
        implied = any(p["implied"] is not None for p in points)
        sec.add(
            Paragraph.of(
                "The figure has one row per run. Left: ε claimed (the run's manifest), "
                "recomputed from the ledger by the audit, and the certified lower bound of "
                "the one-run canary audit, drawn as its one-sided interval (the run's true ε "
                "lies in it at the confidence shown)"
                + (
                    "; the noise-implied ε is the ledger's ε recomputed with the noise scale "
                    "the conformance tests observed (conditional on Gaussian noise, not a "
                    "certified bound)"
                    if implied
                    else ""
                )
                + ". A claim is contradicted when the bound's interval lies entirely above "
                "what the recomputed ε allows (the verdict's test). Right: the released model's utility on the test set; "
                "balanced accuracy 0.5 is chance."
            )
        )
    return sec
