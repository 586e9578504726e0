"""What the Flower audit's central and local checks (:mod:`audit.libraries.flower.central`,
:mod:`audit.libraries.flower.local`) share: the claim's fields, a finding, the field-by-field
check, the noise-implied ε guard, the largest client's weight, and the result's keys and
verdict.
"""

from __future__ import annotations

import math

import numpy as np

from audit.claims.implied import noise_finding
from audit.claims.schema import Claim, validate_claim
from audit.coverage import Coverage, decide
from audit.libraries.flower.compat import installed_version
from audit.libraries.results import conformance_warnings

__all__ = [
    "REL_TOL",
    "check_claim_fields",
    "check_fields",
    "check_rounds",
    "failure_findings",
    "no_conformance",
    "noise_absent_finding",
    "nonfinite_finding",
    "finding",
    "implied",
    "result",
    "worst_weight",
]

REL_TOL = 1e-6


def check_claim_fields(claim) -> Claim:
    """The claim, validated (a schema error is a usage error); Flower's wrappers and
    ``LocalDpMod`` protect clients: the claim must be client level."""
    c = validate_claim(claim)
    if c.level != "client":
        raise ValueError(
            f"a Flower DP claim is about clients (level 'client'), got level {c.level!r}"
        )
    return c


def worst_weight(sizes, m: int) -> float:
    """a = m·w of the largest client in the cohort that weighs it most (it and the m − 1
    smallest others), under weighting by size; 1 when every size is equal."""
    s = np.sort(np.asarray(list(sizes), dtype=np.float64))
    if s.size == 0 or m <= 1:
        return 1.0
    m = min(m, s.size)
    return float(m * s[-1] / (s[-1] + s[: m - 1].sum()))


def implied(compute) -> tuple[float, bool]:
    """(ε, at_least) of the noise-implied mechanism; a noise factor near 0 (a noise that
    repeats) overflows the μ-GDP solver (audit/bounds/hypothesis.py gdp_delta): ε = ∞."""
    try:
        return compute()
    except (OverflowError, ZeroDivisionError, FloatingPointError):
        return math.inf, False


def finding(code: str, message: str, severity: str = "error") -> dict:
    f = {"code": code, "message": message}
    if severity != "error":
        f["severity"] = severity
    return f


def check_fields(c: Claim, checks, findings: list) -> None:
    for name, claimed, ran in checks:
        if claimed is None or ran is None:
            continue
        if abs(claimed - ran) > REL_TOL * max(abs(ran), 1e-300):
            findings.append(
                finding(
                    f"{name}_mismatch",
                    f"the claim's {name} = {claimed:.6g} but the run used {ran:.6g}",
                )
            )


def check_rounds(c: Claim, released: int, configured: int, findings: list) -> None:
    """The rounds released against the claim's: more is ``rounds_mismatch`` (an error);
    fewer is ``fewer_rounds_than_claimed``, a warning (the claim covers every release the
    run made: rounds Flower skipped, or a run stopped early, release nothing)."""
    claimed = c.rounds * c.steps_per_round
    if released > claimed:
        findings.append(
            finding(
                "rounds_mismatch",
                f"the claim's rounds = {claimed} but the run released {released} rounds",
            )
        )
    elif released < claimed:
        findings.append(
            finding(
                "fewer_rounds_than_claimed",
                f"the run released {released} of the claim's {claimed} rounds ({configured} "
                "configured): the claimed ε covers them; the recomputed ε is for the rounds "
                "released",
                severity="warning",
            )
        )


def failure_findings(run) -> list[dict]:
    """``client_failures`` (a warning): the replies that failed (raised, timed out, status
    not OK), per round, and what Flower did with the round (skipped it, or aggregated the
    replies it had)."""
    rows = [(r.round, dict(r.failed), r.after is not None) for r in run.records if r.failed]
    if not rows:
        return []
    canary = set(run.canary_nodes)
    parts = []
    for rnd, failed, released in rows:
        kinds = sorted({v.split(":")[0] for v in failed.values()})
        who = sum(n not in canary for n in failed)
        parts.append(
            f"round {rnd}: {len(failed)} ({who} real) {'/'.join(kinds)}, "
            + ("the other replies aggregated" if released else "no release (round skipped)")
        )
    return [
        finding(
            "client_failures",
            f"{sum(len(f) for _, f, _ in rows)} client replies failed and were handled as "
            f"Flower handles them ({'; '.join(parts)}); Flower's DP wrappers skip a round "
            "with a failed reply, a timed-out reply is simply missing",
            severity="warning",
        )
    ]


