"""The report's "Library audits" section (``fedlora report --library-audit DIR``): real DP
libraries (Opacus, the Hugging Face Trainer recipe, Flower, pfl) audited end to end by
:mod:`audit.libraries`, one row per audited training beside the toolkit's own runs.

The rows are :func:`audit.libraries.results.read_library_audits`'s (per-run JSON files
written by :func:`audit.libraries.results.save_result`, or the benchmark's
``results.json``). One table per library and version (its verdict counts above it): mode,
kind, ε claimed / recomputed / certified lower bound / noise-implied, conformance with the
noise's observed/claimed ratio, the neighbour replay, the findings' codes, the verdict
(``pass``, ``incomplete`` with the parts of the mechanism left untested, ``fail``; and what
was expected, for the benchmark's rows); below it what the audits did not test, modes that
share a text joined. The tables have more than :data:`audit.report.document.STACK_COLUMNS`
columns, so on a phone they become one card per row like the runs' verdict table; on a
laptop (1366 px) they fit the page without scrolling sideways. The headline counts the
verdicts (:func:`library_headline`); a report of library audits alone opens on them
(:func:`library_overview`, in the Verdict section)."""

from __future__ import annotations

from collections import Counter

from audit.libraries.results import read_library_audits
from audit.report.document import BulletList, Paragraph, Section, Strong, Table
from audit.report.document import format_cell as _fmt

__all__ = [
    "LIBRARY_COLUMNS",
    "library_headline",
    "library_overview",
    "library_section",
    "read_all",
    "replay_cell",
    "verdict_cell",
]

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
    "replay": "replay",
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


def untested_parts(r: dict) -> list[str]:
    """The parts of the mechanism (:data:`audit.coverage.PARTS`) a row left untested,
    from its coverage (none known without one)."""
    return list((r.get("coverage") or {}).get("untested") or [])


def verdict_cell(r: dict, with_expected: bool = False) -> str:
    """``pass``, ``incomplete: clipping, sampling untested``, ``fail``; with what was
    expected where the row says (``(as expected)``, ``(expected pass)``)."""
    v = r["verdict"]
    if v == "incomplete":
        parts = untested_parts(r)
        v += f": {', '.join(parts)} untested" if parts else " (see not tested)"
    if with_expected and r.get("expected"):
        v += " (as expected)" if r["verdict"] == r["expected"] else f" (expected {r['expected']})"
    return v


def replay_cell(rep: dict | None) -> str:
    """The neighbour replay in a few words: ``pass: 6 neighbours, 240 releases``, ``fail:
    sensitivity_exceeded``, ``not run``; ``–`` where the row has none."""
    if rep is None:
        return "–"
    if rep["verdict"] == "pass":
        return f"pass: {rep['neighbours']} neighbours, {rep['releases']} releases"
    if rep["verdict"] == "fail":
        return "fail: " + ", ".join(dict.fromkeys(rep["findings"]))
    return "not run"


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
        "replay": replay_cell(r.get("replay")),
        "findings": ", ".join(dict.fromkeys(r["findings"])) or "none",
        "verdict": verdict_cell(r, with_expected),
    }
    return [cells[k] for k in LIBRARY_COLUMNS]


def _untested(rows: list[dict]) -> list[tuple[str, str]]:
    """(modes, what was not tested) with the modes that share a text joined."""
    by_text: dict[str, list[str]] = {}
    for r in rows:
        cov = r.get("coverage") or {}
        for part in cov.get("untested") or []:
            why = (cov.get("why") or {}).get(part)
            by_text.setdefault(f"{part} untested" + (f": {why}" if why else ""), []).append(
                r["mode"]
            )
        for t in r["untested"]:
            by_text.setdefault(t, []).append(r["mode"])
        rep = r.get("replay") or {}
        if rep.get("verdict") == "not run" and rep.get("reason"):
            by_text.setdefault(f"neighbour replay not run: {rep['reason']}", []).append(r["mode"])
    return [(", ".join(dict.fromkeys(m)), t) for t, m in by_text.items()]


