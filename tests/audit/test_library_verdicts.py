"""The verdicts incomplete (exit 4) and the neighbour replay in library audits' files
(audit.libraries.results, #47): an "incomplete" is read like a "pass" or a "fail", with the
same untrusted-input checks — refused beside an error finding, without anything untested,
with a coverage that contradicts itself or its verdict, with the wrong exit code; a row's
``replay`` is checked when present (an empty replay is never a pass, a failed one never
beside a pass)."""

from __future__ import annotations

import copy
import json

import pytest

from audit.coverage import Coverage
from audit.libraries.results import ROW_KEYS, load_library_audits, save_result
from fl.errors import UsageError


def _coverage(*tested: str, skip: str | None = None) -> dict:
    cov = Coverage()
    for p in tested:
        cov.add(p, "canaries")
    if skip:
        cov.skip(skip, f"{skip}: no test reached it")
    return cov.to_dict()


def _doc(verdict="incomplete", **kw) -> dict:
    """A library audit's result as audit.libraries' audits return it (the keys a row needs)."""
    d = {
        "library": "opacus",
        "version": "1.6.0",
        "mode": "ghost",
        "claimed_epsilon": 2.0,
        "recomputed_epsilon": 1.9,
        "epsilon_lower_bound": 0.1,
        "implied_epsilon": "inf",
        "conformance": {"passed": True, "rejected": [], "tests": []},
        "findings": [],
        "untested": [],
        "coverage": _coverage("noise", "accounting", "sampling", skip="clipping"),
        "verdict": verdict,
        "exit_code": {"pass": 0, "incomplete": 4, "fail": 1}[verdict],
    }
    d.update(kw)
    return d


def _load(tmp_path, doc) -> dict:
    p = tmp_path / "a.json"
    p.write_text(json.dumps(doc))
    (row,) = load_library_audits(p)
    return row


def test_incomplete_is_read_with_its_coverage_and_replay(tmp_path):
    replay = {"verdict": "pass", "neighbours": 6, "releases": 240, "findings": []}
    row = _load(tmp_path, _doc(replay=replay))
    assert tuple(row) == ROW_KEYS
    assert row["verdict"] == "incomplete" and row["coverage"]["untested"] == ["clipping"]
    assert row["coverage"]["why"] == {"clipping": "clipping: no test reached it"}
    assert row["replay"] == replay
    # save_result writes what the reader reads (and checks it first)
    (again,) = load_library_audits(save_result(_doc(replay=replay), tmp_path / "b.json"))
    assert again["coverage"] == row["coverage"] and again["replay"] == replay


def test_a_pass_whose_every_part_was_tested_is_read(tmp_path):
    doc = _doc("pass", coverage=_coverage("noise", "accounting", "sampling", "clipping"))
    assert _load(tmp_path, doc)["coverage"]["untested"] == []
    # an old file without coverage or replay still reads (both None)
    old = _doc("pass")
    del old["coverage"]
    row = _load(tmp_path, old)
    assert row["coverage"] is None and row["replay"] is None


ERR = [{"code": "mechanism_mismatch", "message": "m", "severity": "error"}]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(findings=ERR), ["verdict is 'incomplete'", "mechanism_mismatch"]),
        (lambda d: d.update(exit_code=0), ["exit_code 0", "'incomplete'", "exit 4"]),
        (
            lambda d: d.update(coverage=_coverage("noise", "accounting", "sampling", "clipping")),
            ["'incomplete'", "tested every part"],
        ),  # fmt: skip
        (lambda d: d.update(coverage=None), ["names nothing untested"]),
        (lambda d: d.update(verdict="pass", exit_code=0), ["'pass'", "['clipping'] untested"]),
        (lambda d: d["coverage"].update(untested=[]), ["coverage.untested is []", "clipping"]),
        (lambda d: d["coverage"]["tested"].update(privacy=["x"]), ["'privacy'", "not one of"]),
        (lambda d: d["coverage"]["tested"].update(noise="canaries"), ["coverage.tested.noise"]),
        (lambda d: d["coverage"]["why"].update(clipping=3), ["coverage.why.clipping"]),
        (lambda d: d.update(coverage=[]), ["'coverage' is list"]),
        (lambda d: d.update(verdict="maybe"), ["'maybe'", "incomplete"]),
    ],
)
def test_bad_incomplete_files_are_refused(edit, words, tmp_path):
    d = _doc()
    edit(d)
    with pytest.raises(UsageError) as e:
        _load(tmp_path, d)
    msg = str(e.value)
    assert "a.json" in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(
    "replay, words",
    [
        (
            {"verdict": "pass", "neighbours": 0, "releases": 10},
            ["compared nothing", "replay_empty"],
        ),
        ({"verdict": "pass", "neighbours": 3, "releases": 0}, ["compared nothing"]),
        ({"verdict": "fail", "neighbours": 3, "releases": 9}, ["replay lists no finding"]),
        ({"verdict": "maybe"}, ["replay.verdict", "not run"]),
        ({"verdict": "pass", "neighbours": -1, "releases": 3}, ["replay.neighbours"]),
        ({"verdict": "pass", "neighbours": True, "releases": 3}, ["replay.neighbours"]),
        ({"verdict": "pass", "neighbours": 2, "releases": 3, "findings": "x"}, ["replay.findings"]),
        ("pass", ["'replay' is str"]),
        (
            {
                "verdict": "fail",
                "neighbours": 2,
                "releases": 3,
                "findings": ["sensitivity_exceeded"],
            },
            ["'incomplete'", "replay failed"],
        ),  # fmt: skip
    ],
)
def test_bad_replays_are_refused(replay, words, tmp_path):
    with pytest.raises(UsageError) as e:
        _load(tmp_path, _doc(replay=replay))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_replay_that_was_not_run_or_failed_is_shown_as_such(tmp_path):
    row = _load(tmp_path, _doc(replay={"verdict": "not run", "reason": "no hook for this mode"}))
    assert row["replay"] == {"verdict": "not run", "neighbours": 0, "releases": 0,
                             "findings": [], "reason": "no hook for this mode"}  # fmt: skip
    failed = _doc("fail", findings=[{"code": "sensitivity_exceeded", "message": "step 3"}],
                  replay={"verdict": "fail", "neighbours": 2, "releases": 9,
                          "findings": ["sensitivity_exceeded"]})  # fmt: skip
    assert _load(tmp_path, failed)["replay"]["findings"] == ["sensitivity_exceeded"]


