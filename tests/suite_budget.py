"""The test suite's time budget (issue 49): what each test file costs, in what order the
files go to the workers, and the guard that keeps the slowest file within its budget.

- **Order.** ``pytest -n 2 --dist loadfile`` hands whole files to the two workers; a file
  that starts last and runs long leaves the other worker idle (the quick job's test, 52 s,
  ran last on one worker on 2026-12-05: 54 s of imbalance). The files are sorted longest
  first by their seconds in ``tests/durations.json`` (longest-processing-time-first
  scheduling; a file not listed counts as the median), and ``scripts/test.sh`` passes
  ``--no-loadscope-reorder`` so xdist keeps that order rather than its own (most tests
  first).
- **Guard.** With ``FEDLORA_SUITE_BUDGET=1`` (``scripts/test.sh`` sets it), the session
  fails when a file's setup + call + teardown seconds exceed
  ``[tool.fedlora.test-budget] slowest_file_seconds`` of ``pyproject.toml`` (the reason is
  stated beside it), naming the file.
- **Measure.** With ``FEDLORA_SUITE_DURATIONS=PATH`` the session writes each file's seconds,
  tests and worker to PATH (JSON); ``python tests/suite_budget.py table PATH`` prints the
  markdown table of ``docs/test_durations.md`` and ``python tests/suite_budget.py order
  PATH`` rewrites ``tests/durations.json`` from it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = Path(__file__).with_name("durations.json")


def file_of(nodeid: str) -> str:
    """The test file of a node id (``tests/a/test_b.py::test_c[x]`` → ``tests/a/test_b.py``)."""
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """``{test file: seconds}`` from ``tests/durations.json`` ({} when absent or unreadable:
    the order is an optimisation, never a reason to fail)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return {str(k): float(v) for k, v in doc["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def longest_first(items: list, durations: dict[str, float]) -> list:
    """``items`` with their files in decreasing known seconds (a file not in
    ``durations`` counts as their median); the order within a file, and between files of
    equal weight, is kept."""
    if not durations:
        return list(items)
    default = statistics.median(durations.values())
    first: dict[str, int] = {}
    for i, it in enumerate(items):
        first.setdefault(file_of(it.nodeid), i)
    return sorted(
        items,
        key=lambda it: (
            -durations.get(file_of(it.nodeid), default),
            first[file_of(it.nodeid)],
        ),
    )


def read_budget(pyproject: Path | None = None) -> tuple[float, str]:
    """``(slowest_file_seconds, reason)`` of ``[tool.fedlora.test-budget]`` in
    ``pyproject`` (default: ``$FEDLORA_TEST_BUDGET_FILE``, else the project's
    ``pyproject.toml``)."""
    if pyproject is None:
        pyproject = Path(os.environ.get("FEDLORA_TEST_BUDGET_FILE") or ROOT / "pyproject.toml")
    doc = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    try:
        sec = doc["tool"]["fedlora"]["test-budget"]
        budget, reason = float(sec["slowest_file_seconds"]), str(sec["reason"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{pyproject}: [tool.fedlora.test-budget] needs slowest_file_seconds (a number) "
            f"and reason ({exc!r})"
        ) from None
    if not budget > 0:
        raise ValueError(f"{pyproject}: slowest_file_seconds must be > 0, got {budget}")
    return budget, reason


def over_budget(per_file: dict[str, float], budget: float) -> list[tuple[str, float]]:
    """The files whose seconds exceed ``budget``, slowest first."""
    return sorted(((f, s) for f, s in per_file.items() if s > budget), key=lambda x: -x[1])


class Timer:
    """The pytest plugin (registered by ``tests/conftest.py``): sums each file's setup,
    call and teardown seconds as the reports arrive (on xdist's controller, from every
    worker) and applies the guard at the end of the session."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}
        self.worker: dict[str, str] = {}

    def add(self, report) -> None:
        f = file_of(report.nodeid)
        self.seconds[f] = self.seconds.get(f, 0.0) + float(report.duration)
        self.tests.setdefault(f, set()).add(report.nodeid)
        node = getattr(report, "node", None)
        gw = getattr(getattr(node, "gateway", None), "id", None)
        if gw:
            self.worker[f] = gw

    def doc(self) -> dict:
        return {
            "seconds": {f: round(s, 2) for f, s in sorted(self.seconds.items())},
            "tests": {f: len(t) for f, t in sorted(self.tests.items())},
            "worker": dict(sorted(self.worker.items())),
        }


def table(doc: dict, top: int = 10) -> str:
    """Markdown: the ``top`` slowest files and each worker's load."""
    secs = doc["seconds"]
    rows = sorted(secs.items(), key=lambda x: -x[1])
    total = sum(secs.values())
    out = [
        f"{len(secs)} files, {sum(doc['tests'].values())} tests, {total:.0f} s of test time "
        "(setup + call + teardown, summed over the workers)",
        "",
        "| file | tests | seconds | worker |",
        "|---|---:|---:|---|",
    ]
    for f, s in rows[:top]:
        out.append(f"| `{f}` | {doc['tests'].get(f, 0)} | {s:.1f} | {doc['worker'].get(f, '')} |")
    loads: dict[str, float] = {}
    for f, s in secs.items():
        loads[doc["worker"].get(f, "-")] = loads.get(doc["worker"].get(f, "-"), 0.0) + s
    out += ["", "Load per worker: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(loads.items()))]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("table", "order"):
        print("usage: python tests/suite_budget.py table|order DURATIONS.json", file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    if argv[0] == "table":
        print(table(doc), end="")
    else:
        DURATIONS.write_text(
            json.dumps({"seconds": doc["seconds"]}, indent=1, sort_keys=True) + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
