"""What the Flower audit's central and local checks (:mod:`audit.libraries.flower.central`,
:mod:`audit.libraries.flower.local`) share: the claim's fields, a finding, the field-by-field
check, the noise-implied ε guard, the largest client's weight, and the result's keys and
verdict.
"""

from __future__ import annotations

import math

import numpy as np

from audit.claims.schema import Claim, validate_claim
from audit.libraries.results import conformance_warnings

__all__ = [
    "REL_TOL",
    "check_claim_fields",
    "check_fields",
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
    except OverflowError:
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


def result(run, c, run_mech, findings, untested, conf, lb, **kw) -> dict:
    rejected = [f"{t.group}:{t.test}" for t in conf.rejected]
    for t in conf.rejected:
        findings.append(
            finding(
                "conformance_rejected",
                f"{t.group}:{t.test} rejected at family-wise α = {conf.alpha:g} (Holm; "
                f"{t.evidence()})",
            )
        )
    fresh = [t for t in conf.rejected if t.test == "fresh" and t.ratio is not None]
    if fresh and min(t.ratio for t in fresh) < 0.2:
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
        untested.append("ε lower bound (needs inclusion bits drawn with p = 1/2, both values seen)")
    elif lb["epsilon_lb"] > c.claimed_epsilon:
        findings.append(
            finding(
                "empirical_exceeds_claim",
                f"the one-run ε lower bound {lb['epsilon_lb']:.4g} exceeds the claimed "
                f"ε = {c.claimed_epsilon:g}",
            )
        )
    # warnings are reported, not counted in the verdict
    verdict = "fail" if any(f.get("severity", "error") == "error" for f in findings) else "pass"
    findings = findings + conformance_warnings(conf)
    return {
        "library": "flower",
        "mode": f"{run.api}:{run.mode}",
        "run": run_mech,
        "claim": c.to_dict(),
        "claimed_epsilon": c.claimed_epsilon,
        "delta": c.delta,
        **kw,
        "epsilon_lower_bound": lb["epsilon_lb"] if lb else None,
        "lower_bound": lb,
        "conformance": conf.to_dict(),
        "conformance_rejected": rejected,
        # the Opacus audit's white-box clip error has no counterpart here: the aggregate
        # before the noise is not read (the weights and the canary contribution are)
        "canary_clip_error": None,
        "untested": untested,
        "findings": findings,
        "verdict": verdict,
        "exit_code": 0 if verdict == "pass" else 1,
    }
