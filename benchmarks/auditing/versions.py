"""Over 500 lines on purpose: one benchmark, whose release choice, overlay environments, child-process runner, release-bound expectations and table share the row records.

The library releases people run (#47 item 4): the library table's cases on old releases.

    python -m benchmarks.auditing.versions [--library NAME ...] [--all-cases] [--out DIR]
        [--work DIR] [--keep] [--no-below]

People audit the release they have installed, and older releases are where fixed bugs
still run. For each supported range — opacus 1.4.0 … 1.6.0, flwr 1.8.0 … 1.42.0, pfl
(the oldest release that imports its PyTorch model on this Python and torch) … 0.6.0 —
this installs the oldest, a middle and the newest release (plus the oldest release of
the range the audit module itself states in its ``SUPPORTED``, where that is another one,
and, unless ``--no-below``, the release just below the range, to show the error the audit
gives there) and runs a
few correct and misused cases of the library table (:mod:`benchmarks.auditing.libraries`
and its Flower and pfl modules) against each, one child process per (library, version).

**Environments.** Not one venv per version (a venv from the project's interpreter, the
CPU torch wheel and the pinned project took 140 s and 2.0 GB, wheels cached), but an
*overlay*: what ``pip install LIB==X`` would change in the project's environment (pip's
resolver, dry, with the project's ``==`` pins held; where that is impossible, with torch
held and the pinned packages left out, with what only they require), installed with
``pip install --no-deps --target WORK/LIB-X`` (flwr 1.8.0: numpy 1.26, protobuf 4.25,
cryptography 42, typer 0.9 …); where pip cannot resolve the release at all (opacus 1.3.0
needs functorch for torch < 2.1), the release alone and the requirements its metadata
declares that the environment does not meet. The child runs the project's interpreter
with ``PYTHONPATH=WORK/LIB-X``, which Python places before site-packages, so the overlay
shadows the project's release; the child reports ``LIB.__version__``, the distribution's
version and the module's file, and a row whose module does not come from the overlay is
marked not isolated. torch stays the project's 2.13 (a release pinning another torch is
run with it, and its environment row says so), as do the project's other ``==`` pins
(dp-accounting 0.6.0, which pfl's metadata caps below 0.6). Measured: 5-22 s and
1-92 MB per release, and the same ε, verdict and findings as a full venv for opacus
1.4.0 (flat_poisson, low_sigma). The overlays are deleted at the end (``--keep`` keeps
them), pip's cache is kept.

Each row: library, version, in range, case, kind, verdict, expected verdict (the
library table's rule), the findings' codes, seconds, or — where the case raised — the
exception's last line (``error``) or ``refused`` where that error names the release and
the release is outside the range the audit states. Out-of-range rows expect a clear
error: one that names the installed version. Written to
``benchmarks/results/versions/{results.json,table.md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.paths import RESULTS

ROOT = Path(__file__).resolve().parents[2]

#: library -> (distribution, import name, first release of the range (None: probed), last
#: release, the module with the cases, the cases run by default)
LIBRARIES: dict[str, dict] = {
    "opacus": {
        "dist": "opacus",
        "module": "opacus",
        "first": "1.4.0",
        "last": "1.6.0",
        "cases_module": "benchmarks.auditing.libraries",
        "stated_in": "audit.libraries.opacus.versions",
        "cases": ["flat_poisson", "ghost", "batch_memory_manager", "low_sigma"],
    },
    "flwr": {
        "dist": "flwr",
        "module": "flwr",
        "first": "1.8.0",
        "last": "1.42.0",
        "cases_module": "benchmarks.auditing.libraries_flower",
        "stated_in": "audit.libraries.flower.compat",
        "cases": ["legacy_server_fixed", "message_server_fixed", "legacy_local_dp", "sigma_halved"],
    },
    "pfl": {
        "dist": "pfl",
        "module": "pfl",
        "first": None,  # the oldest release whose probe imports (below)
        "last": "0.6.0",
        "cases_module": "benchmarks.auditing.libraries_pfl",
        "stated_in": "audit.libraries.pfl.compat",
        "cases": ["full_accountant", "laplace_full", "low_sigma", "clip_mismatch"],
        # what pfl's cases import: the range starts at the oldest release where this works
        "probe": "import pfl.model.pytorch, pfl.privacy, pfl.aggregate.simulate",
    },
}

#: never installed into an overlay (functorch: torch ships its own): the project's CPU torch stays (any other torch is a
#: multi-GB CUDA build)
NEVER = {"torch", "functorch", "triton", "tensorflow", "jax", "jaxlib"}


def project_pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> version of the project's own ``==`` dependencies: an overlay keeps them (a
    user of fedlora-audit has them whatever release of a library they run; pfl's metadata
    asks dp-accounting < 0.6, the project pins 0.6.0, see pyproject.toml)."""
    import tomllib

    from packaging.requirements import Requirement

    out = {}
    for s in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        r = Requirement(s)
        pins = [sp.version for sp in r.specifier if sp.operator == "=="]
        if pins:
            out[_norm(r.name)] = pins[0]
    return out


