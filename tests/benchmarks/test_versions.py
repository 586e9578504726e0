"""The versions benchmark (#47 item 4) without installs: the releases it picks, the
requirements it installs, its rows and table, and the child process that sees the overlay."""

from pathlib import Path

from benchmarks.auditing import versions as V

FLWR = "1.42.0 1.41.0 1.26.1 1.26.0 1.9.0 1.8.0 1.7.0 1.10.0rc1 0.19.0".split()


def test_releases_in_range_and_the_three_picked():
    rel = V.releases(FLWR, "1.8.0", "1.42.0")
    assert rel == ["1.8.0", "1.9.0", "1.26.0", "1.26.1", "1.41.0", "1.42.0"]  # no rc
    assert V.pick(rel) == ["1.8.0", "1.26.1", "1.42.0"]  # upper middle of an even count
    assert V.pick(["1.4.0", "1.5", "1.6.0"]) == ["1.4.0", "1.5", "1.6.0"]
    assert V.pick(["0.6.0"]) == ["0.6.0"] and V.pick(["0.5.0", "0.6.0"]) == ["0.5.0", "0.6.0"]
    assert V.pick([]) == []
    assert V.below(FLWR, "1.8.0") == "1.7.0" and V.below(FLWR, "0.19.0") is None
    assert V.in_range("1.5", "1.4.0", "1.6.0") and not V.in_range("1.3.0", "1.4.0", "1.6.0")
    assert V.releases(FLWR, None, "1.8.0")[0] == "0.19.0"


def test_unmet_requirements_markers_and_extras():
    req = [
        "numpy (>=1.21.0,<2.0.0)",
        "typer[all] (>=0.9.0,<0.10.0)",
        "rich<14; extra == 'all'",
        "torch==2.0.1 ; extra == 'pytorch'",
        "scipy>=1.2",
    ]
    have = {"numpy": "2.4.6", "typer": "0.20.1", "scipy": "1.17.1", "rich": "14.3.4"}
    got = dict(V.unmet(req, set(), have))
    assert got == {"numpy": "numpy<2.0.0,>=1.21.0", "typer": "typer[all]<0.10.0,>=0.9.0"}
    got = dict(V.unmet(req, {"all"}, have))
    assert got["rich"] == "rich<14" and "torch" not in got  # no marker left on the spec
    assert V.unmet(req, set(), {**have, "numpy": "1.26.4", "typer": "0.9.4"}) == []
    assert V.project_pins()["torch"] == "2.13.0"  # an overlay never replaces the pins
    # what a release needs of a resolution, a left-out pinned package taking its own
    # requirements with it
    res = {
        "pfl": ["numpy<2", "dp-accounting<0.5", "typer[all]"],
        "dp-accounting": ["absl-py~=1.0"],
        "absl-py": [],
        "numpy": [],
        "typer": ["rich; extra == 'all'"],
        "rich": [],
    }
    assert V.reachable("pfl", res, {"dp-accounting"}) == {"pfl", "numpy", "typer", "rich"}


def _row(**kw):
    c = {"case": "flat_poisson", "kind": "correct", "verdict": "pass", "expected": "pass"}
    c.update(kw)
    head = {"module_version": "1.4.0", "module_file": "/w/opacus-1.4.0/opacus/__init__.py"}
    return V.row("opacus", "1.4.0", True, head, c, Path("/w/opacus-1.4.0"))


def test_rows_status_and_table():
    assert _row()["status"] == "as expected" and _row()["isolated"]
    assert _row(verdict="fail")["status"] == "not as expected"
    err = _row(verdict=None, expected=None, error="ModuleNotFoundError: x", where="a.py:3")
    assert err["status"] == "error" and err["expected"] == "pass"  # from the kind
    head = {"module_version": "1.6.0", "module_file": "/site/opacus/__init__.py"}
    c = {"case": "flat_poisson", "kind": "correct", "verdict": "pass", "expected": "pass"}
    assert V.row("opacus", "1.4.0", True, head, c, Path("/w/o"))["status"] == "not isolated"
    head = {"module_version": "1.3.0", "module_file": "/w/o/opacus/__init__.py"}
    out = V.row(
        "opacus", "1.3.0", False, head, {"case": "x", "error": "E: needs 1.4; 1.3.0"}, Path("/w/o")
    )
    assert out["status"] == "as expected" and out["expected"].startswith("clear error")
    chk = V.row(
        "opacus",
        "1.4.0",
        True,
        {"module_version": "1.4.0", "module_file": "/w/o/opacus/__init__.py"},
        {"case": V.CHECK, "verdict": "accepted"},
        Path("/w/o"),
    )
    assert (
        chk["kind"] == "check" and chk["expected"] == "accepted" and chk["status"] == "as expected"
    )
    spec = V.parse_stated("flwr >= 1.20, < 1.43 (1.20 … 1.42; the Message API from 1.21)")
    assert spec == "<1.43,>=1.20" and V.in_stated("1.42.0", spec) and not V.in_stated("1.8.0", spec)
    assert V.in_stated("1.8.0", None) is None and V.parse_stated("nonsense ((") is None
    c = {"case": "x", "kind": "correct", "error": "RuntimeError: supports flwr >= 1.20; 1.8.0"}
    refused = V.row(
        "flwr", "1.8.0", True, {**head, "module_version": "1.8.0"}, c, Path("/w/o"), spec
    )
    assert refused["status"] == "refused" and refused["in_stated_range"] is False
    vague = V.row(
        "opacus", "1.3.0", False, head, {"case": "x", "error": "E: no module"}, Path("/w/o")
    )
    assert vague["status"] == "not as expected"
    head = {
        "command": "python -m benchmarks.auditing.versions",
        "machine": "m",
        "date": "d",
        "commit": "c",
        "dirty": False,
        "wall_s": 1.0,
        "base": "Python 3.11",
        "ranges": {
            "opacus": {
                "first": "1.4.0",
                "last": "1.6.0",
                "releases": ["1.4.0", "1.5", "1.6.0"],
                "picked": ["1.4.0", "1.5", "1.6.0"],
                "below": "1.3.0",
                "source": "pip index versions",
            }
        },
    }
    env = {"library": "opacus", "version": "1.4.0", "seconds": 1.2, "packages": {"opacus": "1.4.0"}}
    md = V.table(head, [_row(), err, out], [{**env, "unmet": [], "errors": []}])
    lines = md.splitlines()
    assert "| opacus | 1.4.0 … 1.6.0 | 3: 1.4.0, 1.5, 1.6.0 | 1.4.0, 1.5, 1.6.0 | 1.3.0 |" in md
    assert any(
        s.startswith("| opacus | 1.4.0 | yes | flat_poisson | correct | pass | pass |")
        for s in lines
    )
    assert "ModuleNotFoundError: x (`a.py:3`)" in md and "**error**" in md
    assert "2 of 3 rows as expected, 1 error." in md
    rows = [s for s in lines if " | yes | " in s or " | **no** | " in s]
    assert len(rows) == 3 and len({s.count(" | ") for s in rows}) == 1  # one column count