def _counts(rows: list[dict]) -> str:
    """``6 pass, 2 incomplete, 3 fail`` (incomplete named only when there is one)."""
    n = Counter(r["verdict"] for r in rows)
    inc = f"{n['incomplete']} incomplete, " if n["incomplete"] else ""
    return f"{n['pass']} pass, {inc}{n['fail']} fail"


def library_headline(rows: list[dict]) -> str:
    """``library audits: 6 pass, 2 incomplete, 3 fail`` (incomplete named when there is
    one; and, where the rows say what was expected, ``(11 of 11 as expected)``)."""
    text = f"library audits: {_counts(rows)}"
    known = [r for r in rows if r.get("expected")]
    if known:
        same = sum(r["verdict"] == r["expected"] for r in known)
        text += f" ({same} of {len(known)} as expected)"
    return text


def library_overview(doc: dict) -> list:
    """What the Verdict section shows when the report holds library audits only: the
    verdicts per library and version (pass / incomplete / fail, as expected), and the
    audits that did not pass, by name (a benchmark's row only when not as expected); the
    Library audits section below has every row."""
    rows = doc["rows"]
    libs: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        libs.setdefault((r["library"], r["version"] or "–"), []).append(r)
    with_expected = any(r.get("expected") for r in rows)
    headers = ["library", "version", "audits", "pass", "incomplete", "fail"]
    headers += ["as expected"] if with_expected else []
    table = []
    for (lib, version), rs in libs.items():
        n = Counter(r["verdict"] for r in rs)
        cells = [lib, version, len(rs), n["pass"], n["incomplete"], n["fail"]]
        if with_expected:
            known = [r for r in rs if r.get("expected")]
            same = sum(r["verdict"] == r["expected"] for r in known)
            cells.append(f"{same} of {len(known)}" if known else "–")
        table.append(cells)
    blocks: list = [
        Paragraph.of(
            "DP libraries' trainings audited end to end: "
            + _counts(rows)
            + ". Pass: every part of the mechanism (sampling, clipping, noise, accounting) "
            "tested and nothing found; incomplete (exit 4): nothing found, but a part "
            "untested; fail (exit 1): an error finding. Every row is in the Library audits "
            "section below."
        ),
        Table.of(headers, table),
    ]
    # by name: what did not pass, except the benchmark's rows that failed as expected
    notable = [
        r
        for r in rows
        if r["verdict"] != "pass" and not (r.get("expected") and r["verdict"] == r["expected"])
    ]
    if notable:
        blocks.append(
            BulletList.of(
                (
                    Strong(f"{r['library']} {r['mode']}"),
                    ": "
                    + verdict_cell(r, with_expected)
                    + (f" ({', '.join(dict.fromkeys(r['findings']))})" if r["findings"] else ""),
                )
                for r in notable
            )
        )
    return blocks


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
            "scale-test ratio of observed to claimed noise. Replay: the neighbour replay (the "
            "training run again on neighbouring datasets with every random draw frozen, each "
            "noise call's input compared: a violation is certain; a pass covers the "
            "neighbours and releases tried), – where none was recorded. Below each table, the "
            "parts of the mechanism the audit could not test, and why. Verdict pass (exit 0): "
            "every part of the mechanism — sampling, clipping, noise, accounting — tested, "
            "nothing found; incomplete (exit 4): nothing found, but the parts named untested; "
            "fail (exit 1): at least one error finding. A benchmark row says whether its "
            "verdict was expected."
        ),
    )
    libs: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        libs.setdefault((r["library"], r["version"] or "–"), []).append(r)
    for (lib, version), rs in libs.items():
        sec.add(
            Paragraph.of(Strong(f"{lib} {version}"), f": {_counts(rs)}"),
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
        "incomplete": sum(r["verdict"] == "incomplete" for r in rows),
        "fail": sum(r["verdict"] == "fail" for r in rows),
        "files": list(doc["files"]),
    }
    return sec
