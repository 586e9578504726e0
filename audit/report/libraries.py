"""The report's "Library audits" section (``fedlora report --library-audit DIR``): real DP
libraries (Opacus; Flower, pfl, the Hugging Face Trainer as their audits land) audited end
to end by :mod:`audit.libraries`, one row per audited training beside the toolkit's own runs.

The rows are :func:`audit.libraries.results.read_library_audits`'s (per-run JSON files
written by :func:`audit.libraries.results.save_result`, or the benchmark's
``results.json``): library, version, mode, kind, ε claimed / recomputed / certified lower
bound / noise-implied, conformance, the noise's observed/claimed ratio, the findings' codes,
what the audit did not test, the verdict. The table has more than
:data:`audit.report.document.STACK_COLUMNS` columns, so on a phone it becomes one card per
row like the runs' verdict table. The headline counts the verdicts
(:func:`library_headline`)."""

from __future__ import annotations

from collections import Counter

from audit.libraries.results import read_library_audits
from audit.report.document import BulletList, Paragraph, Section, Strong, Table
from audit.report.document import format_cell as _fmt

__all__ = ["LIBRARY_COLUMNS", "library_headline", "library_section", "read_all"]

#: row key -> column header (``expected`` only when a row has one)
LIBRARY_COLUMNS = {
    "library": "library",
    "version": "version",
    "mode": "mode",
    "kind": "kind",
    "claimed_epsilon": "ε claimed",
    "recomputed_epsilon": "ε recomputed (the run's mechanism)",
    "epsilon_lower_bound": "empirical ε lower bound (one run)",
    "implied_epsilon": "noise-implied ε",
    "conformance": "conformance",
    "noise_ratio": "noise observed/claimed",
    "findings": "findings",
    "untested": "not tested",
    "verdict": "verdict",
    "expected": "expected",
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
    cells = {
        "library": r["library"],
        "version": r["version"] or "–",
        "mode": r["mode"] + (f" ({r['what']})" if r.get("what") else ""),
        "kind": r["kind"] or "–",
        "claimed_epsilon": _eps(r["claimed_epsilon"]),
        "recomputed_epsilon": _eps(r["recomputed_epsilon"], r["recomputed_at_least"]),
        "epsilon_lower_bound": _eps(r["epsilon_lower_bound"]),
        "implied_epsilon": _eps(r["implied_epsilon"], r["implied_at_least"]),
        "conformance": r["conformance"],
        "noise_ratio": "–" if r["noise_ratio"] is None else _fmt(r["noise_ratio"], 3),
        "findings": ", ".join(dict.fromkeys(r["findings"])) or "none",
        "untested": "; ".join(r["untested"]) or "–",
        "verdict": r["verdict"],
        "expected": r.get("expected") or "–",
    }
    return [cells[k] for k in LIBRARY_COLUMNS if with_expected or k != "expected"]


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
    headers = [h for k, h in LIBRARY_COLUMNS.items() if with_expected or k != "expected"]
    sec.add(
        Paragraph.of(
            "DP libraries audited end to end (fedlora-audit's audit.libraries): canary records "
            "take the library's own sampler, clipping, aggregation and noise, and each "
            "training's audit checks its claim against what the run used (σ, C, q, steps, "
            "sampling: a mismatch is a finding), recomputes ε for the run's mechanism, tests "
            "the noise at the canaries (conformance, Holm-corrected) and bounds ε from below "
            "from one run. Here " + library_headline(rows).removeprefix("library audits: ") + "."
        ),
        Table.of(headers, [_cells(r, with_expected) for r in rows]),
        Paragraph.of(
            "ε in nats at the claim's δ. ≥: a lower bound (ε recomputed at a σ floor). The "
            "noise-implied ε is the run's mechanism at the noise scale the conformance tests "
            "observed (conditional on Gaussian noise, not certified); noise observed/claimed "
            "is the smallest scale-test ratio. Not tested: the parts of the mechanism the "
            "canaries could not travel through (the audit says which). Verdict fail: at least "
            "one finding, exit code 1."
        ),
    )
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