def _fake(root: Path, version: str) -> Path:
    (root / "fakelib").mkdir(parents=True)
    (root / "fakelib" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return root


def test_child_sees_the_overlay(tmp_path):
    v1, v2 = _fake(tmp_path / "v1", "1"), _fake(tmp_path / "v2", "2")
    env = {"PATH": "/usr/bin:/bin"}
    alone = V.probe("fakelib", [v1], env=env)
    assert alone["version"] == "1" and alone["file"].startswith(str(v1))
    # v2 installed (on the path the child inherits): the overlay shadows it
    shadow = V.probe("fakelib", [v1], env={**env, "PYTHONPATH": str(v2)})
    assert shadow["version"] == "1" and shadow["file"].startswith(str(v1))
    assert V.probe("fakelib", [], env={**env, "PYTHONPATH": str(v2)})["version"] == "2"
    missing = V.probe("fakelib", [tmp_path / "none"], env=env)
    assert missing["version"] is None and "ModuleNotFoundError" in missing["error"]
    assert V.child_env([v1], env)["OMP_NUM_THREADS"] == "1"


def test_not_available_in_this_release():
    head = {"module_version": "1.5.2", "module_file": "/w/o/opacus/__init__.py"}
    err = "TypeError: DPOptimizer.__init__() got an unexpected keyword argument 'criterion'"
    c = {"case": "ghost", "kind": "correct", "error": err, "where": "b/libraries.py:178"}
    r = V.row("opacus", "1.5.2", True, head, c, Path("/w/o"))
    assert r["expected"] == V.NOT_AVAILABLE and "1.5.3" in r["why"]
    assert r["status"] == "as expected"  # it raises what the release lacks
    other = V.row("opacus", "1.5.2", True, head, {**c, "error": "ValueError: x"}, Path("/w/o"))
    assert other["status"] == "error"  # another error is still one
    ran = {"case": "ghost", "kind": "correct", "verdict": "pass"}
    assert V.row("opacus", "1.5.2", True, head, ran, Path("/w/o"))["status"] == "not as expected"
    head6 = {"module_version": "1.6.0", "module_file": "/w/o/opacus/__init__.py"}
    ok = V.row("opacus", "1.6.0", True, head6, ran, Path("/w/o"))
    assert ok["expected"] == "pass" and ok["why"] is None and ok["status"] == "as expected"
    assert V.expectation("opacus", "1.4.0", "ghost")[1].startswith("opacus has no ghost")
    fh = {"module_version": "1.24.0", "module_file": "/w/f/flwr/__init__.py"}
    e = "ModuleNotFoundError: No module named 'flwr.supercore.privacy_accounting'"
    msg = V.row(
        "flwr", "1.24.0", True, fh, {"case": "message_server_fixed", "error": e}, Path("/w/f")
    )
    assert msg["status"] == "as expected"
    assert V.expectation("flwr", "1.35.0", "message_server_fixed") is None
    # below the range the expectation is the clear error, whatever EXPECT says
    below = V.row("flwr", "1.7.0", False, fh, {"case": "message_server_fixed"}, Path("/w/f"))
    assert below["expected"].startswith("clear error") and below["why"] is None
    # a library flaw on old releases: the correct case is expected to fail
    lh = {"module_version": "1.8.0", "module_file": "/w/f/flwr/__init__.py"}
    flaw = {"case": "legacy_local_dp", "kind": "correct", "verdict": "fail"}
    assert V.row("flwr", "1.8.0", True, lh, flaw, Path("/w/f"))["status"] == "as expected"
    md = V.table(
        {
            "command": "c",
            "machine": "m",
            "date": "d",
            "commit": "x",
            "dirty": False,
            "wall_s": 1.0,
            "base": "b",
            "ranges": {},
        },
        [r],
        [],
    )
    assert f"| {V.NOT_AVAILABLE} (ghost clipping from 1.5" in md
    assert "1 of 1 rows as expected." in md
