"""The suite's time budget (tests/suite_budget.py, issue 49): the longest-first order of
the files, the guard that fails a session whose slowest file is over budget, the table."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def sb():
    import importlib.util
    import sys

    name = "fedlora_tests_suite_budget"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / "suite_budget.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _item(nodeid):
    return SimpleNamespace(nodeid=nodeid)


def test_files_go_longest_first_keeping_each_files_order(sb):
    ids = ["t/a.py::x", "t/b.py::y", "t/a.py::z", "t/c.py::w", "t/d.py::v", "t/b.py::u"]
    got = [
        i.nodeid
        for i in sb.longest_first(
            [_item(i) for i in ids], {"t/a.py": 1.0, "t/b.py": 9.0, "t/d.py": 3.0}
        )
    ]
    # c is unknown: the median (3.0) ties with d, which came later in the collection
    assert got == ["t/b.py::y", "t/b.py::u", "t/c.py::w", "t/d.py::v", "t/a.py::x", "t/a.py::z"]
    assert [i.nodeid for i in sb.longest_first([_item(i) for i in ids], {})] == ids
    assert sb.over_budget({"a": 91.0, "b": 90.0, "c": 120.0}, 90) == [("c", 120.0), ("a", 91.0)]


def test_the_budget_is_read_with_its_reason_and_bad_ones_are_named(sb, tmp_path):
    budget, reason = sb.read_budget()  # the project's own
    assert budget > 0 and len(reason) > 40
    bad = tmp_path / "p.toml"
    bad.write_text("[tool.fedlora.test-budget]\nslowest_file_seconds = 0\nreason = 'x'\n")
    with pytest.raises(ValueError, match="must be > 0"):
        sb.read_budget(bad)
    bad.write_text("[tool.fedlora]\n")
    with pytest.raises(ValueError, match="slowest_file_seconds"):
        sb.read_budget(bad)
    assert sb.load_durations(tmp_path / "absent.json") == {}
    assert sb.load_durations() and all(v >= 0 for v in sb.load_durations().values())


def test_the_timer_sums_each_files_phases_and_the_table_shows_them(sb):
    t = sb.Timer()
    gw = SimpleNamespace(gateway=SimpleNamespace(id="gw1"))
    for nid, d in [("t/a.py::x", 1.0), ("t/a.py::x", 0.5), ("t/a.py::y", 2.0), ("t/b.py::z", 4.0)]:
        t.add(SimpleNamespace(nodeid=nid, duration=d, node=gw))
    doc = t.doc()
    assert doc["seconds"] == {"t/a.py": 3.5, "t/b.py": 4.0}
    assert doc["tests"] == {"t/a.py": 2, "t/b.py": 1}
    md = sb.table(doc)
    assert md.index("`t/b.py` | 1 | 4.0 | gw1") < md.index("`t/a.py` | 2 | 3.5 | gw1")
    assert "gw1 8 s" in md


@pytest.mark.parametrize("budget, fails", [(0.05, True), (1000, False)])
def test_the_guard_fails_a_session_whose_slowest_file_is_over_budget(
    sb, pytester, monkeypatch, budget, fails
):
    tests = TESTS
    pytester.makeconftest((tests / "conftest.py").read_text(encoding="utf-8"))
    (pytester.path / "suite_budget.py").write_text(
        (tests / "suite_budget.py").read_text(encoding="utf-8"), encoding="utf-8"
    )
    toml = pytester.path / "budget.toml"
    toml.write_text(f"[tool.fedlora.test-budget]\nslowest_file_seconds = {budget}\nreason = 'r'\n")
    pytester.makepyfile(
        test_slow="import time\n\ndef test_a():\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 0.2:\n        pass\n",
        test_fast="def test_b():\n    pass\n",
    )
    out = pytester.path / "durations.json"
    monkeypatch.setenv("FEDLORA_SUITE_BUDGET", "1")
    monkeypatch.setenv("FEDLORA_TEST_BUDGET_FILE", str(toml))
    monkeypatch.setenv("FEDLORA_SUITE_DURATIONS", str(out))
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    doc = json.loads(out.read_text())
    assert doc["seconds"]["test_slow.py"] >= 0.2 > doc["seconds"]["test_fast.py"]
    if fails:
        assert res.ret == 1
        res.stdout.fnmatch_lines(["*test budget exceeded: test_slow.py 0 s > 0.05 s per file*"])
        assert "test_fast.py" not in res.stdout.str().split("test budget exceeded")[1]
    else:
        assert res.ret == 0 and "test budget exceeded" not in res.stdout.str()
