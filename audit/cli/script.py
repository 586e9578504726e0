"""``fedlora audit-script SCRIPT [--claim FILE] [--neighbours KINDS] [--canaries M] [--json]
[--script-args ARGS]``: the complete audit of an unchanged Opacus (or Hugging Face Trainer +
Opacus) training script, in one command and with one verdict.

Two instruments, both attached at import, neither needing a change to the script:

1. **the sampler canaries** (:mod:`audit.libraries.opacus.autoattach`): the script runs
   once with M canary records appended to the dataset ``make_private`` is handed, the
   canary block in its model (ghost clipping: the block's term in its criterion) and the
   audit attached to what ``make_private`` returned; after the script, the canaries' audit
   against the claim (the statistical instrument: sampling, clipping, noise, accounting);
2. **the neighbour replay** (:mod:`audit.replay.script`): the script on its data D and on
   neighbours D′ with every random draw frozen (the deterministic instrument: clipping,
   the noise read at the tap); no canaries in those runs.

The coverage of both is merged (:meth:`audit.coverage.Coverage.merge`) and the verdict
decided once (:func:`audit.coverage.decide`): ``pass`` only when every part was tested by
one of them and neither found an error. Exit 0 pass, 1 fail, 2 bad input, 4 incomplete.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fl.errors import UsageError

__all__ = ["register", "cmd_audit_script", "audit_script_complete"]


def register(sub) -> None:
    p = sub.add_parser(
        "audit-script",
        help="audit a DP training script (Opacus, HF Trainer + Opacus, or noise calls marked "
        "with audit.replay.script.noisy): sampler canaries and neighbour replay, no change to "
        "the script",
        description="Run SCRIPT once with sampler canaries attached at import (Opacus's "
        "make_private handed the dataset with canary records, the model with the canary "
        "block; audited against the claim: sampling, clipping, noise, accounting), then on "
        "its own data with every release recorded and on neighbours (a record removed, a "
        "scaled, NaN or duplicated record added at the start or end of every batch) with every "
        "random draw frozen; compare what enters each noise call with the declared "
        "sensitivity (the claim's C, else the optimizer's max_grad_norm), the releases' "
        "number and order, exceptions and what the script prints. One verdict over both. "
        "Exit codes: 0 pass, 1 fail, 2 bad input, 4 incomplete (a part of the mechanism "
        "untested). docs/replay.md.",
    )
    p.add_argument("script", help="the training script (run as __main__)")
    p.add_argument("--claim", metavar="FILE", help="the claim (JSON or TOML): σ, C, q, steps, ε")
    p.add_argument(
        "--neighbours",
        metavar="KINDS",
        default="auto",
        help="auto (remove, scaled@end, scaled@start), all, or a comma list of "
        "kind[@start|@end] among remove, duplicate, scaled, nan, inf (default: auto)",
    )
    p.add_argument(
        "--canaries",
        metavar="M",
        type=int,
        default=64,
        help="sampler canaries for the canary run (about half included; default 64; 0: no "
        "canary run, the replay alone, whose verdict cannot be pass)",
    )
    p.add_argument(
        "--canary-seed",
        metavar="S",
        type=int,
        default=None,
        help="seed the canaries' inclusion bits (tests; default: the OS's entropy)",
    )
    p.add_argument(
        "--permutations",
        metavar="K",
        type=int,
        default=19_999,
        help="permutations of the canaries' sampling tests (default 19 999)",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument(
        "--script-args",
        metavar="ARGS",
        default="",
        help="the script's own arguments, as one string (split like a shell does)",
    )
    p.set_defaults(func=cmd_audit_script)


def audit_script_complete(
    script: str | Path | Callable[[], object],
    claim=None,
    neighbours: str | tuple | None = None,
    argv: list[str] | None = None,
    *,
    canaries: int = 64,
    canary_seed: int | None = None,
    permutations: int = 19_999,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The canary run, then the neighbour replay (:func:`audit.replay.script.audit_script`),
    one verdict over both (module doc). Returns the replay's result with ``verdict``,
    ``exit_code``, ``coverage`` and ``findings`` merged over both instruments, the canary
    audit under ``canaries`` and each instrument's own verdict under ``instruments``.
    Raises ValueError where the script is missing or fails on its own data."""
    from audit.coverage import Coverage, decide
    from audit.replay.script import audit_script

    say = log or (lambda s: None)
    if not callable(script) and not Path(script).is_file():
        raise ValueError(f"{script}: no such script")
    t0 = time.time()
    if canaries > 0:
        say(f"audit-script: running {Path(str(script)).name} once with {canaries} sampler "
            "canaries attached at import")  # fmt: skip
        can = _canary_run(script, claim, argv, canaries, canary_seed, permutations)
    else:
        can = _not_run("--canaries 0: no canary run")
    t_can = time.time() - t0
    res = audit_script(script, claim, neighbours, argv=argv, log=log)
    cov = Coverage.from_dict(can["coverage"]).merge(Coverage.from_dict(res["coverage"]))
    findings = [{"instrument": "canaries", **f} for f in can["findings"]]
    findings += [{"instrument": "replay", **f} for f in res["findings"]]
    errors = any(f.get("severity", "error") == "error" for f in findings)
    verdict, code = decide(errors, cov)
    res["instruments"] = {"canaries": can["verdict"], "replay": res["verdict"]}
    res.update(verdict=verdict, exit_code=code, coverage=cov.to_dict(), findings=findings)
    res["canaries"] = can
    res["seconds"] = {"canaries": round(t_can, 2), **res["replay"]["seconds"]}
    return res


