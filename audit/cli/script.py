"""``fedlora audit-script SCRIPT [--claim FILE] [--neighbours KINDS] [--json] [--script-args ARGS]``:
neighbour replay of a training script, with the libraries patched at import
(:mod:`audit.replay.script`). Exit 0 pass, 1 fail, 2 bad input, 4 incomplete."""

from __future__ import annotations

import json
import shlex
import sys

from fl.errors import UsageError

__all__ = ["register", "cmd_audit_script"]


def register(sub) -> None:
    p = sub.add_parser(
        "audit-script",
        help="neighbour replay of a DP training script (Opacus, or noise calls marked with "
        "audit.replay.script.noisy): no change to the script",
        description="Run SCRIPT on its own data with every release recorded, then on "
        "neighbours (a record removed, a scaled, NaN or duplicated record added at the start "
        "or end of every batch) with every random draw frozen and the recorded outputs handed "
        "back; compare what enters each noise call with the declared sensitivity (the claim's "
        "C, else the optimizer's max_grad_norm), the releases' number and order, exceptions "
        "and what the script prints. Exit codes: 0 pass, 1 fail, 2 bad input, 4 incomplete "
        "(a part of the mechanism untested). docs/audit.md, 'Neighbour replay'.",
    )
    p.add_argument("script", help="the training script (run as __main__)")
    p.add_argument("--claim", metavar="FILE", help="the claim (JSON or TOML): σ and C")
    p.add_argument(
        "--neighbours",
        metavar="KINDS",
        default="auto",
        help="auto (remove, scaled@end, scaled@start, nan@end), all, or a comma list of "
        "kind[@start|@end] among remove, duplicate, scaled, nan, inf (default: auto)",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument(
        "--script-args",
        metavar="ARGS",
        default="",
        help="the script's own arguments, as one string (split like a shell does)",
    )
    p.set_defaults(func=cmd_audit_script)


def cmd_audit_script(args) -> int:
    from audit.replay.script import audit_script

    claim = None
    if args.claim:
        from audit.claims.schema import load_claim

        claim = load_claim(args.claim)
    try:
        res = audit_script(
            args.script,
            claim,
            args.neighbours,
            argv=shlex.split(args.script_args),
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(res, indent=2, default=str))
        return res["exit_code"]
    rep = res["replay"]
    print(f"fedlora audit-script {args.script}")
    print(
        f"verdict: {res['verdict']}" + (f" ({'; '.join(_untested(res))})" if _untested(res) else "")
    )
    print(
        f"replay: {rep['verdict']} ({len(rep['neighbours'])} neighbours × {rep['releases']} releases)"
    )
    for n in rep["neighbours"]:
        c = n.get("comparison")
        if c is None:
            print(f"  {n['neighbour']}: skipped ({n.get('skipped')})")
            continue
        worst = "-" if c["max_ratio"] is None else f"{c['max_ratio']:.4g}"
        print(f"  {n['neighbour']}: largest ‖Δq‖/C {worst}, violations {c['n_violations']}")
    noise = res["noise"]
    if noise.get("performed"):
        print(
            f"noise at the tap: observed/claimed {noise.get('ratio')}, p(scale) "
            f"{noise.get('p_scale')}, p(fresh) {noise.get('p_fresh')}"
        )
    print("findings:" if res["findings"] else "findings: none")
    for f in res["findings"]:
        print(f"  [{f['severity']}] {f['code']}: {f['message']}")
    return res["exit_code"]


def _untested(res: dict) -> list[str]:
    cov = res["coverage"]
    return [f"{p} untested" for p in cov["untested"]]
