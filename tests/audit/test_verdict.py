"""The one-line verdict of a run: each case, and which wins when several apply."""

import math

import pytest

from audit.findings import Code, Finding
from audit.report.verdict import CHANCE_BALANCED, Evidence, findings_summary, verdict

TAMPER = Finding(Code.ADAPTER_HASH_MISMATCH, "the adapter changed")
UNDER = Finding(Code.EPSILON_UNDERSTATED, "stated 8 < 9.1")
NOISE = Finding(Code.NOISE_REPRODUCIBLE, "seeded noise")
WARN = Finding(Code.METRICS_MISSING, "no metrics")
NO_DP = Finding(Code.NO_DP, "no DP")


def dp(**kw) -> Evidence:
    base = dict(dp_claimed=True, epsilon_claimed=8.0, epsilon_recomputed=7.99)
    return Evidence(**{**base, **kw})


@pytest.mark.parametrize(
    "evidence, expected",
    [
        (dp(empirical_lb=0.41), "private as claimed (ε = 7.99); empirical ε ≥ 0.41 at 95%"),
        (
            dp(empirical_lb=0.0, alpha=0.1),
            "private as claimed (ε = 7.99); the canary audit certifies no ε > 0 at 90%",
        ),
        (dp(), "private as claimed (ε = 7.99); no empirical bound"),
        (dp(findings=(WARN,)), "private as claimed (ε = 7.99); no empirical bound"),
        (
            dp(epsilon_recomputed=9.1, understated=True, findings=(UNDER,)),
            "ε understated (recomputed 9.1 > claimed 8)",
        ),
        (dp(findings=(TAMPER,)), "tampered: adapter hash mismatch"),
        (
            dp(empirical_lb=9.5),
            "leaks more than claimed: empirical ε ≥ 9.5 at 95% > recomputed 7.99",
        ),
        (  # client level: one canary may reach 2ε (replace-one-client) without a leak
            dp(empirical_lb=12.0, empirical_limit=15.98, empirical_exceeds=False),
            "private as claimed (ε = 7.99); empirical ε ≥ 12 at 95% (one client's data "
            "changed: replace-one-client allows 2ε = 16)",
        ),
        (
            dp(empirical_lb=17.0, empirical_limit=15.98, empirical_exceeds=True),
            "leaks more than claimed: empirical ε ≥ 17 at 95% (one client's data changed: "
            "replace-one-client allows 2ε = 16) > recomputed 7.99",
        ),
        (dp(findings=(NOISE, WARN)), "claim not supported: noise reproducible"),
        (Evidence(False, findings=(NO_DP,)), "no DP claimed"),
        (Evidence(False, empirical_lb=2.5), "no DP claimed; empirical ε ≥ 2.5 at 95%"),
        (
            dp(audit_error="manifest.json: no privacy block"),
            "not audited: manifest.json: no privacy block",
        ),  # fmt: skip
        (
            dp(epsilon_claimed=math.inf, epsilon_recomputed=math.inf),
            "private as claimed (ε = ∞); no empirical bound",
        ),  # fmt: skip
    ],
)
def test_each_case(evidence, expected):
    assert verdict(evidence) == expected


def test_the_worse_finding_wins():
    # tampering over an understated ε over an empirical bound above the claim
    both = dp(epsilon_recomputed=9.1, understated=True, findings=(UNDER, TAMPER), empirical_lb=20)
    assert verdict(both) == "tampered: adapter hash mismatch"
    assert verdict(dp(understated=True, empirical_lb=20)).startswith("ε understated")
    # an audit that could not run says so, whatever else is known
    assert verdict(dp(audit_error="x", findings=(TAMPER,))) == "not audited: x"


def test_utility_at_chance_is_appended():
    at = dp(empirical_lb=0.0, balanced_accuracy=CHANCE_BALANCED)
    assert verdict(at) == (
        "private as claimed (ε = 7.99); the canary audit certifies no ε > 0 at 95%; "
        "utility at chance (balanced acc. 0.52)"
    )
    assert "chance" not in verdict(dp(balanced_accuracy=CHANCE_BALANCED + 0.01))
    assert verdict(Evidence(False, balanced_accuracy=0.5)) == (
        "no DP claimed; utility at chance (balanced acc. 0.5)"
    )


def test_findings_summary_counts_and_names_errors():
    assert findings_summary([]) == "none"
    assert findings_summary([NO_DP]) == "1 info"
    assert findings_summary([UNDER, NOISE, UNDER, WARN, WARN, NO_DP]) == (
        "3 errors (epsilon understated, noise reproducible); 2 warnings; 1 info"
    )
    assert findings_summary([TAMPER, WARN]) == "1 error (adapter hash mismatch); 1 warning"


def test_an_untested_part_is_incomplete_never_private_as_claimed():
    """No pass without a test (audit.coverage): nothing found but a part untested reads
    incomplete, with the parts; an error finding still wins (fail before incomplete)."""
    from audit.coverage import Coverage
    from audit.report.verdict_table import headline, run_untested

    e = dp(untested=("sampling", "clipping"), empirical_lb=0.41)
    assert verdict(e) == (
        "incomplete: sampling, clipping untested (ε = 7.99); empirical ε ≥ 0.41 at 95%"
    )
    assert verdict(dp(untested=("noise",), understated=True)).startswith("ε understated")
    assert verdict(dp(untested=("noise",), findings=(TAMPER,))).startswith("tampered")
    cov = Coverage().add("noise", "canaries").add("clipping", "replay")
    cov.inapplicable("sampling", "q = 1").skip("accounting", "no ledger")
    assert run_untested({"coverage": cov.to_dict()}) == ("accounting",)
    assert run_untested({}) == () and run_untested({"coverage": "x"}) == ()
    rows = [{"verdict": verdict(e)}, {"verdict": verdict(dp())}]
    assert headline(rows) == "2 runs: 1 incomplete, 1 private as claimed."
