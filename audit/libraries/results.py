"""Over 500 lines on purpose: one file format (a library audit's result and a benchmark row), whose writer and untrusted-input reader must check the same fields the same way.

A library audit's result on disk, and the rows a report reads from it.

:func:`save_result` writes the dict a library audit returns (``OpacusAudit.audit``; the
other libraries' audits return the same keys) as one JSON file, atomically, with numpy
values made plain and non-finite numbers as the strings ``"inf"`` / ``"-inf"`` / ``"nan"``
(strict JSON).

:func:`load_library_audits` reads a folder (or one file) holding either such per-run files
(``*.json``) or the benchmark's ``results.json`` (``{"rows": [...]}``, each row as
``benchmarks.auditing.libraries.row`` writes it) and gives one row schema for both
(:data:`ROW_KEYS`): library, version, mode, kind, claimed ε, recomputed ε (and whether it
is a lower bound, "≥"), the certified one-run ε lower bound, the noise-implied ε (and "≥"),
conformance (``"pass"`` or ``"reject: group:test, …"``), the worst observed/claimed noise
ratio of the scale tests, the findings' codes, what the audit did not test, which part of
the mechanism each instrument tested (``coverage``, :class:`audit.coverage.Coverage`), the
neighbour replay's outcome (``replay``), the verdict.

Verdicts (:mod:`audit.coverage`): ``pass`` (exit 0: every part of the mechanism — sampling,
clipping, noise, accounting — tested), ``incomplete`` (exit 4: nothing found, some part
untested) and ``fail`` (exit 1: an error finding).

The files are untrusted: they are parsed as JSON only (no pickle), every field the rows
use is checked (type, range, NaN refused where a number is needed; ``∞`` accepted for an
ε), and a problem raises :class:`fl.errors.UsageError` naming the file, the row and the
field. A verdict that contradicts the file's own findings (``"pass"`` or ``"incomplete"``
beside an error finding, ``"fail"`` without one), its own coverage (``"pass"`` with a part
untested, ``"incomplete"`` with none), its exit code or its replay (``"pass"`` beside a
failed replay) is refused too; an ``"incomplete"`` must name what it did not test (its
``coverage``, else ``untested``). ``replay`` (optional): ``{"verdict": "pass" | "fail" |
"not run", "neighbours": int, "releases": int, "findings": [codes]}``; a replay that
compared nothing (no neighbour, no release) is never a ``pass``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from audit.coverage import EXIT_CODES, PARTS, Coverage
from audit.coverage import VERDICTS as _VERDICTS
from fl.errors import UsageError
from fl.io import atomic_write_text

__all__ = [
    "ROW_KEYS",
    "conformance_warnings",
    "load_library_audits",
    "read_library_audits",
    "save_result",
]

#: the normalised row: every key, in the order a table shows them
ROW_KEYS = (
    "library",
    "version",
    "mode",
    "kind",
    "what",
    "claimed_epsilon",
    "recomputed_epsilon",
    "recomputed_at_least",
    "epsilon_lower_bound",
    "implied_epsilon",
    "implied_at_least",
    "conformance",
    "noise_ratio",
    "findings",
    "untested",
    "coverage",
    "replay",
    "verdict",
    "expected",
    "source",
)

#: the largest file read (a library audit's JSON is kilobytes; the benchmark's tens of them)
MAX_BYTES = 32 * 1024 * 1024

#: a library audit's verdicts (:data:`audit.coverage.VERDICTS`), from the best
VERDICTS = _VERDICTS
#: a neighbour replay's outcomes (``replay.verdict``)
REPLAY_VERDICTS = ("pass", "fail", "not run")

#: the keys every library audit result and every benchmark row must hold
REQUIRED = (
    "library",
    "mode",
    "claimed_epsilon",
    "recomputed_epsilon",
    "epsilon_lower_bound",
    "implied_epsilon",
    "conformance",
    "findings",
    "untested",
    "verdict",
)


def conformance_warnings(conf) -> list[dict]:
    """A ``conformance_weak`` warning per test of ``conf`` (an
    :class:`audit.bounds.conformance.ConformanceResult`) rejected at its warning level but
    not at the verdict's: every library audit appends these after its verdict is decided
    (a warning never fails the verdict)."""
    return [
        {
            "code": "conformance_weak",
            "severity": "warning",
            "message": f"{t.group}:{t.test} rejected at family-wise α = {conf.warn_alpha:g} "
            f"but not at the verdict's {conf.alpha:g} (Holm; {t.evidence()}): weak evidence, "
            f"one correct run in {1 / conf.warn_alpha:.0f} can show it; the verdict unchanged",
        }
        for t in conf.weak
    ]


# --------------------------------------------------------------------------- writing


def _plain(x):
    """JSON-safe: numpy scalars and arrays to Python, non-finite floats to strings."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, bool) or x is None or isinstance(x, (str, int)):
        return x
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot write a {type(x).__name__} into a library audit's JSON")


