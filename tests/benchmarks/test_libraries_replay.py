"""benchmarks.auditing.libraries: the replay column and the verdict of both instruments (#47).

No training: a canary audit's result is written by hand, the replay beside it, and the row
is read back by the report's loader (audit.libraries.results), which refuses a row that
contradicts itself."""

from __future__ import annotations

import json

import pytest

from audit.coverage import Coverage
from audit.libraries.results import load_library_audits
from benchmarks.auditing.libraries import replay_cell, row


def _res(verdict="pass", untested=(), findings=()):
    cov = Coverage()
    for part in ("sampling", "clipping", "noise", "accounting"):
        if part in untested:
            cov.skip(part, "not reached by the canaries")
        else:
            cov.add(part, "canaries")
    return {
        "library": "opacus",
        "case": "flat_poisson",
        "conformance": {"tests": [], "passed": True, "rejected": []},
        "claimed_epsilon": 1.0,
        "recomputed_epsilon": 1.0,
        "accountant_epsilon": 1.0,
        "epsilon_lower_bound": 0.0,
        "implied_epsilon": 1.0,
        "recomputed_epsilon_at_least": False,
        "implied_epsilon_at_least": False,
        "findings": [{"code": c, "severity": "error", "message": ""} for c in findings],
        "untested": list(untested),
        "coverage": cov.to_dict(),
        "verdict": verdict,
        "run": {},
        "wall_s": 1.0,
    }


PASS = {"verdict": "pass", "neighbours": 3, "releases": 60, "findings": [], "max_ratio": 1.0}
FAIL = {
    "verdict": "fail",
    "neighbours": 2,
    "releases": 10,
    "findings": ["sensitivity_exceeded"],
    "max_ratio": 7.3,
}


def _load(tmp_path, r):
    (tmp_path / "results.json").write_text(json.dumps({"rows": [r]}))
    return load_library_audits(tmp_path)[0]


def test_a_failed_replay_fails_the_row_and_its_findings_join(tmp_path):
    r = row(_res(), "correct", "x", "1.6", FAIL, "opacus")
    assert r["verdict"] == "fail" and r["canary_verdict"] == "pass"
    assert "sensitivity_exceeded" in r["findings"]
    back = _load(tmp_path, r)
    assert back["replay"]["verdict"] == "fail" and back["verdict"] == "fail"


def test_a_passed_replay_tests_the_clipping_the_canaries_could_not(tmp_path):
    r = row(_res("incomplete", untested=("clipping",)), "correct", "x", "1.6", PASS, "opacus")
    assert r["verdict"] == "pass" and r["untested"] == []
    assert "replay" in r["coverage"]["tested"]["clipping"]
    assert _load(tmp_path, r)["verdict"] == "pass"
    # another part untested stays incomplete: the replay tests the clipping only
    r = row(_res("incomplete", untested=("noise",)), "correct", "x", "1.6", PASS, "opacus")
    assert r["verdict"] == "incomplete" and r["untested"] == ["noise"]
    assert _load(tmp_path, r)["verdict"] == "incomplete"


def test_not_run_replay_changes_nothing_and_the_cell_says_why(tmp_path):
    nr = {"verdict": "not run", "neighbours": 0, "releases": 0, "findings": [], "reason": "x"}
    r = row(_res("incomplete", untested=("clipping",)), "correct", "x", "1.6", nr, "opacus")
    assert r["verdict"] == "incomplete"
    assert _load(tmp_path, r)["replay"]["verdict"] == "not run"
    assert replay_cell(nr) == "not run: x"
    assert replay_cell(FAIL) == "fail (2 nb × 10 rel, max ‖Δq‖/bound 7.3): sensitivity_exceeded"
    assert replay_cell(None) == "—"


@pytest.mark.parametrize("verdict", ["pass", "fail"])
def test_no_replay_keeps_the_canary_verdict(verdict):
    res = _res(verdict, findings=("x",) if verdict == "fail" else ())
    assert row(res, "correct", "x", "1.6")["verdict"] == verdict
