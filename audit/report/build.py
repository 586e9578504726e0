"""Reports: one self-contained HTML file (figures embedded) and a Markdown twin.

The report is built once as a document model (:mod:`audit.report.document`: sections of
paragraphs, tables, figures) and rendered twice, to HTML and to Markdown.

The report gathers what exists and says plainly what does not: a section whose inputs
were not produced is marked *missing*, never filled with placeholders.

Under the title, one line counts the verdicts. Sections: the verdict (one table, one
row per run: utility, ε claimed and recomputed, the certified empirical ε lower bound
(one-run canary audit), the strongest attack, the audit's findings and a one-line verdict
from :func:`audit.report.verdict.verdict`; then the privacy figure: ε claimed,
recomputed, certified and noise-implied per run beside its utility,
:func:`audit.report.figures.privacy_figure`), runs (method, level, σ, δ, findings,
accuracy per round where a run was evaluated more than once), noise analyses (each
analysis's figure and a few key numbers; the full rows stay in its JSON),
membership-inference attacks (tables, and the ROC curves on log–log axes), optionally
the causal-LM runs' perplexities and the client-level attack
(:mod:`audit.report.lm`, only when a run has them), empirical privacy (the attacks' ε
estimates and the canaries' certified bound vs the claimed ε), the papers' claims check (claim,
setting, measured value, verdict, the figure behind it), environment, and the exact
commands to reproduce every run. DP libraries' audits (``--library-audit``) follow the
verdict table; given alone, the Verdict section is their verdicts per library (pass /
incomplete / fail, :func:`audit.report.libraries.library_overview`) instead of a
*missing* note.
"""

from __future__ import annotations

import os
import platform
import shlex
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path

from audit.findings import Finding
from audit.report.analyses import (  # noqa: F401 (readable, CLAIM_FIGURES re-exported)
    CLAIM_FIGURES,
    analyses_section,
    claims_section,
    figure_paragraph,
    foreign_summary,
    pair_foreign,
    readable,
)
from audit.report.document import (
    BulletList,
    CodeBlock,
    Paragraph,
    Report,
    Section,
    Strong,
    Table,
    copy_figure,
    render_html,
    render_markdown,
    save_figure,
)
from audit.report.document import format_cell as _fmt
from audit.report.empirical import empirical_bounds, empirical_section
from audit.report.figures import (
    accuracy_figure,
    accuracy_series,
    roc_figure,
)
from audit.report.libraries import library_headline, library_overview, library_section, read_all
from audit.report.lm import client_section, lm_section
from audit.report.verdict import CHANCE_BALANCED
from audit.report.verdict_table import (  # noqa: F401 (VERDICT_COLUMNS, run_verdict re-exported)
    VERDICT_COLUMNS,
    headline,
    parse_eps,
    run_verdict,
    strongest_attack,
    verdict_section,
    with_ci,
)
from fl.errors import UsageError
from fl.io import atomic_write_text, read_json
from fl.run import rundir
from fl.run.config import TrainConfig

SECTIONS = (
    "Verdict",
    "Runs",
    "Noise analyses",
    "Membership inference",
    "Empirical privacy",
    "Claims check",
    "Environment",
    "Reproduce",
)
#: what a report cannot show for a release bundle (the operator's files are absent)
BUNDLE_NOT_SHOWN = (
    "the clients sampled in each round and their training losses (operator's metrics.jsonl)",
    "the membership split and the canaries, hence no one-run ε lower bound (operator's "
    "splits.json)",
    "the run's wall time and log (operator's manifest.json and run.log)",
    "attacks against the run's true members (a bundle is attacked with member / non-member "
    "files the attacker supplies: `fedlora attack BUNDLE --members F --nonmembers F`)",
)


def train_command(config: dict, out: str) -> str:
    """The `fedlora train` command line that reproduces a run's configuration."""
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name != "opts"}
    args = ["fedlora", "train"]
    for k, v in config.items():
        if k in ("opts", "progress") or k not in defaults or v == defaults[k]:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            args.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            args += [flag, str(v)]
    for k, v in (config.get("opts") or {}).items():
        args += ["--opt", f"{k}={v}"]
    args += ["--out", out]
    return " ".join(shlex.quote(a) for a in args)


