"""The report's "Library audits" section (``fedlora report --library-audit DIR``): real DP
libraries (Opacus, the Hugging Face Trainer recipe, Flower, pfl) audited end to end by
:mod:`audit.libraries`, one row per audited training beside the toolkit's own runs.

The rows are :func:`audit.libraries.results.read_library_audits`'s (per-run JSON files
written by :func:`audit.libraries.results.save_result`, or the benchmark's
``results.json``). One table per library and version (its verdict counts above it): mode,
kind, ε claimed / recomputed / certified lower bound / noise-implied, conformance with the
noise's observed/claimed ratio, the findings' codes, the verdict (and what was expected,
for the benchmark's rows); below it what the audits did not test, modes that share a text
joined. The tables have more than :data:`audit.report.document.STACK_COLUMNS` columns, so
on a phone they become one card per row like the runs' verdict table. The headline counts
the verdicts (:func:`library_headline`)."""

from __future__ import annotations

from collections import Counter

from audit.libraries.results import read_library_audits
from audit.report.document import BulletList, Paragraph, Section, Strong, Table
from audit.report.document import format_cell as _fmt

__all__ = ["LIBRARY_COLUMNS", "library_headline", "library_section", "read_all"]

#: row key -> column header (``expected`` only when a row has one); one table per library,
#: its name and version above it, what was not tested in a list below it
LIBRARY_COLUMNS = {
    "mode": "mode",
    "kind": "case",
    "verdict": "verdict",
    "claimed_epsilon": "ε claimed",
    "recomputed_epsilon": "ε recomputed",
    "epsilon_lower_bound": "ε lower bound",
    "implied_epsilon": "implied ε",
    "conformance": "conformance (noise ratio)",
    "findings": "findings",
}


def read_all(paths: list[str]) -> dict:
    """Every ``--library-audit`` folder or file read and checked before anything is written:
    ``{"rows", "undetectable", "files"}`` joined in the order given."""
    out: dict = {"rows": [], "undetectable": [], "files": [], "commands": []}
    for p in paths:
        doc = read_library_audits(p)
        for k in out:
            out[k] += doc[k]
    return out


def _eps(x, at_least: bool = False) -> str:
    if x is None:
        return "–"
    return ("≥ " if at_least else "") + _fmt(x, 3)


def _cells(r: dict, with_expected: bool) -> list:
    ratio = "" if r["noise_ratio"] is None else f" ({_fmt(r['noise_ratio'], 3)})"
    cells = {
        "mode": r["mode"],
        "kind": (r["kind"] or "–") + (f": {r['what']}" if r.get("what") else ""),
        "claimed_epsilon": _eps(r["claimed_epsilon"]),
        "recomputed_epsilon": _eps(r["recomputed_epsilon"], r["recomputed_at_least"]),
        "epsilon_lower_bound": _eps(r["epsilon_lower_bound"]),
        "implied_epsilon": _eps(r["implied_epsilon"], r["implied_at_least"]),
        "conformance": r["conformance"] + ratio,
        "findings": ", ".join(dict.fromkeys(r["findings"])) or "none",
        "verdict": r["verdict"]
        + (
            ""
            if not (with_expected and r.get("expected"))
            else " (as expected)"
            if r["verdict"] == r["expected"]
            else f" (expected {r['expected']})"
        ),
    }
    return [cells[k] for k in LIBRARY_COLUMNS]


def _untested(rows: list[dict]) -> list[tuple[str, str]]:
    """(modes, what was not tested) with the modes that share a text joined."""
    by_text: dict[str, list[str]] = {}
    for r in rows:
        for t in r["untested"]:
            by_text.setdefault(t, []).append(r["mode"])
    return [(", ".join(dict.fromkeys(m)), t) for t, m in by_text.items()]


def library_headline(rows: list[dict]) -> str:
    """``library audits: 6 pass, 3 fail`` (and, where the rows say what was expected,
    ``; 9 of 9 as expected``)."""
    n = Counter(r["verdict"] for r in rows)
    text = f"library audits: {n['pass']} pass, {n['fail']} fail"
    known = [r for r in rows if r.get("expected")]
    if known:
        same = sum(r["verdict"] == r["expected"] for r in known)
        text += f" ({same} of {len(known)} as expected)"
    return text


def library_section(doc: dict, summary: dict) -> Section:
    """The section of the rows in ``doc`` (:func:`read_all`); fills ``summary
    ["library_audits"]`` (the rows, the counts)."""
    rows = doc["rows"]
    sec = Section("Library audits")
    with_expected = any(r.get("expected") for r in rows)
    headers = list(LIBRARY_COLUMNS.values())
    sec.add(
        Paragraph.of(
            "DP libraries audited end to end (fedlora-audit's audit.libraries): canary records "
            "take the library's own sampler, clipping, aggregation and noise, and each "
            "training's audit checks its claim against what the run used (σ, C, q, steps, "
            "sampling: a mismatch is a finding), recomputes ε for the run's mechanism, tests "
            "the noise at the canaries (conformance, Holm-corrected) and bounds ε from below "
            "from one run. Here " + library_headline(rows).removeprefix("library audits: ") + "."
        ),
        Paragraph.of(
            "ε in nats at the claim's δ: claimed (what a user of the library writes), "
            "recomputed (dp-accounting's PLD for the mechanism the run used; ≥: at a σ floor, a "
            "lower bound), the certified one-run lower bound, and the noise-implied ε (the "
            "run's mechanism at the noise scale the conformance tests observed, conditional on "
            "Gaussian noise, not certified). In brackets beside the conformance, the smallest "
            "scale-test ratio of observed to claimed noise. Below each table, the parts of the "
            "mechanism the canaries could not travel through (the audit says which). Verdict "
            "fail: at least one error finding, exit code 1; a benchmark row says whether that "
            "was expected."
        ),
    )
    libs: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        libs.setdefault((r["library"], r["version"] or "–"), []).append(r)
    for (lib, version), rs in libs.items():
        sec.add(
            Paragraph.of(Strong(f"{lib} {version}"), f": {library_headline(rs).split(': ')[1]}"),
            Table.of(headers, [_cells(r, with_expected) for r in rs]),
        )
        missed = _untested(rs)
        if missed:
            sec.add(BulletList.of((Strong(f"not tested ({m})"), f": {t}") for m, t in missed))
    wrong = [r for r in rows if r.get("expected") and r["verdict"] != r["expected"]]
    if wrong:
        sec.add(
            Paragraph.of(
                Strong("Not as expected: "),
                ", ".join(f"{r['library']} {r['mode']} ({r['verdict']})" for r in wrong) + ".",
            )
        )
    if doc["undetectable"]:
        sec.add(
            Paragraph.of("Misuses no audit of the release can see, with the reason:"),
            BulletList.of(
                (Strong(f"{u['library'] or ''} {u['misuse']}".strip()), f": {u['reason']}")
                for u in doc["undetectable"]
            ),
        )
    sec.add(Paragraph.of("Read from: " + ", ".join(doc["files"]) + "."))
    summary["library_audits"] = {
        "rows": rows,
        "pass": sum(r["verdict"] == "pass" for r in rows),
        "fail": sum(r["verdict"] == "fail" for r in rows),
        "files": list(doc["files"]),
    }
    return sec
