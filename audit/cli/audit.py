"""Over 500 lines on purpose: one command, fedlora audit, whose parser, run, claim, outside-canary and neighbour-replay paths share one human-readable rendering and one exit-code rule.

`fedlora audit`: check the privacy claim of a run directory, a release bundle or a
claim file; `fedlora report`: write the report of run directories (:mod:`audit.report.build`).

    fedlora audit RUN_OR_BUNDLE [--json] [--one-run] [--alpha A] [--key FILE]
    fedlora audit RUN_OR_BUNDLE RUN_OR_BUNDLE ... [--json]   (also flags shared noise keys)
    fedlora audit --claim FILE [--json]
    fedlora audit --canaries DIR --observations FILE --claim FILE [--alpha A] [--key FILE]

``--key FILE`` (the run's ``private/noise.key``) retrains the whole run on the CPU and
verifies the release against it; without it the output lists the fields taken on trust.

Exit codes (:mod:`audit.coverage`): 0 = pass: nothing understated, no error finding, and
every part of the mechanism the verdict rests on tested; 1 = fail: ε understated,
tampering, or any other error-severity finding (e.g. δ >= 1/n); 2 = bad input (one line on
stderr); 4 = incomplete: nothing found, but some part (sampling, clipping, noise,
accounting) untested — the output names which and why.
``--json`` prints only the JSON document (non-finite numbers as the strings "inf"/"nan").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from audit.coverage import EXIT_INCOMPLETE
from audit.findings import Finding
from fl.errors import UsageError

#: the exit codes, as ``fedlora audit --help`` prints them
EXIT_HELP = """exit codes:
  0  pass: nothing understated, no error finding, every part of the mechanism tested
     (sampling, clipping, noise, accounting; a part may not apply, e.g. sampling at q = 1)
  1  fail: an error finding (ε understated, tampering, a conformance test rejects the
     claim, leaks more than claimed, a release not finite or without noise, ...)
  2  bad input: missing or unreadable files, flags that do not go together (one line)
  4  incomplete: nothing found, but some part of the mechanism untested (e.g. the
     training's own sampler never observed): the output says which part and why"""


def register(sub) -> None:
    p = sub.add_parser(
        "audit",
        help="recompute ε of a run or a claim and flag understatements and tampering",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "claim file (--claim FILE, JSON or TOML): level (sample|client), noise_multiplier "
            "(sigma = noise std / C), clipping_norm (optional), sampling "
            "(poisson|shuffle|fixed_batch|all), batch_size + dataset_size (one client's "
            "records) or sample_rate, steps_per_round, rounds, clients_per_round + "
            "total_clients (required at client level), accounting "
            "(composed|per_round|per_epoch|unknown), noise_source "
            "(keyed_csprng|csprng|seeded|unknown), claimed_epsilon, delta; name/source/notes "
            "free text. Opacus users: batch_size/dataset_size are read as Opacus's q = "
            "1/ceil(dataset_size/batch_size) when that explains the claim (warning "
            "opacus_sample_rate). Every field and finding: docs/audit.md.\n\n" + EXIT_HELP
        ),
        description=(
            "Recompute ε (PLD, RDP beside) from a run's recorded mechanism, or from a claim "
            "file describing a mechanism, and name the accounting mistakes that explain an "
            "understated ε. Exit 0: pass; 1: fail (understated, tampered or other error "
            "finding); 2: bad input; 4: incomplete (nothing found, a part of the mechanism "
            "untested)."
        ),
    )
    p.add_argument(
        "run_dir",
        nargs="*",
        metavar="RUN_OR_BUNDLE",
        help="run directories or release bundles (RUN/release, `fedlora export`) to audit; "
        "with several, each is audited and any two different releases that share a noise "
        "key are flagged (key_shared)",
    )
    p.add_argument("--claim", metavar="FILE", help="claim file (JSON or TOML) to check instead")
    p.add_argument(
        "--canaries",
        metavar="DIR",
        help="a canary set (`fedlora canaries new`) added to a training done elsewhere; with "
        "--observations and --claim: test the per-step releases against the claim's σ and C "
        "(conformance), score the canaries, bound ε from below and compare it with the claim "
        "(exit 1: does not implement its claim, or leaks more than claimed)",
    )
    p.add_argument(
        "--observations",
        metavar="FILE",
        help="the observation file the training hooks wrote (audit.canaries.hooks), with --canaries",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument(
        "--one-run",
        action="store_true",
        help="also bound ε from below with the run's canaries (Steinke et al. 2023)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.05,
        help="1 - confidence of the empirical bound (run directories with --one-run) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--key",
        metavar="FILE",
        help="the run's noise key (RUN/private/noise.key): retrain the whole run on the CPU "
        "and check that it reproduces the released adapter and privacy block; with "
        "--canaries: the set's key (re-derives and checks the set, re-draws the canaries' "
        "coins for the clipping test)",
    )
    p.add_argument(
        "--neighbours",
        metavar="KINDS",
        nargs="?",
        const="auto",
        help="neighbour replay (a run directory with its key): retrain the run on its data "
        "and on neighbours with every random draw frozen and compare what enters each noise "
        "call (‖q(D) − q(D′)‖ ≤ the sensitivity) and everything released without noise; "
        "KINDS: auto (remove,max-length), all, or a comma list of remove, duplicate, empty, "
        "max-length, flipped, replace, empty-client (client level) (docs/replay.md)",
    )
    p.set_defaults(func=cmd_audit)

    r = sub.add_parser(
        "report",
        help="write report.html and report.md for runs, bundles, foreign adapters' attacks "
        "claim audits and DP libraries' audits",
        description="Write one self-contained report.html and its twin report.md (verdict "
        "table, runs, noise analyses, membership inference, empirical privacy, claims check, "
        "environment, reproduce commands) for fedlora run directories and release bundles, "
        "and for what an outside user has: the --out folder of `fedlora attack --adapter ...` "
        "and the saved output of `fedlora audit --claim FILE --json`, and DP libraries' audits "
        "(--library-audit). Different releases "
        "that share a noise key are flagged (key_shared).",
    )
    r.add_argument(
        "runs",
        nargs="*",
        metavar="RUN_OR_BUNDLE",
        help="fedlora run directories or release bundles",
    )
    r.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder to write report.html, report.md and figures/ into (created if missing)",
    )
    r.add_argument(
        "--attack-dir",
        action="append",
        dest="attack_dirs",
        metavar="DIR",
        help="a foreign adapter's attack folder (fedlora attack --adapter ... --out DIR; "
        "default ADAPTER/attacks); repeatable",
    )
    r.add_argument(
        "--claim-audit",
        action="append",
        dest="claim_audits",
        metavar="FILE",
        help="saved output of `fedlora audit --claim FILE --json`; the i-th belongs to the "
        "i-th --attack-dir; repeatable",
    )
    r.add_argument(
        "--library-audit",
        action="append",
        dest="library_audits",
        metavar="DIR",
        help="a folder (or file) of DP libraries' audits (audit.libraries: per-run JSON "
        "written by audit.libraries.results.save_result, or the benchmark's results.json, "
        "e.g. benchmarks/results/libraries); shown in a 'Library audits' section after the "
        "verdict and counted in the headline (pass / incomplete / fail); given without run "
        "directories the report opens on their verdicts; repeatable",
    )
    r.add_argument(
        "--analyses", metavar="DIR", help="folder with analysis results (NAME/NAME.json + figures)"
    )
    r.set_defaults(func=cmd_report)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.4g}" if isinstance(x, int | float) else str(x)