def _run_summary(run_dir: Path) -> dict:
    m = rundir.read_manifest(run_dir)
    priv = m.get("privacy", {})
    bundle = rundir.is_release(m)
    final = m.get("metrics", {}).get("final") or {}
    row = {
        "run": run_dir.name,
        "path": str(run_dir),
        "kind": "bundle" if bundle else "run",
        "method": m.get("method"),
        "level": priv.get("level"),
        "noise_multiplier": priv.get("noise_multiplier"),
        "delta": priv.get("delta"),
        "epsilon_claimed": parse_eps((priv.get("epsilon") or {}).get("pld")),
        "target_epsilon": priv.get("target_epsilon"),
        "accuracy": final.get("accuracy"),
        "balanced_accuracy": final.get("balanced_accuracy"),
        "perplexity": final.get("perplexity", final.get("test_perplexity")),
        "wall_seconds": m.get("wall_seconds"),
        "config": m.get("config", {}),
        "versions": m.get("versions", {}),
        "manifest": m,
    }
    from audit.replay.engine import read_replay

    row["replay"] = None if bundle else read_replay(run_dir)  # fedlora run's (RUN/audit/)
    try:
        from audit.bundle.audit import audit_run

        # the run's canaries (fedlora train --canaries M) give the one-run lower bound
        splits = run_dir / "splits.json"
        canaries = not bundle and splits.is_file() and bool(read_json(splits).get("canaries"))
        try:
            a = audit_run(str(run_dir), one_run=canaries)
        except UsageError:
            if not canaries:
                raise
            a = audit_run(str(run_dir))  # canaries that cannot be scored: the rest stands
        row["audit"] = a
        row["epsilon_recomputed"] = a.get("epsilon_pld")
        row["understated"] = a.get("understated")
    except ImportError:
        row["audit"] = None
    except UsageError as exc:
        row["audit"] = {"error": str(exc)}
    row["metrics"] = rundir.read_metrics(run_dir) or []
    att = run_dir / "attacks" / "attacks.json"
    row["attacks"] = read_json(att) if att.exists() else None
    scores = run_dir / "attacks" / "scores.npz"
    row["scores_path"] = str(scores) if scores.exists() else None
    roc = sorted((run_dir / "attacks").glob("*.png")) if (run_dir / "attacks").is_dir() else []
    # the client-level attack's figures go to its own section (audit.report.lm)
    row["roc_figures"] = [str(p) for p in roc if not p.stem.startswith(("roc_clients", "client_"))]
    cl = run_dir / "attacks" / "clients.json"
    row["clients"] = read_json(cl) if cl.is_file() else None
    return row


