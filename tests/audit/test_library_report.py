"""Library audits in the report (#43): audit.libraries.results saves a library audit's
result and reads it back, or the benchmark's results.json, as one row schema, refusing
untrusted files that are malformed (NaN, wrong types, a verdict that contradicts its
findings); ``fedlora report --library-audit DIR`` shows them after the runs' verdict, counts
them in the headline and keeps the page readable at a laptop's and a phone's width."""

from __future__ import annotations

import copy
import json
import math
import re
import warnings
from pathlib import Path

import pytest

from audit.libraries.results import (
    ROW_KEYS,
    load_library_audits,
    read_library_audits,
    save_result,
)
from fl.errors import UsageError
from pipeline.cli import main

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "libraries"


@pytest.fixture(scope="module")
def opacus_results():
    """Two real Opacus trainings audited end to end: a correct one and a σ set by hand to
    0.6 × the claim's (the benchmark's cases, 40 steps)."""
    pytest.importorskip("opacus")
    from benchmarks.auditing.libraries import train_and_audit

    warnings.filterwarnings("ignore", module="opacus")
    ok = train_and_audit("flat_poisson", steps=40, permutations=99)
    low = train_and_audit("low_sigma", steps=40, permutations=99)
    assert ok["verdict"] == "pass" and low["verdict"] == "fail"
    return ok, low


def _one_line_exit_2(argv, capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (argv, err)
    return err[0]


# --------------------------------------------------------------------------- save / load


def test_save_and_load_a_real_audit(opacus_results, tmp_path):
    ok, low = opacus_results
    save_result(ok, tmp_path / "ok.json")
    save_result(low, tmp_path / "library_audit.json")
    rows = load_library_audits(tmp_path)
    assert [tuple(r) for r in rows] == [ROW_KEYS, ROW_KEYS]
    by = {Path(r["source"]).name: r for r in rows}
    for name, res in (("ok.json", ok), ("library_audit.json", low)):
        r = by[name]
        assert r["library"] == "opacus" and r["mode"] == res["case"]
        assert r["claimed_epsilon"] == res["claimed_epsilon"]
        assert r["recomputed_epsilon"] == res["recomputed_epsilon"]
        assert r["epsilon_lower_bound"] == res["epsilon_lower_bound"]
        assert r["implied_epsilon"] == res["implied_epsilon"]
        assert r["findings"] == [f["code"] for f in res["findings"]]
        assert r["verdict"] == res["verdict"] and r["untested"] == res["untested"]
        scale = [t["observed_over_claimed"] for t in res["conformance"]["tests"]
                 if t["test"] == "scale"]  # fmt: skip
        assert r["noise_ratio"] == min(scale)
    assert by["ok.json"]["conformance"] == "pass"
    # σ at 0.6 × the claim's: the scale test sees about 0.6 of the claimed noise
    assert by["library_audit.json"]["conformance"].startswith("reject: ")
    assert 0.45 < by["library_audit.json"]["noise_ratio"] < 0.75
    # strict JSON on disk (no NaN / Infinity literals), written whole
    json.loads((tmp_path / "ok.json").read_text(), parse_constant=lambda c: 1 / 0)


def test_infinite_epsilon_is_kept_and_numpy_values_are_written(opacus_results, tmp_path):
    import numpy as np

    ok, _ = opacus_results
    res = copy.deepcopy(ok)
    res["recomputed_epsilon"] = math.inf
    res["implied_epsilon"] = np.float64(math.inf)
    res["epsilon_lower_bound"] = np.float32(0.5)
    res["extra_array"] = np.arange(3)
    (r,) = load_library_audits(save_result(res, tmp_path / "a.json"))
    assert r["recomputed_epsilon"] == math.inf and r["implied_epsilon"] == math.inf
    assert r["epsilon_lower_bound"] == pytest.approx(0.5)
    assert '"inf"' in (tmp_path / "a.json").read_text()


def test_a_list_of_results_is_read(opacus_results, tmp_path):
    # a JSON list of audits' results (as a benchmark that dumps its raw results writes)
    doc = [_audit_doc(opacus_results), json.loads(json.dumps(opacus_results[1], default=float))]
    (tmp_path / "runs.json").write_text(json.dumps(doc))
    rows = load_library_audits(tmp_path)
    assert [r["verdict"] for r in rows] == ["pass", "fail"]
    assert rows[1]["source"].endswith("runs.json [1]")
    doc[1]["verdict"] = "pass"
    (tmp_path / "runs.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match=r"runs.json \[1\]: the verdict is 'pass'"):
        load_library_audits(tmp_path)


def test_benchmark_results_are_read_in_the_same_schema():
    doc = read_library_audits(BENCH)
    rows = doc["rows"]
    raw = json.loads((BENCH / "results.json").read_text())["rows"]
    assert len(rows) == len(raw) and all(tuple(r) == ROW_KEYS for r in rows)
    for r, x in zip(rows, raw):
        assert r["mode"] == x["mode"] and r["verdict"] == x["verdict"]
        assert r["claimed_epsilon"] == x["claimed_epsilon"] and r["findings"] == x["findings"]
        assert r["expected"] == x["expected"]
    assert doc["undetectable"] and "python -m benchmarks" in doc["commands"][0]


def _audit_doc(opacus_results) -> dict:
    return json.loads(json.dumps(opacus_results[0], default=float))


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(claimed_epsilon=float("nan")), ["claimed_epsilon", "NaN"]),
        (lambda d: d.update(recomputed_epsilon="NaN"), ["recomputed_epsilon", "not a number"]),
        (lambda d: d.update(claimed_epsilon=None), ["claimed_epsilon", "missing"]),
        (lambda d: d.update(epsilon_lower_bound=-1.0), ["epsilon_lower_bound", "< 0"]),
        (lambda d: d.update(implied_epsilon=True), ["implied_epsilon", "not a number"]),
        (lambda d: d.update(verdict="ok"), ["verdict", "'ok'"]),
        (lambda d: d.update(findings="none"), ["findings", "not a list"]),
        (lambda d: d.update(untested=[1, 2]), ["untested", "list of strings"]),
        (lambda d: d.pop("library"), ["missing field", "library"]),
        (lambda d: d.update(conformance=[]), ["conformance"]),
        (
            lambda d: d.update(findings=[{"code": "epsilon_understated", "message": "m"}]),
            ["verdict is 'pass'", "epsilon_understated"],
        ),
        (lambda d: d.update(verdict="fail", exit_code=1), ["'fail'", "no finding"]),
        (lambda d: d.update(exit_code=1), ["exit_code"]),
    ],
)
def test_bad_audit_files_are_refused_naming_file_and_field(edit, words, opacus_results, tmp_path):
    d = _audit_doc(opacus_results)
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))  # NaN written as the literal NaN, as json.dumps does
    with pytest.raises(UsageError) as e:
        load_library_audits(tmp_path)
    msg = str(e.value)
    assert str(p) in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\x80\x04\x95pickle", ["not UTF-8"]),
        (b"", ["empty"]),
        (b"{not json", ["invalid JSON"]),
        (b"[1, 2]", ["neither a library audit"]),
        (b'{"rows": 3}', ["'rows' is not a list"]),
        (b'{"rows": [{"library": "x"}]}', ["rows[0]", "missing field"]),
    ],
)
def test_unreadable_files_are_refused(content, words, tmp_path):
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(UsageError) as e:
        load_library_audits(tmp_path / "x.json")
    for w in words:
        assert w in str(e.value), str(e.value)