def noise_absent_finding(conf, f: float, where: str) -> dict | None:
    """``noise_absent`` when the observed noise is 0 (the noise factor, or a scale test's
    observed/claimed ratio, below 10⁻⁶): the implied ε is ∞."""
    nf = noise_finding(f)
    ratios = [t.ratio for t in conf.tests if t.test == "scale" and t.ratio is not None]
    if (nf and nf[0] == "noise_absent") or (ratios and min(ratios) < 1e-6):
        return finding(
            "noise_absent",
            f"no noise reached {where}: the observed noise is 0 (observed/claimed scale "
            f"{min(ratios, default=0.0):.3g}); the release is deterministic, ε = ∞",
        )
    return None


def nonfinite_finding(recs, u, findings: list) -> np.ndarray:
    """``release_nonfinite`` (ε = ∞) naming the released rounds whose global model holds NaN
    or Inf (any array) or whose canary rows ``u`` (T, ·) are not finite; returns the rows of
    ``u`` that are not finite (left out of the tests)."""
    bad = np.zeros(len(recs), dtype=bool) if u is None else ~np.isfinite(u).all(axis=1)
    rounds = [r.round for t, r in enumerate(recs) if r.nonfinite or bad[t]]
    if rounds:
        n = sum(r.nonfinite for r in recs)
        findings.append(
            finding(
                "release_nonfinite",
                f"{len(rounds)} released round(s) hold NaN or Inf (rounds {rounds[:8]}"
                + ("…" if len(rounds) > 8 else "")
                + f"; {n} non-finite values in the global model): a release that is not a "
                "number is not noised (NaN passes Flower's clip, min(1, C/NaN) = 1, and "
                "reveals whichever client produced it), ε = ∞; left out of the tests",
            )
        )
    return bad


def no_conformance(why: str) -> dict:
    """The ``conformance`` entry of a result whose tests could not run."""
    return {"alpha": None, "passed": True, "tests": [], "rejected": [], "weak": [],
            "skipped": [f"every test ({why})"]}  # fmt: skip


def result(
    run, c, run_mech, findings, notes, conf, lb, cov: Coverage, why_no_tests: str = "", **kw
) -> dict:
    """The result's keys, the verdict (:func:`audit.coverage.decide`: ``fail`` on an error
    finding, ``incomplete`` while a part of the mechanism is untested, else ``pass``);
    ``conf`` None when no test could run."""
    rejected = [f"{t.group}:{t.test}" for t in conf.rejected] if conf is not None else []
    for t in conf.rejected if conf is not None else ():
        findings.append(
            finding(
                "conformance_rejected",
                f"{t.group}:{t.test} rejected at family-wise α = {conf.alpha:g} (Holm; "
                f"{t.evidence()})",
            )
        )
    fresh = [
        t for t in (conf.rejected if conf else ()) if t.test == "fresh" and t.ratio is not None
    ]
    absent = any(f["code"] == "noise_absent" for f in findings)  # no noise: nothing reused
    if fresh and min(t.ratio for t in fresh) < 0.2 and not absent:
        findings.append(
            finding(
                "noise_reused",
                f"consecutive releases' noises cancel (freshness ratio "
                f"{min(t.ratio for t in fresh):.3g}, about √2 under fresh noise): the noise draw "
                "repeated. Flower draws its noise from numpy's global generator "
                "(supercore/differential_privacy.py add_gaussian_noise_inplace), so code in the "
                "same process that reseeds it (np.random.seed in a client's train, as in a "
                "simulation) repeats the server's noise",
            )
        )
    if lb is None:
        notes.append("ε lower bound (needs inclusion bits drawn with p = 1/2, both values seen)")
    elif lb["epsilon_lb"] > c.claimed_epsilon:
        findings.append(
            finding(
                "empirical_exceeds_claim",
                f"the one-run ε lower bound {lb['epsilon_lb']:.4g} exceeds the claimed "
                f"ε = {c.claimed_epsilon:g}",
            )
        )
    # warnings are reported, not counted in the verdict
    errors = sum(f.get("severity", "error") == "error" for f in findings)
    verdict, code = decide(errors, cov)
    if conf is not None:
        findings = findings + conformance_warnings(conf)
    return {
        "library": "flower",
        "version": installed_version(),
        "mode": f"{run.api}:{run.mode}",
        "run": run_mech,
        "claim": c.to_dict(),
        "claimed_epsilon": c.claimed_epsilon,
        "delta": c.delta,
        **kw,
        "epsilon_lower_bound": lb["epsilon_lb"] if lb else None,
        "lower_bound": lb,
        "conformance": conf.to_dict() if conf is not None else no_conformance(why_no_tests),
        "conformance_rejected": rejected,
        # the Opacus audit's white-box clip error has no counterpart here: the aggregate
        # before the noise is not read (the weights and the canary contribution are)
        "canary_clip_error": None,
        "coverage": cov.to_dict(),
        "untested": cov.describe() + notes,
        "findings": findings,
        "verdict": verdict,
        "exit_code": code,
    }