def build_report(
    run_dirs: list[str],
    out: str,
    analyses_dir: str | None = None,
    claims: dict | None = None,
    commands: list[str] | None = None,
    title: str = "fedlora-audit report",
    attack_dirs: list[str] | None = None,
    claim_audits: list[str] | None = None,
    library_audits: list[str] | None = None,
) -> dict:
    """Write report.html and report.md into ``out``; returns a summary dict (the
    numbers the report shows, for tests and for `fedlora run`'s final summary).

    Besides run directories and bundles, a report takes what an outside user has
    (:func:`audit.report.analyses.foreign_summary`): ``attack_dirs``, the ``--out``
    folders of ``fedlora attack --adapter ...`` (attacks.json, scores.npz, ROC figures),
    and ``claim_audits``, files holding the JSON of ``fedlora audit --claim FILE --json``;
    the i-th claim audit and the i-th attack folder make one row (the same adapter), extra
    ones a row each.

    ``library_audits``: folders (or files) of DP libraries' audits (:mod:`audit.libraries`:
    per-run JSON files or the benchmark's results.json), shown in a "Library audits"
    section after the runs' verdict and counted in the headline
    (:mod:`audit.report.libraries`)."""
    outp = Path(out)
    rows = []
    if not run_dirs and not attack_dirs and not claim_audits and not library_audits:
        raise UsageError(
            "give run directories, attack folders, claim audits or library audits to report on"
        )
    libs = read_all(library_audits) if library_audits else None
    for d in run_dirs:  # read every input before anything is written
        p = Path(d)
        if not (p / rundir.MANIFEST).is_file():
            raise UsageError(
                f"{p} is not a finished run directory or release bundle (no manifest.json)"
            )
        r = _run_summary(p)
        r["bounds"] = empirical_bounds(r)
        rows.append(r)
    # different releases made with one noise key cancel each other's noise (key_shared)
    from audit.bundle.audit import flag_shared_keys

    flag_shared_keys([r["audit"] for r in rows if isinstance(r.get("audit"), dict)
                      and "findings" in r["audit"]])  # fmt: skip
    for a, c in pair_foreign(attack_dirs, claim_audits):
        r = foreign_summary(a, c)
        r["bounds"] = empirical_bounds(r)
        rows.append(r)
    outp.mkdir(parents=True, exist_ok=True)
    figdir = outp / "figures"
    figdir.mkdir(exist_ok=True)

    report = Report(title, datetime.now(UTC).isoformat(timespec="seconds"))
    summary: dict = {"runs": [], "sections": list(SECTIONS), "missing": []}
    if rows or libs is None:
        report.sections.append(verdict_section(rows, figdir, summary))
    else:  # library audits alone: the report opens on their verdicts
        report.sections.append(Section("Verdict", blocks=library_overview(libs)))
    if not rows and libs is None:
        report.sections[-1].missing = "no run directories, bundles or foreign adapters given."
    if libs is not None:
        report.sections.append(library_section(libs, summary))
    report.sections.append(_runs_section(rows, figdir, summary))
    if not rows:
        report.sections[-1].missing = "no run directories, bundles or foreign adapters given."
    report.sections.append(analyses_section(analyses_dir, figdir))
    report.sections.append(_attacks_section(rows, figdir, summary))
    # optional: only when a run is a causal LM / has a client-level attack
    report.sections += [s for s in (lm_section(rows, figdir), client_section(rows, figdir)) if s]
    report.sections.append(empirical_section(rows, figdir, summary))
    report.sections.append(claims_section(claims, analyses_dir, figdir))
    report.sections.append(_environment_section(rows))
    cmds = list(commands or [])
    for r in rows:
        cmds += r["commands"] if "commands" in r else [train_command(r["config"], r["path"])]
    cmds += libs["commands"] if libs is not None else []
    repro = report.section("Reproduce")
    if cmds:
        repro.add(CodeBlock("\n".join(cmds), "bash"))
    else:
        repro.missing = "no command recorded for these inputs."
    assert [s.title for s in report.sections if s.title in SECTIONS] == list(SECTIONS)
    summary["sections"] = [s.title for s in report.sections]
    summary["missing"] = report.missing
    head = headline(rows) if rows else ""
    if libs is not None:
        head = (head.rstrip(".") + " · " if head else "") + library_headline(libs["rows"]) + "."
    report.summary = summary["headline"] = head

    atomic_write_text(outp / "report.html", render_html(report, outp))
    atomic_write_text(outp / "report.md", render_markdown(report))
    # a report is meant to be read by others: the mode a plain open() gives (the atomic
    # write's temporary file is owner-only)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("report.html", "report.md"):
        os.chmod(outp / name, 0o666 & ~umask)
    summary["html"] = str(outp / "report.html")
    summary["markdown"] = str(outp / "report.md")
    return summary