def exit_code(result: dict) -> int:
    """1 when something is understated, tampered, or an error finding; else 4 when the
    result says ``incomplete`` (a part of the mechanism untested, :mod:`audit.coverage`);
    else 0."""
    bad = result.get("understated") or result.get("tampered")
    bad = bad or any(Finding.from_dict(f).is_error for f in result.get("findings", []))
    if bad:
        return 1
    return EXIT_INCOMPLETE if result.get("verdict") == "incomplete" else 0


def _human(result: dict, title: str) -> str:
    lines = [title]
    rows = [("claimed ε", result.get("claimed_epsilon")), ("δ", result.get("delta"))]
    rec = result.get("recomputed")
    if rec:
        rows += [
            (
                "ledger ε (PLD / RDP)",
                f"{_num(rec['ledger']['pld'])} / {_num(rec['ledger']['rdp'])}",
            ),
            (
                "config ε (PLD / RDP)",
                f"{_num(rec['config']['pld'])} / {_num(rec['config']['rdp'])}",
            ),
        ]
    rows += [
        ("recomputed ε (PLD)", result.get("epsilon_pld")),
        ("recomputed ε (RDP)", result.get("epsilon_rdp")),
        ("ratio recomputed/claimed", result.get("ratio")),
        ("understated", "YES" if result.get("understated") else "no"),
    ]
    if "tampered" in result:
        rows.append(("tampering", "YES" if result["tampered"] else "no"))
    if result.get("mechanism"):
        rows.append(("mechanism", result["mechanism"]))
    one = result.get("one_run")
    if one and "epsilon_lb" in one and "m" in one:
        rows.append(
            (
                "one-run ε lower bound",
                f"{_num(one['epsilon_lb'])} (Steinke et al.; m={one['m']} "
                f"{'gradient ' if one.get('kind') == 'gradient' else ''}canaries, "
                f"{one.get('r', '-')} guesses, {one.get('v', '-')} correct, confidence "
                f"{1 - one['alpha']:g})",
            )
        )
        fdp = one.get("fdp")
        if fdp:
            rows.append(
                (
                    "one-run f-DP ε lower bound",
                    f"{_num(fdp['epsilon_lb'])} ((ε, δ) curves; μ-GDP: μ >= "
                    f"{_num(fdp['mu_lb_gdp'])}, confidence {1 - fdp['alpha']:g})",
                )
            )
    conf = (one or {}).get("conformance")
    if conf and conf.get("tests") is not None:
        rej, weak = conf.get("rejected") or [], conf.get("weak") or []
        rows.append(
            (
                "conformance",
                (
                    f"REJECTED: {', '.join(rej)}"
                    if rej
                    else f"passed {len(conf['tests'])} test" + "s" * (len(conf["tests"]) != 1)
                )
                + (
                    f"; weak evidence (α = {conf.get('warn_alpha'):g}): {', '.join(weak)}"
                    if weak
                    else ""
                )
                + f" (family-wise α = {conf.get('alpha'):g}, Holm)",
            )
        )
        samp = conf.get("sampling")
        if samp:
            rows.append(
                (
                    "sampling test",
                    f"p = {samp['p_value']:.3g} ({samp['canaries']} sampler canaries, "
                    f"{samp['permutations']} permutations; window z {samp['z_window']:.3g}, "
                    f"phase z {samp['z_phase']:.3g})",
                )
            )
        if conf.get("implied_epsilon") is not None:
            ge = "≥ " if conf.get("implied_epsilon_at_least") else ""
            rows.append(
                (
                    "noise-implied ε",
                    f"{ge}{_num(conf['implied_epsilon'])} (σ × {_num(conf['implied_factor'])}; "
                    "conditional on Gaussian noise, not certified)",
                )
            )
    if one and one.get("note"):
        rows.append(("canaries", one["note"]))
    if one and "epsilon_lb" in one and "m" in one:
        check = one.get("claim_check")
        if check:
            rows.append(
                (
                    "claim test",
                    f"ε_lb {_num(check['epsilon_lb'])} ({check.get('bound', 'one-run')}) vs "
                    f"{_num(check['epsilon'])} allowed: "
                    + ("LEAKS MORE THAN CLAIMED" if check.get("exceeds") else "consistent"),
                )
            )
    w = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{w}}  {_num(v) if not isinstance(v, str) else v}" for k, v in rows]
    for sk in result.get("skipped") or []:
        lines.append(f"skipped: {sk['check']}: {sk['reason']}")
    rep = result.get("replay")
    if rep and rep.get("performed"):
        if rep.get("verified"):
            how = "bit for bit" if rep.get("exact") else f"within {rep.get('tolerance'):g}"
            lines.append(
                f"replay: verified {how} (max |Δ| {_num(rep.get('max_abs_diff'))}) in "
                f"{rep.get('seconds', 0):.1f} s"
            )
        else:
            lines.append(
                f"replay: NOT verified (max |Δ| {_num(rep.get('max_abs_diff'))}"
                + (
                    f", privacy fields differing: {len(rep['privacy_fields_differing'])}"
                    if rep.get("privacy_fields_differing")
                    else ""
                )
                + f"), {rep.get('seconds', 0):.1f} s"
            )
    elif rep:
        lines.append(f"replay: not performed ({rep.get('reason')})")
    if result.get("trusted"):
        lines.append("taken on trust (no --key): " + ", ".join(result["trusted"]))
    lines += _coverage_lines(result.get("coverage"))
    if result.get("neighbour_replay"):
        from audit.replay.engine import summary_line

        lines.append(f"neighbour replay: {summary_line(result['neighbour_replay'])}")
    findings = [Finding.from_dict(f) for f in result.get("findings", [])]
    if findings:
        lines.append("findings:")
        lines += [f"  [{f.severity}] {f.code}: {f.message}" for f in findings]
    else:
        lines.append("findings: none")
    return "\n".join(lines)