#: the releases `pip index versions` listed on 2026-12-05 (used when the index is not
#: reachable; the header says which)
KNOWN = {
    "opacus": "1.6.0 1.5.4 1.5.3 1.5.2 1.5.1 1.5 1.4.1 1.4.0 1.3.0 1.2.0 1.1.3 1.1.2 1.1.1 "
    "1.1.0 1.0.2 1.0.1 1.0.0",
    "flwr": "1.42.0 1.41.0 1.40.0 1.39.0 1.38.0 1.37.0 1.36.0 1.35.0 1.34.0 1.33.0 1.32.1 "
    "1.32.0 1.31.0 1.30.0 1.29.0 1.28.0 1.27.0 1.26.1 1.26.0 1.25.0 1.24.0 1.23.0 1.22.0 "
    "1.21.0 1.20.0 1.19.0 1.18.0 1.17.0 1.16.0 1.15.2 1.15.1 1.15.0 1.14.0 1.13.1 1.13.0 "
    "1.12.0 1.11.1 1.11.0 1.10.0 1.9.0 1.8.0 1.7.0 1.6.0 1.5.0",
    "pfl": "0.6.0 0.5.2 0.5.1 0.5.0 0.4.0 0.3.1 0.3.0 0.2.0 0.1.0",
}

#: the pseudo-case run first on every release: the audit module's ``check_version()``
#: (a release in the range it states is accepted, one outside refused naming it)
CHECK = "version_check"

#: what a case in the range cannot be expected to do on some releases: (library, case) ->
#: [(the releases, a specifier; the expectation there; why; for NOT_AVAILABLE, what the case
#: raises there, a regex)], the first matching entry applying. NOT_AVAILABLE: the case's own
#: code needs an API the release does not have, so it raises before any audit runs; the row
#: is as expected only where it raises that (a case that then runs is not as expected: the
#: entry is out of date).
NOT_AVAILABLE = "not available in this release"
EXPECT: dict[tuple[str, str], list[tuple[str, str, str, str | None]]] = {
    ("flwr", "message_server_fixed"): [
        (
            "<1.35",
            NOT_AVAILABLE,
            "the case turns on Flower's accountant (flwr.supercore.privacy_accounting, "
            "accountant=), which flwr has from 1.35; the Message API from 1.21",
            r"No module named 'flwr\.(supercore|serverapp|clientapp)",
        )
    ],
    ("flwr", "legacy_local_dp"): [
        (
            "<1.14",
            "fail",
            "a library flaw: LocalDpMod of flwr 1.8 … 1.13 drops its noise (it discards "
            "what add_localdp_gaussian_noise_to_params returns; fixed in 1.14), which the "
            "audit must find (noise_absent)",
            None,
        )
    ],
    ("opacus", "ghost"): [
        (
            "<1.5",
            NOT_AVAILABLE,
            "opacus has no ghost clipping before 1.5",
            r"unexpected keyword argument 'criterion'",
        ),
        (
            "<1.5.3",
            NOT_AVAILABLE,
            "ghost clipping from 1.5, but make_private(criterion=) only from 1.5.3 (1.5 … "
            "1.5.2 clip through double_backward); the case uses criterion=",
            r"unexpected keyword argument 'criterion'",
        ),
    ],
}


def expectation(lib: str, version: str, case: str) -> tuple[str, str, str | None] | None:
    """(expected, why, the error a NOT_AVAILABLE case raises) of the first :data:`EXPECT`
    entry for (``lib``, ``case``) whose releases hold ``version``; None: the kind's rule."""
    from packaging.specifiers import SpecifierSet

    for spec, expected, why, raises in EXPECT.get((lib, case), []):
        if SpecifierSet(spec).contains(version, prereleases=True):
            return expected, why, raises
    return None


#: the marker of the child's result lines on stdout
MARK = "@@versions@@ "


# ---------------------------------------------------------------- version selection