def test_benchmark_rows_take_incomplete_and_replay(tmp_path):
    """The benchmark's results.json: a row may be incomplete (its codes are errors, so none
    beside it), expect incomplete, and carry a replay."""
    row = {k: v for k, v in _doc().items() if k not in ("conformance", "exit_code")}
    row.update(conformance="pass", findings=[], expected="incomplete",
               replay={"verdict": "not run"})  # fmt: skip
    doc = {"rows": [row, copy.deepcopy(row)]}
    doc["rows"][1].update(verdict="fail", findings=["sensitivity_exceeded"], expected="fail",
                          replay={"verdict": "fail", "neighbours": 1, "releases": 4,
                                  "findings": ["sensitivity_exceeded"]})  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(doc))
    a, b = load_library_audits(tmp_path)
    assert a["verdict"] == a["expected"] == "incomplete" and a["replay"]["verdict"] == "not run"
    assert b["replay"]["verdict"] == "fail"
    doc["rows"][0]["findings"] = ["noise_absent"]
    (tmp_path / "results.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match=r"rows\[0\]: the verdict is 'incomplete'"):
        load_library_audits(tmp_path)


# --------------------------------------------------------------------------- the report


def test_a_report_of_library_audits_alone_opens_on_their_verdicts(tmp_path):
    """`fedlora report --library-audit DIR` with no run: the Verdict section is the
    libraries' verdicts (not "missing: no run directories"), incomplete its own verdict
    with its untested parts, the replay in its own column; the headline counts all three."""
    from pipeline.cli import main

    folder = tmp_path / "audits"
    folder.mkdir()
    rep = {"verdict": "pass", "neighbours": 6, "releases": 240, "findings": []}
    save_result(_doc(replay=rep), folder / "ghost.json")
    save_result(_doc("pass", mode="flat", coverage=_coverage(*("noise", "accounting",
                "sampling", "clipping"))), folder / "flat.json")  # fmt: skip
    save_result(_doc("fail", mode="no_clip", findings=[{"code": "sensitivity_exceeded",
                "message": "step 3: 7.1 > 2"}], replay={"verdict": "fail", "neighbours": 2,
                "releases": 9, "findings": ["sensitivity_exceeded"]}), folder / "bad.json")  # fmt: skip
    out = tmp_path / "report"
    assert main(["report", "--library-audit", str(folder), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.splitlines()[2] == "library audits: 1 pass, 1 incomplete, 1 fail."
    first = md.split("\n## ")[1]
    assert first.startswith("Verdict\n") and "missing" not in first
    assert "| opacus | 1.6.0 | 3 | 1 | 1 | 1 |" in first
    assert "**opacus ghost**: incomplete: clipping untested" in first
    assert "**opacus no_clip**: fail (sensitivity_exceeded)" in first
    sec = md.split("\n## Library audits\n")[1].split("\n## ")[0]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")]
            for r in sec.splitlines() if r.startswith("| ") and not r.startswith("| mode")}  # fmt: skip
    assert rows["ghost"][2] == "incomplete: clipping untested"
    assert rows["ghost"][8] == "pass: 6 neighbours, 240 releases"
    assert rows["no_clip"][8] == "fail: sensitivity_exceeded" and rows["flat"][8] == "–"
    assert rows["flat"][2] == "pass" and rows["no_clip"][2] == "fail"
    assert "**not tested (no_clip, ghost)**: clipping untested: clipping: no test reached it" in sec
    # the page: codes may wrap at their underscores (tables fit a laptop's width)
    page = (out / "report.html").read_text()
    assert "sensitivity_<wbr>exceeded" in page and "<h2>Verdict</h2>" in page