def cmd_audit(args) -> int:
    if args.canaries or args.observations:
        return _audit_outside(args)
    if args.claim and args.run_dir:
        raise UsageError("give either RUN_DIR or --claim FILE, not both")
    if len(args.run_dir) > 1:
        return _audit_several(args)
    args.run_dir = args.run_dir[0] if args.run_dir else None
    if not args.claim and not args.run_dir:
        raise UsageError("give a RUN_DIR to audit or --claim FILE")
    if args.claim:
        if args.one_run:
            raise UsageError("--one-run needs a RUN_DIR (a claim file has no canaries)")
        if args.key:
            raise UsageError("--key needs a RUN_DIR or bundle to replay (not --claim)")
        from audit.claims.check import check_claim, load_claim

        result = check_claim(load_claim(args.claim))
        title = f"fedlora audit --claim {args.claim}"
    else:
        if not (0.0 < args.alpha < 1.0):
            raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
        from audit.bundle.audit import audit_run

        def log(line: str) -> None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

        result = audit_run(
            args.run_dir, one_run=args.one_run, alpha=args.alpha, key=args.key, log=log
        )
        if args.neighbours is not None:
            result = result.to_dict() if hasattr(result, "to_dict") else dict(result)
            _neighbour_replay(args, result, log)
        kind = "release bundle" if result.get("kind") == "bundle" else "run directory"
        title = (
            f"fedlora audit {args.run_dir}  ({kind}, method {result['method']}, "
            f"level {result['level']})"
        )
    if args.json:
        sys.stdout.write(json.dumps(_jsonable(result), indent=2) + "\n")
    else:
        sys.stdout.write(_human(result, title) + "\n")
    return exit_code(result)