def _runs_section(rows: list[dict], figdir: Path, summary: dict) -> Section:
    sec = Section("Runs")
    headers = [
        "run",
        "method",
        "DP level",
        "σ",
        "δ",
        "ε claimed (PLD)",
        "ε recomputed",
        "understated",
        "accuracy",
        "balanced acc.",
        "seconds",
    ]
    table = [
        [
            r["run"],
            r["method"],
            r["level"],
            r["noise_multiplier"],
            r["delta"],
            r["epsilon_claimed"],
            r.get("epsilon_recomputed", "missing (audit not available)"),
            r.get("understated"),
            r["accuracy"],
            r["balanced_accuracy"],
            r["wall_seconds"],
        ]
        for r in rows
    ]
    sec.add(Table.of(headers, table))
    chance = [
        r
        for r in rows
        if r.get("balanced_accuracy") is not None and r["balanced_accuracy"] <= CHANCE_BALANCED
    ]
    if chance:
        names = ", ".join(f"{r['run']} ({r['balanced_accuracy']:.3f})" for r in chance)
        text = (
            f"Balanced accuracy at most {CHANCE_BALANCED}: {names}. These models predict "
            "(almost) only the majority class, so their accuracy is the label prior, not "
            "learning. Under DP this usually means too little signal per noisy step: more "
            "members per client and larger batches help (configs/minilm-tweets-dp.toml "
            "reaches 0.78 at ε = 8 on minilm/tweets)."
        )
        sec.add(Paragraph.of(Strong("Chance-level runs."), " " + text))
        summary["chance_level_runs"] = [r["run"] for r in chance]
    for r in rows:
        keys = ("run", "kind", "method", "level", "epsilon_claimed", "epsilon_recomputed")
        summary["runs"].append({k: r.get(k) for k in (*keys, "accuracy", "verdict")})
        if r.get("kind") == "bundle":
            skipped = [
                f"{sk['check']} ({sk['reason']})"
                for sk in (r.get("audit") or {}).get("skipped") or []
            ]
            summary.setdefault("bundles", []).append(
                {"run": r["run"], "not_shown": list(BUNDLE_NOT_SHOWN), "audit_skipped": skipped}
            )
            intro = (
                f"{r['run']} is a release bundle: without the operator's files this report "
                "cannot show"
            )
            sec.add(
                Paragraph.of(Strong(f"{intro}:")),
                BulletList.of(
                    list(BUNDLE_NOT_SHOWN) + [f"audit check skipped: {x}" for x in skipped]
                ),
            )
        findings = [Finding.from_dict(f) for f in (r.get("audit") or {}).get("findings") or []]
        if findings:
            sec.add(
                Paragraph.of(f"Audit findings for {r['run']}:"),
                BulletList.of(
                    (Strong(str(f.code)), f" ({f.severity}): {f.message}") for f in findings
                ),
            )
    series, single = accuracy_series(rows)
    fig = accuracy_figure(series)
    if fig is not None:
        path = save_figure(fig, figdir / "accuracy")[0]
        summary.setdefault("figures", {})["accuracy"] = str(path)
        sec.add(figure_paragraph(path, "accuracy per round"))
    if single:
        names = ", ".join(f"{run} (round {k})" for run, k in single)
        sec.add(
            Paragraph.of(
                f"Evaluated at one round only, so no per-round curve: {names}; the accuracy "
                "is in the table."
            )
        )
    return sec


def _attacks_section(rows: list[dict], figdir: Path, summary: dict) -> Section:
    sec = Section("Membership inference")
    for r in rows:
        att = r.get("attacks")
        if not att:
            continue
        t = []
        for name, a in (att.get("attacks") or {}).items():
            if not isinstance(a, dict) or "auc" not in a:
                continue
            ci = a.get("ci", {}).get("auc")
            tpr = a.get("tpr_at_fpr", {})
            t.append(
                [
                    name,
                    a["auc"],
                    f"[{_fmt(ci[0], 3)}, {_fmt(ci[1], 3)}]" if ci else "—",
                    tpr.get("0.01"),
                    tpr.get("0.001"),
                    a.get("threat_model", ""),
                ]
            )
        hd = ["attack", "AUC", "AUC 95% CI", "TPR@1%FPR", "TPR@0.1%FPR", "threat model"]
        sub = Section(r["run"], [Table.of(hd, t)])
        sec.add(sub)
        n_non = [
            a.get("n_nonmembers")
            for a in (att.get("attacks") or {}).values()
            if isinstance(a, dict) and isinstance(a.get("n_nonmembers"), int)
        ]
        if n_non and min(n_non) < 1000:
            sub.add(
                Paragraph.of(
                    f"With {min(n_non)} non-members, 0.1% FPR is less than one false "
                    "positive: the TPR@0.1%FPR column is the TPR at zero false positives, "
                    "and its bootstrap interval is unreliable there."
                )
            )
        fig = roc_figure(f"Membership inference ROC: {r['run']}", att.get("attacks") or {})
        if fig is not None:  # drawn here from attacks.json: log–log, one style for all runs
            path = save_figure(fig, figdir / f"{r['run']}-roc")[0]
            summary.setdefault("figures", {})[f"roc {r['run']}"] = str(path)
            sub.add(figure_paragraph(path, f"ROC {r['run']} (log–log)"))
        else:  # attack results without curves: the attack's own figures
            for src in r["roc_figures"]:
                dst = copy_figure(Path(src), figdir / f"{r['run']}-{Path(src).name}")
                sub.add(figure_paragraph(dst, f"ROC {r['run']}"))
    if not sec.blocks:
        sec.missing = "no attack results in the runs (run `fedlora attack RUN_DIR`)."
    return sec


def _environment_section(rows: list[dict]) -> Section:
    versions = rows[0]["versions"] if rows else {}
    env = [["python", platform.python_version()], ["platform", platform.platform()]] + [
        [k, v] for k, v in versions.items() if k != "python"
    ]
    return Section("Environment", [Table.of(["component", "version"], env)])