def test_benchmark_row_nan_is_refused(tmp_path):
    doc = json.loads((BENCH / "results.json").read_text())
    doc["rows"][2]["implied_epsilon"] = float("nan")
    (tmp_path / "results.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match=r"results.json rows\[2\]: field 'implied_epsilon' is NaN"):
        load_library_audits(tmp_path)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        load_library_audits(tmp_path / "none")
    with pytest.raises(UsageError, match=r"no \*.json"):
        load_library_audits(tmp_path)


# --------------------------------------------------------------------------- the report


@pytest.fixture(scope="module")
def report(opacus_results, tmp_path_factory):
    """A tiny DP run of the toolkit, beside the benchmark's results and two saved per-run
    audits, in one report written by `fedlora report`."""
    from fl.run.engine import train
    from fl.testing import tiny_config

    tmp = tmp_path_factory.mktemp("libreport")
    run = tmp / "dp-run"
    train(tiny_config(rounds=1, dp_level="sample", noise_multiplier=2.0), run, quiet=True)
    mine = tmp / "mine"
    mine.mkdir()
    save_result(opacus_results[0], mine / "library_audit.json")
    save_result(opacus_results[1], mine / "low_sigma.json")
    out = tmp / "report"
    argv = ["report", str(run), "--library-audit", str(BENCH), "--library-audit", str(mine),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


def test_report_shows_library_audits_after_the_verdict(report):
    md, page = (report / "report.md").read_text(), (report / "report.html").read_text()
    bench = json.loads((BENCH / "results.json").read_text())["rows"]
    n_pass = sum(r["verdict"] == "pass" for r in bench) + 1
    n_fail = sum(r["verdict"] == "fail" for r in bench) + 1
    # the headline: the runs' verdicts, then the library audits counted
    head = md.splitlines()[2]
    assert re.fullmatch(
        rf"1 run: .+ · library audits: {n_pass} pass, {n_fail} fail "
        rf"\({len(bench)} of {len(bench)} as expected\)\.",
        head,
    ), head
    titles = re.findall(r"<h2>(.*?)</h2>", page)
    assert titles[:2] == ["Verdict", "Library audits"]
    sec = md.split("\n## Library audits\n")[1].split("\n## ")[0]
    # one table per library and version; rows in the order read (the benchmark's, then the
    # two per-run files, which carry no expectation)
    table = [
        x
        for x in sec.splitlines()
        if x.startswith("| ") and not x.startswith("| mode |") and not x.startswith("|---")
    ]
    assert len(table) == len(bench) + 2
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in table]
    assert [c[0] for c in cells[: len(bench)]] == [r["mode"] for r in bench]
    assert [c[2] for c in cells[: len(bench)]] == [f"{r['verdict']} (as expected)" for r in bench]
    assert [c[2] for c in cells[len(bench) :]] == ["pass", "fail"]  # no expectation
    for lib in {r["library"] for r in bench}:
        assert f"**{lib} " in sec  # each library's table is headed by its name and version
    # the averaged-noise bug: σ below the PLD floor, so its ε is "at least"
    (avg,) = [c for c in cells if c[0] == "averaged_noise"]
    assert avg[4].startswith("≥ ") and "noise_multiplier_mismatch" in avg[9]
    # the benchmark's rows carry the neighbour replay (the averaged-noise bug: its clipping is
    # right, so the replay passes; the canaries fail it)
    assert avg[8].startswith("pass: ") and " neighbours, " in avg[8], avg[8]
    assert "secure_mode=False" in sec and "python -m benchmarks.auditing.libraries" in md
    # the wide table is a card table on a phone
    assert page.count('<table class="stack') >= 2


def test_bad_library_audit_is_a_usage_error_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "r.json").write_text('{"library": "opacus", "verdict": "pass"}')
    line = _one_line_exit_2(
        ["report", "--library-audit", str(tmp_path / "in"), "--out", str(tmp_path / "o")], capsys
    )
    assert "r.json" in line and "missing field" in line
    assert not (tmp_path / "o").exists()