def _v(s: str):
    from packaging.version import Version

    return Version(s)


def in_range(version: str, first: str | None, last: str) -> bool:
    """``first`` ≤ ``version`` ≤ ``last`` (``first`` None: no lower end)."""
    v = _v(version)
    return (first is None or _v(first) <= v) and v <= _v(last)


def releases(available: list[str], first: str | None, last: str) -> list[str]:
    """The final releases (no pre-, dev releases) within the range, oldest first."""
    vs = sorted({_v(a) for a in available}, key=lambda v: v)
    return [
        str(v)
        for v in vs
        if not v.is_prerelease and not v.is_devrelease and in_range(str(v), first, last)
    ]


def pick(versions: list[str]) -> list[str]:
    """Oldest, middle (the upper middle of an even count) and newest of ``versions``
    (sorted oldest first), without repeats."""
    if not versions:
        return []
    out = [versions[0], versions[len(versions) // 2], versions[-1]]
    return list(dict.fromkeys(out))


def below(available: list[str], first: str) -> str | None:
    """The newest final release older than ``first``."""
    older = [v for v in releases(available, None, first) if _v(v) < _v(first)]
    return older[-1] if older else None


def stated(lib: str) -> tuple[str | None, str | None]:
    """The range the audit module states (its ``SUPPORTED``, e.g. "flwr >= 1.20, < 1.43
    (1.20 … 1.42)"): (the text, the specifier part, e.g. ">=1.20,<1.43"), or Nones."""
    import importlib

    try:
        text = str(importlib.import_module(LIBRARIES[lib]["stated_in"]).SUPPORTED)
    except Exception:
        return None, None
    return text, parse_stated(text)


def parse_stated(text: str) -> str | None:
    """The specifier of a ``SUPPORTED`` text ("opacus >= 1.4.0, < 1.7 (…)" -> ">=1.4.0,<1.7")."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return str(Requirement(text.split("(")[0].strip()).specifier) or None
    except InvalidRequirement:
        return None


def in_stated(version: str, spec: str | None) -> bool | None:
    """Whether the audit's stated range holds ``version`` (None: no stated range)."""
    from packaging.specifiers import SpecifierSet

    return None if spec is None else SpecifierSet(spec).contains(version, prereleases=True)


def list_versions(dist: str) -> tuple[list[str], str]:
    """The releases on the index (``pip index versions``), or :data:`KNOWN`."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", dist],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        m = re.search(r"Available versions:\s*(.+)", out)
        if m:
            return [s.strip() for s in m.group(1).split(",") if s.strip()], "pip index versions"
    except (OSError, subprocess.SubprocessError):
        pass
    return KNOWN[dist].split(), "the list in versions.py (index not reachable)"


# ---------------------------------------------------------------- overlays


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(paths: list[str]) -> dict[str, tuple[str, object]]:
    """name -> (version, distribution) over ``paths``, the first path holding a name
    winning (as on ``sys.path``)."""
    from importlib.metadata import distributions

    out: dict[str, tuple[str, object]] = {}
    for p in paths:
        for d in distributions(path=[p]):
            name = d.metadata["Name"]
            if name and _norm(name) not in out:
                out[_norm(name)] = (d.version, d)
    return out


def unmet(requires: list[str], extras: set[str], have: dict[str, str]) -> list[tuple[str, str]]:
    """The requirements among ``requires`` (``Requires-Dist`` strings) that apply (their
    markers evaluated with each of ``extras`` and no extra) and that ``have`` (name ->
    version) does not satisfy: (name, the requirement as pip takes it). Extras of a
    requirement are kept on it."""
    from packaging.requirements import Requirement

    out = []
    for s in requires:
        r = Requirement(s)
        if r.marker is not None and not any(
            r.marker.evaluate({"extra": e}) for e in (extras | {""})
        ):
            continue
        v = have.get(_norm(r.name))
        if v is None or (r.specifier and not r.specifier.contains(v, prereleases=True)):
            ex = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
            out.append((_norm(r.name), f"{r.name}{ex}{r.specifier}"))
    return out


def base_paths() -> list[str]:
    """The project environment's site-packages (what an overlay shadows)."""
    p = sysconfig.get_paths()
    return list(dict.fromkeys([p["purelib"], p["platlib"]]))


def _pip_target(target: Path, specs: list[str]) -> str:
    """``pip install --no-deps --target``; returns pip's last error line or ''."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade"]
        + ["--target", str(target), *specs],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        lines = [s for s in r.stderr.splitlines() if s.strip() and "WARNING" not in s]
        return lines[-1] if lines else f"pip exited {r.returncode}"
    return ""


def resolve(dist: str, version: str, constraints: dict[str, str], work: Path) -> dict:
    """What ``pip install dist==version`` would change in the project's environment, with
    ``constraints`` (name -> version) held: pip's own resolver, run dry (``--dry-run
    --report``); {"install": [(name, version)]} or {"error": pip's last line}."""
    work.mkdir(parents=True, exist_ok=True)
    cfile, report = work / "constraints.txt", work / "report.json"
    cfile.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
    report.unlink(missing_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report)]
        + ["-c", str(cfile), f"{dist}=={version}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode or not report.exists():
        lines = [x for x in r.stderr.splitlines() if x.strip() and "WARNING" not in x]
        bad = [x for x in lines if "conflict" in x.lower() or "depends on" in x]
        return {"error": (bad or lines or [f"pip exited {r.returncode}"])[-1][:300]}
    items = json.loads(report.read_text()).get("install", [])
    return {
        "install": [(_norm(i["metadata"]["name"]), i["metadata"]["version"]) for i in items],
        "requires": {
            _norm(i["metadata"]["name"]): i["metadata"].get("requires_dist") or [] for i in items
        },
    }


def reachable(root: str, requires: dict[str, list[str]], skip: set[str]) -> set[str]:
    """The packages of a resolution (name -> its ``Requires-Dist``) that ``root`` needs
    without passing through ``skip`` (a pinned package left out takes its own
    requirements with it); extras followed."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [(_norm(root), frozenset())]
    while todo:
        name, extras = todo.pop()
        if name in seen or name in skip or name not in requires:
            continue
        seen.add(name)
        for s in requires[name]:
            r = Requirement(s)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((_norm(r.name), frozenset(r.extras)))
    return seen


def make_overlay(dist: str, version: str, target: Path, rounds: int = 5) -> dict:
    """Install ``dist==version`` into ``target`` with what pip's resolver would change in
    the project's environment for it (resolved with the project's ``==`` pins held; where
    that is impossible, with torch alone held and the pinned packages left out), each
    ``--no-deps``; then, round by round, any requirement the overlay's distributions
    declare that the overlay plus the project's environment still do not satisfy (the
    only step where pip cannot resolve at all, e.g. a release needing another torch),
    never torch nor a pinned package. Returns what it did: seconds, the method, the
    packages the overlay holds (name -> version), the requirements left unmet and pip's
    errors."""
    t0 = time.time()
    target.mkdir(parents=True, exist_ok=True)
    info: dict = {"seconds": None, "method": None, "packages": {}, "unmet": [], "errors": []}
    pins = {n: v for n, v in project_pins().items() if n != _norm(dist)}
    held = [pins, {n: v for n, v in pins.items() if n == "torch"}]
    scratch = target.parent / f".resolve-{target.name}"
    plan, left = None, []
    for i, cons in enumerate(held):
        got = resolve(dist, version, cons, scratch)
        if "install" in got:
            keep = reachable(dist, got["requires"], set(pins) | NEVER)
            plan = [(n, v) for n, v in got["install"] if n in keep or n in pins or n in NEVER]
            info["method"] = "pip resolver, " + (
                "the project's == pins held" if i == 0 else "torch held, pinned packages left out"
            )
            break
        info.setdefault("resolver", []).append(got["error"])
    shutil.rmtree(scratch, ignore_errors=True)
    if plan is None:
        info["method"] = "declared requirements (pip cannot resolve the release here)"
        plan = [(_norm(dist), version)]
    specs = []
    for n, v in plan:
        if n in pins or n in NEVER:
            why = f"the project pins {n}=={pins[n]}" if n in pins else "never installed here"
            left.append(f"pip would install {n} {v}: {why}")
        else:
            specs.append(f"{n}=={v}")
    if _norm(dist) + "==" + version not in specs:
        specs.insert(0, f"{dist}=={version}")
    err = _pip_target(target, specs)
    if err:  # one at a time: a requirement pip cannot meet must not block the others
        for spec in specs:
            e = _pip_target(target, [spec])
            if e:
                info["errors"].append(f"{spec}: {e}")
    if not installed([str(target)]).get(_norm(dist)):
        info["seconds"] = time.time() - t0
        return info
    extras: dict[str, set[str]] = {_norm(dist): set()}
    tried: set[str] = set()
    for _ in range(rounds):
        have = installed([str(target), *base_paths()])
        flat = {n: v for n, (v, _d) in have.items()}
        overlay = installed([str(target)])
        need: dict[str, str] = {}
        left_now = []
        for name, (_ver, d) in overlay.items():
            for n, spec in unmet(d.requires or [], extras.get(name, set()), flat):
                if n in pins:
                    if not any(f"install {n} " in x for x in left):  # said once
                        left_now.append(f"{name} needs {spec}: the project pins {n}=={pins[n]}")
                    continue
                if n in NEVER or spec in tried:
                    left_now.append(f"{name} needs {spec}")
                    continue
                need.setdefault(n, spec)
        if not need:
            break
        from packaging.requirements import Requirement

        for n, spec in need.items():
            extras.setdefault(n, set()).update(Requirement(spec).extras)
        tried.update(need.values())
        for spec in need.values():
            e = _pip_target(target, [spec])
            if e:
                info["errors"].append(f"{spec}: {e}")
    info["unmet"] = sorted(set(left + left_now))
    info["packages"] = {n: v for n, (v, _d) in installed([str(target)]).items()}
    info["megabytes"] = sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 2**20
    info["seconds"] = time.time() - t0
    return info


def child_env(overlays: list[Path], env: dict | None = None) -> dict:
    """The environment of a child run on ``overlays``: they come first on PYTHONPATH,
    which Python places before site-packages; one thread for torch and BLAS."""
    env = dict(os.environ if env is None else env)
    parts = [str(p) for p in overlays]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _last_line(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1][:400] if lines else ""


def probe(module: str, overlays: list[Path], code: str = "", env: dict | None = None) -> dict:
    """Import ``module`` in a child on ``overlays`` (then run ``code``): its
    ``__version__``, its file, or the error's last line."""
    src = (
        "import importlib, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "v = getattr(m, '__version__', None)\n"
        "if v is None:\n"
        "    try:\n"
        "        v = importlib.import_module(m.__name__ + '.version').__version__\n"
        "    except Exception:\n"
        "        pass\n"
        f"{code}\n"
        f"print({MARK!r} + json.dumps({{'version': v and str(v), 'file': m.__file__}}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", src],
        env=child_env(overlays, env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    for line in r.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return {"version": None, "file": None, "error": _last_line(r.stderr) or f"exit {r.returncode}"}


# ---------------------------------------------------------------- the cases, in a child

#: run in the child: sys.argv = [MARK, ROOT, lib, module, dist, cases_module, case, ...]; one result
#: line per case (the import of the audit happens inside the first case, so an import
#: error is that case's error, and every case's)
CHILD = r"""
import importlib, importlib.metadata as md, json, sys, time, traceback
CHECK = "version_check"
MARK, ROOT, lib, modname, dist, cases_module, stated_in, *cases = sys.argv[1:]
head = {"dist_version": None, "module_version": None, "module_file": None}
try:
    head["dist_version"] = md.version(dist)
    m = importlib.import_module(modname)
    head["module_file"] = m.__file__
    v = getattr(m, "__version__", None)
    if v is None:
        try:
            v = importlib.import_module(modname + ".version").__version__
        except Exception:
            pass
    head["module_version"] = v and str(v)
except Exception:
    head["error"] = traceback.format_exc().strip().splitlines()[-1]
print(MARK + json.dumps({"head": head}), flush=True)
for case in cases:
    t0 = time.time()
    out = {"case": case}
    try:
        if case == CHECK:  # the audit's own version check, apart from any training
            out.update(kind="check", what="check_version()")
            importlib.import_module(stated_in).check_version()
            out.update(verdict="accepted", findings=[])
            print(MARK + json.dumps({**out, "seconds": time.time() - t0}), flush=True)
            continue
        mod = importlib.import_module(cases_module)
        from benchmarks.auditing.libraries import row
        kinds = {c[0]: c[1:] for c in mod.CASES}
        kind, what = kinds[case]
        out.update(kind=kind, what=what)
        if lib == "opacus":
            res = mod.train_and_audit(case, 300)
        else:
            res = mod.run_case(case, seed=0, quick=False)
        r = row(res, kind, what, head["module_version"] or "?")
        out.update(verdict=r["verdict"], expected=r["expected"],
                   findings=list(dict.fromkeys(r["findings"])), untested=r.get("untested"))
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        out["error"] = traceback.format_exc().strip().splitlines()[-1][:400]
        mine = [f for f in traceback.extract_tb(exc.__traceback__)
                if f.filename.startswith(ROOT) and "/.venv/" not in f.filename]
        if mine:
            out["where"] = f"{mine[-1].filename[len(ROOT):]}:{mine[-1].lineno}"
    out["seconds"] = time.time() - t0
    print(MARK + json.dumps(out, default=str), flush=True)
"""


def run_cases(lib: str, cases: list[str], overlay: Path, timeout: float = 900) -> dict:
    """The cases of ``lib`` in one child on ``overlay``: {"head": ..., "cases": [...]}."""
    spec = LIBRARIES[lib]
    args = [MARK, str(ROOT) + os.sep, lib, spec["module"], spec["dist"], spec["cases_module"]]
    args += [spec["stated_in"], *cases]
    try:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, *args],
            env=child_env([overlay]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        stdout, stderr, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr, rc = f"timed out after {timeout:.0f} s", -1
    head: dict = {}
    done: dict[str, dict] = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            d = json.loads(line[len(MARK) :])
            if "head" in d:
                head = d["head"]
            else:
                done[d["case"]] = d
    crash = _last_line(stderr) or f"exit {rc}"
    out = [
        done.get(c) or {"case": c, "error": f"child ended: {crash}", "seconds": None} for c in cases
    ]
    return {"head": head, "cases": out}


def kinds(lib: str) -> dict[str, str]:
    """case -> kind, from the library table's module in this (the project's) environment."""
    import importlib

    try:
        return {c[0]: c[1] for c in importlib.import_module(LIBRARIES[lib]["cases_module"]).CASES}
    except ImportError:
        return {}


def expected_verdict(kind: str | None) -> str | None:
    """The library table's rule (:func:`benchmarks.auditing.libraries.row`)."""
    if kind == "check":
        return "accepted"
    return None if kind is None else "pass" if kind == "correct" else "fail"


def row(
    lib: str,
    version: str,
    ranged: bool,
    head: dict,
    c: dict,
    overlay: Path,
    stated_spec: str | None = None,
) -> dict:
    """One table row: (library, version, case) and what happened. ``stated_spec``: the
    range the audit module states (a release outside it should be refused)."""
    kind = c.get("kind") or ("check" if c["case"] == CHECK else kinds(lib).get(c["case"]))
    special = expectation(lib, version, c["case"]) if ranged else None
    isolated = bool(head.get("module_file")) and str(overlay) in str(head.get("module_file"))
    seen = head.get("module_version") or head.get("dist_version")
    r = {
        "library": lib,
        "version": version,
        "in_range": ranged,
        "in_stated_range": in_stated(version, stated_spec),
        "case": c["case"],
        "kind": kind or "—",
        "verdict": c.get("verdict"),
        "expected": ((special and special[0]) or c.get("expected") or expected_verdict(kind) or "—")
        if ranged
        else "clear error (names the installed version)",
        "why": special and special[1],
        "raises": special and special[2],
        "findings": c.get("findings", []),
        "seconds": c.get("seconds"),
        "error": c.get("error"),
        "where": c.get("where"),
        "version_seen": seen,
        "isolated": isolated and seen == version,
    }
    r["status"] = status(r)
    return r


def status(r: dict) -> str:
    """as expected / not as expected / refused (an error naming the release, which is
    outside the range the audit states) / error / not isolated."""
    if not r["isolated"]:
        return "not isolated"
    err = r.get("error") or ""
    names = bool(err) and r["version"] in err
    if not r["in_range"]:
        return "as expected" if names else "not as expected"
    if r["expected"] == NOT_AVAILABLE:  # the case cannot be built: it must raise that
        if not err:
            return "not as expected"
        return "as expected" if re.search(r.get("raises") or "$^", err) else "error"
    if err:
        return "refused" if names and r.get("in_stated_range") is False else "error"
    return "as expected" if r["verdict"] == r["expected"] else "not as expected"


# ---------------------------------------------------------------- table


def _f(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.1f}"
    return str(x).replace("|", "\\|")


def table(head: dict, rows: list[dict], envs: list[dict]) -> str:
    out = [
        "# The library releases people run, audited (#47 item 4)",
        "",
        f"Command: `{head['command']}`  ",
        f"Machine: {head['machine']}  ",
        f"Date: {head['date']}  ",
        f"Commit: {head['commit']}{' (dirty tree)' if head['dirty'] else ''}  ",
        f"Wall time: {head['wall_s']:.0f} s (cases on one thread, one child process per "
        "library and release)  ",
        f"Project environment: {head['base']}",
        "",
        "Ranges and the releases run (oldest, middle, newest; `below`: the release under the "
        "range, where the audit should refuse with a clear error):",
        "",
        "| library | range | releases in it | run | below | the audit states | listed by |",
        "|---|---|---|---|---|---|---|",
    ]
    for lib, r in head["ranges"].items():
        out.append(
            f"| {lib} | {r['first']} … {r['last']} | {len(r['releases'])}: "
            f"{', '.join(r['releases'])} | {', '.join(r['picked'])} | {r['below'] or '—'} | "
            f"{_f(r.get('stated'))} | {r['source']} |"
        )
        for v, e in r.get("probe_failed", {}).items():
            out.append(f"| {lib} | (not in range: {v}) | — | — | — | — | probe: {_f(e)} |")
    out += [
        "",
        "| library | version | in range | case | kind | verdict | expected | findings | "
        "status | s | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                [
                    r["library"],
                    r["version"],
                    "yes" if r["in_range"] else "**no**",
                    r["case"],
                    r["kind"],
                    _f(r["verdict"]),
                    r["expected"] + (f" ({_f(r['why'])})" if r.get("why") else ""),
                    ", ".join(r["findings"]) or "—",
                    r["status"] if r["status"] == "as expected" else f"**{r['status']}**",
                    _f(r["seconds"]),
                    _f(r["error"]) + (f" (`{r['where']}`)" if r.get("where") else ""),
                ]
            )
            + " |"
        )
    counts = {
        k: sum(r["status"] == k for r in rows) for k in dict.fromkeys(r["status"] for r in rows)
    }
    n_ok = counts.pop("as expected", 0)
    more = "".join(f", {n} {k}" for k, n in counts.items())
    out += [
        "",
        f"{n_ok} of {len(rows)} rows as expected{more}.",
        "",
        "Environments (an overlay per release over the project's environment: the release, "
        "`--no-deps`, plus the releases of its own requirements the project's environment "
        "does not meet; torch always the project's):",
        "",
        "| library | version | install s | MB | how | overlay holds | requirements left unmet | "
        "pip errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in envs:
        pk = ", ".join(f"{n} {v}" for n, v in sorted(e["packages"].items()))
        out.append(
            f"| {e['library']} | {e['version']} | {_f(e['seconds'])} | "
            f"{_f(e.get('megabytes'))} | {_f(e.get('method'))} | {pk or '—'} | "
            f"{_f('; '.join(e['unmet'])) if e['unmet'] else '—'} | "
            f"{_f('; '.join(e['errors'])) if e['errors'] else '—'} |"
        )
    out += [
        "",
        "**Columns.** verdict: the library audit's verdict for the case (the library table's "
        "cases and rule for the expected verdict: `pass` for a correct case, `fail` for a "
        "misuse); findings: the codes of the audit's findings; status: `as expected`, "
        "`not as expected`, `refused` (the case raised an error naming the release, which "
        "is outside the range the audit states), `error` (the case raised: its last line in "
        "the error column, with the last frame in the project's code) or "
        "`not isolated` (the child did not import the release under test); "
        f"expected `{NOT_AVAILABLE}` (with why): the case's own code needs an API the "
        "release lacks, so it raises before the audit runs, and is as expected only where "
        "it raises that error; for a release "
        "below the range, `as expected` means the case raised an error naming the installed "
        "version. s: the case's seconds (training and audit), the first case of a release "
        "also importing the audit.",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def _git(*a) -> str:
    try:
        return subprocess.run(
            ["git", *a], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    except Exception:
        return ""


def _base() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = [f"Python {platform.python_version()}"]
    for n in ("torch", "numpy", "scipy", "protobuf", "dp-accounting", "opacus", "flwr", "pfl"):
        try:
            out.append(f"{n} {version(n)}")
        except PackageNotFoundError:
            out.append(f"{n} not installed")
    return ", ".join(out)


def plan(lib: str, available: list[str], work: Path, probe_log: dict) -> tuple[dict, list]:
    """The range of ``lib`` (probing its first release where the table gives none) and
    the releases to run: [(version, in range)]."""
    spec = LIBRARIES[lib]
    first = spec["first"]
    failed: dict[str, str] = {}
    if first is None:  # the oldest release whose probe imports on this Python and torch
        for v in releases(available, None, spec["last"]):
            ov = work / f"{lib}-{v}"
            info = make_overlay(spec["dist"], v, ov)
            probe_log[(lib, v)] = info
            p = probe(spec["module"], [ov], spec.get("probe", ""))
            if p.get("error") is None:
                first = v
                break
            failed[v] = p["error"] or "; ".join(info["errors"])
        first = first or spec["last"]
    rel = releases(available, first, spec["last"])
    picked = pick(rel)
    text, spec_stated = stated(lib)
    # the oldest release the audit states, where it is not one of the three
    own = [v for v in rel if in_stated(v, spec_stated)]
    if own and own[0] not in picked:
        picked = sorted([*picked, own[0]], key=_v)
    under = max(failed, key=_v) if failed else below(available, first)
    rng = {
        "first": first,
        "last": spec["last"],
        "releases": rel,
        "picked": picked,
        "below": under,
        "probe_failed": failed,
        "stated": text,
        "stated_spec": spec_stated,
    }
    runs = ([(under, False)] if under else []) + [(v, True) for v in picked]
    return rng, runs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.auditing.versions")
    ap.add_argument("--library", action="append", choices=sorted(LIBRARIES))
    ap.add_argument("--all-cases", action="store_true", help="every case of the library table")
    ap.add_argument("--case", action="append", help="LIB:CASE (repeatable): these cases only")
    ap.add_argument("--version", action="append", help="LIB==X (repeatable): these releases")
    ap.add_argument("--no-below", action="store_true", help="skip the release under the range")
    ap.add_argument("--out", type=Path, default=RESULTS / "versions")
    ap.add_argument("--work", type=Path, default=None, help="where the overlays go (a tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the overlays")
    a = ap.parse_args(argv)
    t_start = time.time()
    libs = a.library or list(LIBRARIES)
    work = a.work or Path(tempfile.mkdtemp(prefix="fedlora-versions-"))
    work.mkdir(parents=True, exist_ok=True)
    only = {}
    for s in a.version or []:
        lib, _, v = s.partition("==")
        only.setdefault(lib, []).append(v)
    chosen = {}
    for s in a.case or []:
        lib, _, c = s.partition(":")
        chosen.setdefault(lib, []).append(c)
    rows: list[dict] = []
    envs: list[dict] = []
    ranges: dict[str, dict] = {}
    probe_log: dict = {}
    try:
        for lib in libs:
            spec = LIBRARIES[lib]
            available, source = list_versions(spec["dist"])
            rng, runs = plan(lib, available, work, probe_log)
            rng["source"] = source
            ranges[lib] = rng
            if lib in only:
                runs = [(v, in_range(v, rng["first"], rng["last"])) for v in only[lib]]
            elif a.no_below:
                runs = [r for r in runs if r[1]]
            if lib in chosen:
                cases = chosen[lib]
            elif a.all_cases:
                import importlib

                cases = [c[0] for c in importlib.import_module(spec["cases_module"]).CASES]
            else:
                cases = spec["cases"]
            print(f"{lib}: range {rng['first']} … {rng['last']}, runs {runs}", flush=True)
            for v, ranged in runs:
                ov = work / f"{lib}-{v}"
                info = probe_log.get((lib, v)) or make_overlay(spec["dist"], v, ov)
                envs.append({"library": lib, "version": v, **info})
                print(
                    f"  {lib} {v}: overlay in {info['seconds']:.1f} s, "
                    f"{sorted(info['packages'].items())} unmet {info['unmet']} "
                    f"errors {info['errors']}",
                    flush=True,
                )
                # the audit's version check first; out of range, it and the first case
                # show the refusal
                res = run_cases(lib, [CHECK, *(cases if ranged else cases[:1])], ov)
                for c in res["cases"]:
                    rows.append(row(lib, v, ranged, res["head"], c, ov, rng["stated_spec"]))
                    r = rows[-1]
                    print(
                        f"    {r['case']:24s} {_f(r['verdict']):10s} expected "
                        f"{r['expected'][:10]:10s} {r['status']:16s} {r['findings']} "
                        f"{_f(r['seconds'])} s {r['error'] or ''}",
                        flush=True,
                    )
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    head = {
        "command": "python -m benchmarks.auditing.versions " + " ".join(argv),
        "commit": _git("rev-parse", "HEAD").strip() or "?",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no").strip()),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "base": _base(),
        "ranges": ranges,
        "wall_s": time.time() - t_start,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {**head, "rows": rows, "environments": envs}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (a.out / "table.md").write_text(table(head, rows, envs))
    bad = [
        f"{r['library']} {r['version']} {r['case']}" for r in rows if r["status"] != "as expected"
    ]
    print(
        f"wrote {a.out}/results.json and table.md in {head['wall_s']:.0f} s; not as expected: "
        f"{bad or 'none'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