def _canary_run(script, claim, argv, m, seed, permutations) -> dict:
    try:
        from audit.libraries.opacus.autoattach import run_with_canaries

        return run_with_canaries(script, claim, argv, m=m, seed=seed, permutations=permutations)
    except (ImportError, ValueError) as exc:  # no Opacus, or a release out of range
        return _not_run(f"the canaries could not be attached: {exc}")


def _not_run(why: str) -> dict:
    from audit.coverage import PARTS, Coverage

    cov = Coverage()
    for p in PARTS:
        cov.skip(p, f"canaries: {why}")
    return {"instrument": "canaries", "verdict": "incomplete", "exit_code": 4,
            "coverage": cov.to_dict(), "findings": [], "runs": [], "reasons": [why]}  # fmt: skip


def cmd_audit_script(args) -> int:
    claim = None
    if args.claim:
        from audit.claims.schema import load_claim

        claim = load_claim(args.claim)
    if args.canaries < 0:
        raise UsageError(f"--canaries must be 0 or more, got {args.canaries}")
    try:
        res = audit_script_complete(
            args.script,
            claim,
            args.neighbours,
            argv=shlex.split(args.script_args),
            canaries=args.canaries,
            canary_seed=args.canary_seed,
            permutations=args.permutations,
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
    _print_canaries(res["canaries"])
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
    shown = [f for f in res["findings"] if f.get("severity", "error") != "info"]
    print("findings:" if shown else "findings: none")
    for f in shown:
        print(f"  [{f.get('severity', 'error')}] {f['instrument']}: {f['code']}: {f['message']}")
    return res["exit_code"]


def _print_canaries(can: dict) -> None:
    print(f"canaries: {can['verdict']}")
    for why in can.get("reasons", []):
        print(f"  not attached: {why}")
    for r in can.get("runs", []):
        run = r["run"]
        lb = r.get("epsilon_lower_bound")
        print(
            f"  {run['mode']}, {run['sampling']}, {run['steps']} steps at q = "
            f"{run['sample_rate']:.4g}, σ = {run['noise_multiplier']}, C = "
            f"{run['clipping_norm']}, {run['canaries']} canaries: ε recomputed "
            f"{r['recomputed_epsilon']:.4g} (claimed {r['claimed_epsilon']:.4g}), one-run "
            f"lower bound {'-' if lb is None else f'{lb:.3g}'}"
        )


def _untested(res: dict) -> list[str]:
    cov = res["coverage"]
    return [f"{p} untested" for p in cov["untested"]]