def _neighbour_replay(args, result: dict, log) -> None:
    """``--neighbours``: the replay's record into ``result`` (``neighbour_replay``), its
    findings appended (a violation is an error: exit 1)."""
    from audit.replay.engine import replay_neighbours, summary_line

    if result.get("kind") == "bundle":
        raise UsageError("--neighbours needs the run directory (the data), not a bundle")
    try:
        rep = replay_neighbours(Path(args.run_dir), args.key, args.neighbours, log=log)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    result["neighbour_replay"] = rep
    result.setdefault("findings", []).extend(rep["findings"])
    log(f"neighbour replay: {summary_line(rep)}")


def _audit_outside(args) -> int:
    """``--canaries DIR --observations FILE --claim FILE``: :mod:`audit.canaries.outside`."""
    if not (args.canaries and args.observations and args.claim):
        raise UsageError("--canaries, --observations and --claim go together")
    if args.run_dir or args.one_run:
        raise UsageError("--canaries audits a training done elsewhere: no RUN_DIR, no --one-run")
    if not (0.0 < args.alpha < 1.0):
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    from audit.canaries.outside import audit_outside, exit_code

    res = audit_outside(
        args.canaries, args.observations, args.claim, alpha=args.alpha, key_file=args.key
    )
    if args.json:
        sys.stdout.write(json.dumps(_jsonable(res), indent=2) + "\n")
    else:
        sys.stdout.write(_human_outside(res) + "\n")
    return exit_code(res)


def _human_outside(r: dict) -> str:
    c = r["claim"]
    rows = [
        ("canaries", f"{r['m']} {r['canary_kind']} ({r['n_included']} included)"),
        ("claimed ε", f"{_num(c['claimed_epsilon'])} at δ = {_num(c['delta'])}"),
        ("recomputed ε (PLD / RDP)", f"{_num(c['epsilon_pld'])} / {_num(c['epsilon_rdp'])}"),
        ("allowed for one canary", f"{_num(r['allowed_epsilon'])} ({r['relation']})"),
        ("ε_lb Steinke et al. (α/2)", _num(r.get("epsilon_lb_steinke"))),
        ("ε_lb f-DP (α/2)", _num(r.get("epsilon_lb_fdp"))),
        (
            "ε_lb (certified)",
            f"{_num(r['epsilon_lb'])} ({r['bound']}; confidence {1 - r['alpha']:g})",
        ),
    ]
    for name, e in (r.get("estimate") or {}).items():
        lo, hi = e["epsilon_interval"]
        rows.append(
            (f"estimate {name}", f"{_num(e['epsilon'])} [{_num(lo)}, {_num(hi)}] (not a bound)")
        )
    rows += _conformance_rows(r.get("conformance"), r["alpha"])
    v = r["verdict"]
    if v == "incomplete":
        untested = (r.get("coverage") or {}).get("untested") or []
        v = f"INCOMPLETE: {', '.join(untested)} untested (exit 4)"
    elif v != "ok":
        v = f"{v.upper()} (exit 1)"
    else:
        v = "ok: every part tested (exit 0)"
    rows.append(("verdict", v))
    w = max(len(k) for k, _ in rows)
    lines = [f"fedlora audit --canaries {r['canaries']}"]
    lines += [f"  {k:<{w}}  {v}" for k, v in rows]
    lines += _coverage_lines(r.get("coverage"))
    lines += [f"note: {n}" for n in r.get("notes") or []]
    for d in r["findings"]:
        lines.append(f"  [{d['severity']}] {d['code']}: {d['message']}")
    return "\n".join(lines)