def test_report_size_stays_small(report):
    # nine benchmark rows and two saved audits add tens of kB, not hundreds (the report's
    # 1 MB budget: tests/audit/test_report_figures.py)
    page = (report / "report.html").read_text()
    start = page.index("<h2>Library audits</h2>")
    end = page.index("</section>", start)
    assert end - start < 30_000
    assert len(page.encode()) < 1_000_000


# --------------------------------------------------------------------------- the browser


def _browser_helpers():
    """The report's headless-Chromium helpers (tests/audit/test_report_browser.py; the tests
    are imported by path: --import-mode=importlib)."""
    import importlib.util

    path = Path(__file__).with_name("test_report_browser.py")
    spec = importlib.util.spec_from_file_location("_report_browser_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_B = _browser_helpers()
WIDTHS, _layout, chromium = _B.WIDTHS, _B._layout, _B.chromium


@pytest.mark.parametrize("device", list(WIDTHS))
def test_library_table_at_laptop_and_phone_width(report, chromium, tmp_path, device):  # noqa: F811
    width, height = WIDTHS[device]
    page = (report / "report.html").read_text()
    # the probe reads the first card table: put the library table first by dropping the
    # runs' verdict table from this copy
    start = page.index("<h2>Verdict</h2>")
    page = page[:start] + page[page.index("</section>", start) :]
    seen = _layout(chromium, page, width, height, tmp_path, tmp_path / f"{device}.png")
    assert seen["W"] == width and seen["scroll"] <= seen["W"], seen
    assert seen["out"] == [], seen["out"]
    if device == "phone":
        assert seen["thead"] == "none" and seen["row"] <= seen["W"]
    else:
        assert seen["thead"] == "table-header-group"
        # every table whole at 1366 px: the findings column is not cut off (a sideways
        # scroll inside the table's container would hide it)
        assert seen["cut"] == [], seen["cut"]


def test_report_files_are_readable_by_others(report):
    """A report is meant to be shared: report.html and report.md get the mode a plain
    open() gives under the process's umask (the atomic write's temporary file is 0600)."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    for name in ("report.html", "report.md"):
        assert stat.S_IMODE((report / name).stat().st_mode) == 0o666 & ~umask
