"""A run's one-line verdict: is it private as claimed, and is it useful?

:func:`verdict` is a pure function of a run's :class:`Evidence` — what the audit found
(ε recomputed from the ledger, findings), the best empirical ε lower bound, and the
model's balanced accuracy — checked in order of severity, the first that applies wins:

1. the audit could not run → ``not audited: …``;
2. a tampering finding → ``tampered: adapter hash mismatch``;
3. no DP claimed → ``no DP claimed`` (with the empirical bound when there is one);
3b. a conformance test rejects the mechanism (finding ``mechanism_mismatch``) → ``does not
   implement its claim: head noise 0.11× claimed; implied ε ≥ 34 vs claimed 1``;
4. the stated ε is below the recomputation → ``ε understated (recomputed 9.1 > claimed 8)``;
5. the empirical lower bound exceeds what the recomputed ε allows → ``leaks more than
   claimed: …`` (the recomputed ε itself, or at client level the replace-one-client
   (2ε, (1 + e^ε)δ) that one canary falls under: ``empirical_limit``);
6. another error finding → ``claim not supported: noise reproducible``;
7. a part of the mechanism untested (the run audit's ``coverage``, :mod:`audit.coverage`)
   → ``incomplete: sampling untested (ε = 8); empirical ε ≥ 0.41 at 95%`` (exit 4 in the
   CLI: nothing found, but no pass without a test);
8. otherwise ``private as claimed (ε = 8); empirical ε ≥ 0.41 at 95%`` (``the canary
   audit certifies no ε > 0 at 95%`` when the bound is 0, ``no empirical bound`` without one).

A model at chance level (balanced accuracy at most :data:`CHANCE_BALANCED`) gets
``; utility at chance (balanced acc. 0.5)`` appended: private, but not useful.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from audit.findings import Finding, Severity

__all__ = ["CHANCE_BALANCED", "Evidence", "verdict", "findings_summary"]

#: a run whose balanced accuracy is at most this learned (almost) only the label prior
CHANCE_BALANCED = 0.52


@dataclass(frozen=True)
class Evidence:
    """What the verdict rests on; ε in nats, ``None`` where not known."""

    dp_claimed: bool
    epsilon_claimed: float | None = None
    epsilon_recomputed: float | None = None
    understated: bool = False
    findings: tuple[Finding, ...] = ()
    audit_error: str | None = None  # why the run audit could not run
    empirical_lb: float | None = None  # the best empirical ε lower bound
    alpha: float = 0.05  # the lower bound holds with probability 1 − alpha
    balanced_accuracy: float | None = None
    # what the claim allows the bound to reach, when not the recomputed ε (client level),
    # and whether the bound (recomputed at that relation's δ) exceeds it
    empirical_limit: float | None = None
    empirical_exceeds: bool | None = None
    # the conformance tests (audit.bounds.conformance): what failed, in words (None: passed or
    # not run), and the noise-implied ε (the ledger's ε at the observed noise's upper bound;
    # conditional on Gaussian noise at that scale, not certified) with whether it is "at least"
    mismatch: str | None = None
    implied_epsilon: float | None = None
    implied_at_least: bool = False
    # the parts of the mechanism no instrument tested (audit.coverage.PARTS; the run audit's
    # coverage), when it says
    untested: tuple[str, ...] = ()


def _eps(x: float | None) -> str:
    if x is None:
        return "unknown"
    return "∞" if math.isinf(x) else f"{x:.3g}"


def _names(findings) -> str:
    return ", ".join(dict.fromkeys(str(f.code).replace("_", " ") for f in findings))


def _privacy(e: Evidence) -> str:
    conf = f"{1 - e.alpha:.0%}"
    lb = ""
    if e.empirical_lb is not None:
        lb = f"empirical ε ≥ {_eps(e.empirical_lb)} at {conf}"
        if e.empirical_lb == 0:
            lb = f"the canary audit certifies no ε > 0 at {conf}"
    if e.audit_error:
        return f"not audited: {e.audit_error}"
    tampered = [f for f in e.findings if f.tampering]
    if tampered:
        return f"tampered: {_names(tampered)}"
    if not e.dp_claimed:
        return "no DP claimed" + (f"; {lb}" if lb else "")
    if e.mismatch:
        out = f"does not implement its claim: {e.mismatch}"
        if e.implied_epsilon is not None:
            ge = "≥ " if e.implied_at_least else ""
            out += f"; noise-implied ε {ge}{_eps(e.implied_epsilon)} vs claimed {_eps(e.epsilon_claimed)}"
        return out
    if e.understated:
        return (
            f"ε understated (recomputed {_eps(e.epsilon_recomputed)} > claimed "
            f"{_eps(e.epsilon_claimed)})"
        )
    eps = e.epsilon_recomputed
    limit = e.empirical_limit if e.empirical_limit is not None else eps
    if lb and limit != eps:  # client level: a canary changes one client's data
        lb += f" (one client's data changed: replace-one-client allows 2ε = {_eps(limit)})"
    if e.empirical_exceeds is not None:
        exceeds = e.empirical_exceeds
    else:
        exceeds = e.empirical_lb is not None and limit is not None and e.empirical_lb > limit
    if exceeds:
        return f"leaks more than claimed: {lb} > recomputed {_eps(eps)}"
    errors = [f for f in e.findings if f.is_error]
    if errors:
        return f"claim not supported: {_names(errors)}"
    if e.untested:
        return f"incomplete: {', '.join(e.untested)} untested (ε = {_eps(eps)}); " + (
            lb or "no empirical bound"
        )
    return f"private as claimed (ε = {_eps(eps)}); " + (lb or "no empirical bound")


def verdict(e: Evidence) -> str:
    """The one-line verdict of a run (see the module docstring for the order)."""
    out = _privacy(e)
    b = e.balanced_accuracy
    if b is not None and b <= CHANCE_BALANCED:
        out += f"; utility at chance (balanced acc. {b:.3g})"
    return out


def findings_summary(findings) -> str:
    """Counts by severity, the error codes named: ``1 error (epsilon understated); 2
    warnings`` or ``none``."""
    n = Counter(f.severity for f in findings)
    parts = []
    for sev in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        if n[sev]:
            word = sev.value if sev is Severity.INFO or n[sev] == 1 else f"{sev.value}s"
            parts.append(f"{n[sev]} {word}")
    if n[Severity.ERROR]:
        parts[0] += f" ({_names(f for f in findings if f.is_error)})"
    return "; ".join(parts) or "none"