def _coverage_lines(cov: dict | None) -> list[str]:
    """What tested each part of the mechanism (audit.coverage), one line per part."""
    if not cov:
        return []
    lines = ["tested:"]
    for part, insts in cov.get("tested", {}).items():
        if insts:
            lines.append(f"  {part}: {', '.join(insts)}")
        elif part in (cov.get("not_applicable") or {}):
            lines.append(f"  {part}: not applicable ({cov['not_applicable'][part]})")
        else:
            why = (cov.get("why") or {}).get(part)
            lines.append(f"  {part}: UNTESTED" + (f" ({why})" if why else ""))
    return lines


def _conformance_rows(c: dict | None, alpha: float) -> list[tuple[str, str]]:
    """The outside audit's conformance tests (audit.canaries.outside), as rows."""
    if not c:
        return []
    if not c.get("performed"):
        return [("conformance", f"not tested: {c.get('reason')}")]
    rej = c.get("rejected") or []
    rows = [
        (
            "conformance (claim's σ)",
            f"σ = {_num(c['sigma'])}, C = {_num(c['clip'])}, {c['steps']} steps; "
            + (f"REJECTED: {', '.join(rej)}" if rej else "passed")
            + (
                f"; weak evidence (α = {c.get('warn_alpha'):g}): {', '.join(c['weak'])}"
                if c.get("weak")
                else ""
            )
            + f" (family-wise α = {c.get('alpha', alpha):g}, Holm)",
        )
    ]
    for t in c.get("tests") or []:
        if t["test"] == "scale":
            lo, hi = t["ratio_ci"]
            rows.append(
                (
                    f"noise observed/claimed {t['group']}",
                    f"{t['observed_over_claimed']:.4g} [{lo:.4g}, {hi:.4g}]"
                    + ("  REJECTED" if t["rejected"] else ""),
                )
            )
    rows.append(("canaries' coins", str(c.get("coins"))))
    ge = "≥ " if c.get("implied_epsilon_at_least") else ""
    rows.append(
        (
            "noise-implied ε",
            f"{ge}{_num(c['implied_epsilon'])} (the claim's mechanism at σ × "
            f"{_num(c['implied_factor'])}; conditional on Gaussian noise, not certified)",
        )
    )
    return rows


def _audit_several(args) -> int:
    """Several runs or bundles: each audited, shared noise keys flagged; the JSON output is
    a list; the exit code the worst of them."""
    if args.key:
        raise UsageError("--key belongs to one run: give one RUN_OR_BUNDLE with --key")
    if not (0.0 < args.alpha < 1.0):
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    from audit.bundle.audit import audit_run, flag_shared_keys

    results = [audit_run(r, one_run=args.one_run, alpha=args.alpha) for r in args.run_dir]
    flag_shared_keys(results)
    if args.json:
        sys.stdout.write(json.dumps(_jsonable(results), indent=2) + "\n")
    else:
        for r in results:
            kind = "release bundle" if r.get("kind") == "bundle" else "run directory"
            title = (
                f"fedlora audit {r['run_dir']}  ({kind}, method {r['method']}, level {r['level']})"
            )
            sys.stdout.write(_human(r, title) + "\n\n")
    return max(exit_code(r) for r in results)


def cmd_report(args) -> int:
    claims = None
    if args.analyses:
        cp = Path(args.analyses) / "claims" / "claims.json"
        if cp.exists():
            claims = json.loads(cp.read_text())
    from audit.report.build import build_report

    s = build_report(
        args.runs,
        args.out,
        analyses_dir=args.analyses,
        claims=claims,
        attack_dirs=args.attack_dirs,
        claim_audits=args.claim_audits,
        library_audits=args.library_audits,
    )
    print(f"report: {s['html']}")
    print(f"markdown: {s['markdown']}")
    return 0