def save_result(result: dict, path) -> Path:
    """Write a library audit's result (the dict ``audit(claim)`` returns) to ``path`` as
    JSON, atomically (a reader sees the old file or the new one). The result is checked
    first (:func:`_audit_row`): a file this writes is one :func:`load_library_audits` reads."""
    if not isinstance(result, dict):
        raise TypeError(f"a library audit's result is a dict, got {type(result).__name__}")
    doc = _plain(result)
    p = Path(path)
    _audit_row(json.loads(json.dumps(doc)), str(p))  # what the reader will see
    atomic_write_text(p, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return p


# --------------------------------------------------------------------------- reading


def _bad(where: str, problem: str):
    return UsageError(f"{where}: {problem}")


def _eps(v, where: str, key: str, *, none_ok: bool) -> float | None:
    """An ε: a number >= 0 or ∞ (``Infinity`` or the string ``"inf"``); None when allowed;
    never NaN, a negative, a bool or text."""
    if v is None:
        if none_ok:
            return None
        raise _bad(where, f"field {key!r} is missing or null (an ε is needed)")
    if isinstance(v, str) and v.strip().lower() in ("inf", "infinity", "+inf"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(where, f"field {key!r} is {v!r}, not a number")
    v = float(v)
    if math.isnan(v):
        raise _bad(where, f"field {key!r} is NaN (an ε must be a number)")
    if v < 0:
        raise _bad(where, f"field {key!r} is {v:g} < 0 (an ε is >= 0)")
    return v


def _ratio(v, where: str, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(where, f"field {key!r} is {v!r}, not a number")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise _bad(where, f"field {key!r} is {v!r}, not a finite number >= 0")
    return v


def _flag(v, where: str, key: str) -> bool:
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(where, f"field {key!r} is {v!r}, not true or false")
    return v


def _text(v, where: str, key: str, *, none_ok: bool = False) -> str | None:
    if v is None and none_ok:
        return None
    if not isinstance(v, str) or not v.strip():
        raise _bad(where, f"field {key!r} is {v!r}, not a non-empty string")
    return v


def _texts(v, where: str, key: str) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad(where, f"field {key!r} is not a list of strings")
    return list(v)


def _verdict(v, where: str) -> str:
    if v not in VERDICTS:
        raise _bad(where, f"field 'verdict' is {v!r}, not one of {list(VERDICTS)}")
    return v


def _has(doc: dict, keys, where: str) -> None:
    missing = [k for k in keys if k not in doc]
    if missing:
        raise _bad(where, f"missing field(s) {missing}")


def _consistent(verdict: str, codes: list[str], errors: int, where: str) -> None:
    if verdict in ("pass", "incomplete") and errors:
        raise _bad(
            where,
            f"the verdict is {verdict!r} but the file lists error finding(s) {codes}: a file "
            "that contradicts itself is not shown",
        )


def _count(v, where: str, key: str) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad(where, f"field {key!r} is {v!r}, not a whole number >= 0")
    return v


def _coverage(v, where: str) -> dict | None:
    """The ``coverage`` field (:meth:`audit.coverage.Coverage.to_dict`) checked and
    normalised, or None when absent: parts only from :data:`audit.coverage.PARTS`,
    instruments and reasons as text, and the ``untested`` it states the one its own
    ``tested`` and ``not_applicable`` give."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(where, f"field 'coverage' is {type(v).__name__}, not an object")
    for key in ("tested", "why", "not_applicable"):
        sub = v.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise _bad(where, f"field 'coverage.{key}' is not an object")
        for part, val in sub.items():
            if part not in PARTS:
                raise _bad(where, f"coverage.{key} names {part!r}, not one of {list(PARTS)}")
            if key == "tested":
                _texts(val, where, f"coverage.tested.{part}")
            else:
                _text(val, where, f"coverage.{key}.{part}")
    cov = Coverage.from_dict(v)
    stated = v.get("untested")
    if stated is not None:
        stated = _texts(stated, where, "coverage.untested")
        if stated != cov.untested():
            raise _bad(
                where,
                f"coverage.untested is {stated} but its own tested/not_applicable leave "
                f"{cov.untested()} untested",
            )
    return cov.to_dict()


def _replay(v, where: str) -> dict | None:
    """The ``replay`` field checked and normalised, or None when absent."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(where, f"field 'replay' is {type(v).__name__}, not an object")
    verdict = v.get("verdict")
    if verdict not in REPLAY_VERDICTS:
        raise _bad(
            where, f"field 'replay.verdict' is {verdict!r}, not one of {list(REPLAY_VERDICTS)}"
        )
    out = {
        "verdict": verdict,
        "neighbours": _count(v.get("neighbours"), where, "replay.neighbours"),
        "releases": _count(v.get("releases"), where, "replay.releases"),
        "findings": _texts(v.get("findings"), where, "replay.findings"),
    }
    if v.get("reason") is not None:
        out["reason"] = _text(v["reason"], where, "replay.reason")
    if verdict == "pass" and not (out["neighbours"] and out["releases"]):
        raise _bad(
            where,
            f"replay.verdict is 'pass' with {out['neighbours']} neighbour(s) and "
            f"{out['releases']} release(s) compared: a replay that compared nothing is never "
            "a pass (replay_empty)",
        )
    if verdict == "fail" and not out["findings"]:
        raise _bad(where, "replay.verdict is 'fail' but the replay lists no finding")
    return out


def _checked(doc: dict, verdict: str, codes: list, untested: list, where: str):
    """(coverage, replay) of a result or row, checked against its verdict and exit code."""
    coverage = _coverage(doc.get("coverage"), where)
    replay = _replay(doc.get("replay"), where)
    if verdict == "fail" and not codes:
        raise _bad(where, "the verdict is 'fail' but the file lists no finding")
    if coverage is not None and verdict == "pass" and coverage["untested"]:
        raise _bad(
            where,
            f"the verdict is 'pass' but its coverage leaves {coverage['untested']} untested "
            "(that is 'incomplete')",
        )
    if verdict == "incomplete":
        if coverage is not None and not coverage["untested"]:
            raise _bad(where, "the verdict is 'incomplete' but its coverage tested every part")
        if coverage is None and not untested:
            raise _bad(
                where,
                "the verdict is 'incomplete' but the file names nothing untested (give "
                "'coverage' or 'untested')",
            )
    if replay is not None and replay["verdict"] == "fail" and verdict != "fail":
        raise _bad(where, f"the verdict is {verdict!r} but the replay failed {replay['findings']}")
    ec = doc.get("exit_code")
    if ec is not None and ec != EXIT_CODES[verdict]:
        raise _bad(
            where,
            f"exit_code {ec!r} does not match the verdict {verdict!r} (exit {EXIT_CODES[verdict]})",
        )
    return coverage, replay


def _audit_row(doc: dict, where: str) -> dict:
    """One library audit's result (``OpacusAudit.audit``'s keys) as a normalised row."""
    if not isinstance(doc, dict):
        raise _bad(where, f"a library audit is a JSON object, got {type(doc).__name__}")
    _has(
        doc,
        REQUIRED,
        where,
    )
    conf = doc["conformance"]
    if not isinstance(conf, dict) or not isinstance(conf.get("passed"), bool):
        raise _bad(where, "field 'conformance' is not a conformance result ({'passed': bool, …})")
    tests = conf.get("tests", [])
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise _bad(where, "field 'conformance.tests' is not a list of objects")
    rejected = _texts(conf.get("rejected"), where, "conformance.rejected")
    if conf["passed"] == bool(rejected):
        raise _bad(where, f"conformance says passed={conf['passed']} with rejected={rejected}")
    ratios = []
    for i, t in enumerate(tests):
        if t.get("test") == "scale" and t.get("observed_over_claimed") is not None:
            ratios.append(_ratio(t["observed_over_claimed"], where, f"conformance.tests[{i}]"))
    findings = doc["findings"]
    if not isinstance(findings, list):
        raise _bad(where, "field 'findings' is not a list")
    codes, errors = [], 0
    for i, f in enumerate(findings):
        if not isinstance(f, dict):
            raise _bad(where, f"findings[{i}] is not an object")
        codes.append(_text(f.get("code"), where, f"findings[{i}].code"))
        _text(f.get("message"), where, f"findings[{i}].message")
        sev = f.get("severity", "error")
        if sev not in ("error", "warning", "info"):
            raise _bad(where, f"findings[{i}].severity is {sev!r}")
        errors += sev == "error"
    verdict = _verdict(doc["verdict"], where)
    _consistent(verdict, codes, errors, where)
    untested = _texts(doc["untested"], where, "untested")
    coverage, replay = _checked(doc, verdict, codes, untested, where)
    run = doc.get("run") if isinstance(doc.get("run"), dict) else {}
    version = doc.get("version", doc.get("library_version", run.get("library_version")))
    return {
        "library": _text(doc["library"], where, "library"),
        "version": _text(version, where, "version", none_ok=True),
        "mode": _text(doc.get("case", doc["mode"]), where, "mode"),
        "kind": _text(doc.get("kind"), where, "kind", none_ok=True),
        "what": _text(doc.get("what"), where, "what", none_ok=True),
        "claimed_epsilon": _eps(doc["claimed_epsilon"], where, "claimed_epsilon", none_ok=False),
        "recomputed_epsilon": _eps(
            doc["recomputed_epsilon"], where, "recomputed_epsilon", none_ok=False
        ),
        "recomputed_at_least": _flag(
            doc.get("recomputed_epsilon_at_least"), where, "recomputed_epsilon_at_least"
        ),
        "epsilon_lower_bound": _eps(
            doc["epsilon_lower_bound"], where, "epsilon_lower_bound", none_ok=True
        ),
        "implied_epsilon": _eps(doc["implied_epsilon"], where, "implied_epsilon", none_ok=True),
        "implied_at_least": _flag(
            doc.get("implied_epsilon_at_least"), where, "implied_epsilon_at_least"
        ),
        "conformance": "pass" if conf["passed"] else "reject: " + ", ".join(rejected),
        "noise_ratio": min(ratios) if ratios else None,
        "findings": codes,
        "untested": untested,
        "coverage": coverage,
        "replay": replay,
        "verdict": verdict,
        "expected": None,
        "source": where,
    }


def _benchmark_row(r: dict, where: str) -> dict:
    """A row of the benchmark's results.json (``benchmarks.auditing.libraries.row``)."""
    if not isinstance(r, dict):
        raise _bad(where, f"a row is a JSON object, got {type(r).__name__}")
    _has(
        r,
        REQUIRED,
        f"{where} (a row as benchmarks.auditing.libraries.row writes it)",
    )
    conf = _text(r["conformance"], where, "conformance")
    if conf != "pass" and not conf.startswith("reject: "):
        raise _bad(where, f"field 'conformance' is {conf!r}, not 'pass' or 'reject: …'")
    codes = _texts(r["findings"], where, "findings")
    verdict = _verdict(r["verdict"], where)
    # the table's rows carry codes only: every code there is an error finding
    _consistent(verdict, codes, len(codes), where)
    untested = _texts(r["untested"], where, "untested")
    coverage, replay = _checked(r, verdict, codes, untested, where)
    expected = r.get("expected")
    if expected is not None:
        expected = _verdict(expected, where + " (expected)")
    return {
        "library": _text(r["library"], where, "library"),
        "version": _text(r.get("version"), where, "version", none_ok=True),
        "mode": _text(r["mode"], where, "mode"),
        "kind": _text(r.get("kind"), where, "kind", none_ok=True),
        "what": _text(r.get("what"), where, "what", none_ok=True),
        "claimed_epsilon": _eps(r["claimed_epsilon"], where, "claimed_epsilon", none_ok=False),
        "recomputed_epsilon": _eps(
            r["recomputed_epsilon"], where, "recomputed_epsilon", none_ok=False
        ),
        "recomputed_at_least": _flag(r.get("recomputed_at_least"), where, "recomputed_at_least"),
        "epsilon_lower_bound": _eps(
            r["epsilon_lower_bound"], where, "epsilon_lower_bound", none_ok=True
        ),
        "implied_epsilon": _eps(r["implied_epsilon"], where, "implied_epsilon", none_ok=True),
        "implied_at_least": _flag(r.get("implied_at_least"), where, "implied_at_least"),
        "conformance": conf,
        "noise_ratio": _ratio(r.get("noise_ratio"), where, "noise_ratio"),
        "findings": codes,
        "untested": untested,
        "coverage": coverage,
        "replay": replay,
        "verdict": verdict,
        "expected": expected,
        "source": where,
    }


def _no_constants(name: str):
    """JSON's NaN / Infinity literals: read as floats so that the field checks name them."""
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _read(path: Path):
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _bad(str(path), f"cannot read ({exc.strerror or exc})") from None
    if size > MAX_BYTES:
        raise _bad(str(path), f"{size} bytes, more than a library audit's {MAX_BYTES}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _bad(str(path), "not UTF-8 text (a library audit is JSON)") from None
    except OSError as exc:
        raise _bad(str(path), f"cannot read ({exc.strerror or exc})") from None
    if not text.strip():
        raise _bad(str(path), "file is empty")
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise _bad(str(path), f"invalid JSON at line {exc.lineno} ({exc.msg})") from None
    except RecursionError:
        raise _bad(str(path), "JSON nested too deeply") from None


def _rows_of(doc, where: str) -> tuple[list[dict], list[dict]]:
    """(rows, undetectable) of one file: the benchmark's document or one audit's result."""
    if isinstance(doc, dict) and "rows" in doc:
        rows = doc["rows"]
        if not isinstance(rows, list):
            raise _bad(where, "field 'rows' is not a list")
        out = [_benchmark_row(r, f"{where} rows[{i}]") for i, r in enumerate(rows)]
        und = doc.get("undetectable") or []
        if not isinstance(und, list) or not all(
            isinstance(u, dict)
            and isinstance(u.get("misuse"), str)
            and isinstance(u.get("reason"), str)
            for u in und
        ):
            raise _bad(where, "field 'undetectable' is not a list of {misuse, reason}")
        lib = out[0]["library"] if out else None
        return out, [{"library": lib, **u} for u in und]
    if isinstance(doc, dict) and "verdict" in doc:
        return [_audit_row(doc, where)], []
    if isinstance(doc, list) and doc and all(isinstance(d, dict) and "verdict" in d for d in doc):
        return [_audit_row(d, f"{where} [{i}]") for i, d in enumerate(doc)], []
    raise _bad(
        where,
        "neither a library audit's result (keys library, mode, …, verdict), a list of them, "
        "nor the benchmark's results.json ({'rows': [...]})",
    )


def read_library_audits(path) -> dict:
    """Every library audit in ``path`` (a folder of ``*.json``, or one such file):
    ``{"rows": [...], "undetectable": [...], "files": [...], "commands": [...]}`` (the
    benchmark's command line, when its file records one); rows in the files' name
    order, each file's rows in its order. Raises :class:`UsageError` naming the file and
    the problem."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.json") if f.is_file())
        if not files:
            raise UsageError(f"--library-audit {p}: no *.json file in the folder")
    elif p.is_file():
        files = [p]
    else:
        raise UsageError(f"--library-audit {p}: no such folder or file")
    rows, und, cmds = [], [], []
    for f in files:
        doc = _read(f)
        r, u = _rows_of(doc, str(f))
        rows += r
        und += u
        cmd = doc.get("command") if isinstance(doc, dict) else None
        if isinstance(cmd, str) and cmd.strip() and "\n" not in cmd:
            cmds.append(cmd.strip())
    if not rows:
        raise UsageError(f"--library-audit {p}: the files hold no audited row")
    return {
        "rows": rows,
        "undetectable": und,
        "files": [str(f) for f in files],
        "commands": list(dict.fromkeys(cmds)),
    }


def load_library_audits(path) -> list[dict]:
    """The normalised rows (:data:`ROW_KEYS`) of every library audit in ``path``."""
    return read_library_audits(path)["rows"]
