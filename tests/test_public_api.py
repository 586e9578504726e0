"""The Python API (#41 item 5): every package's ``__init__`` names its public API in
``__all__`` and loads it lazily; ``import audit``, ``import fl`` and ``import attacks`` import no
torch; no module imports another module's private (underscore) name; the audit's results are
typed records that are also the read-only dicts of their JSON.

``benchmarks/__init__.py`` is the exception to the first rule: it must stay empty of
definitions, because opacus installs a top-level package of its own named ``benchmarks``
(see its docstring), so it is checked to be empty instead.
"""

import ast
import copy
import importlib
import inspect
import json
import pickle
import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the repository's own top-level packages
FIRST_PARTY = ("fl", "analysis", "attacks", "audit", "benchmarks", "pipeline")
#: where the import scan looks (the packages, their tests, the docs' examples, scripts)
SCANNED = (*FIRST_PARTY, "tests", "docs", "flower_app", "scripts")


def _packages() -> list[str]:
    found = []
    for top in FIRST_PARTY:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(ROOT).parts))
    return found


PACKAGES = _packages()
API_PACKAGES = [p for p in PACKAGES if p != "benchmarks"]


def test_the_packages_are_found():
    assert {"audit", "audit.bounds", "fl", "fl.run", "attacks", "analysis"} <= set(PACKAGES)
    assert {"benchmarks.perf", "benchmarks.grids", "benchmarks.auditing"} <= set(PACKAGES)


@pytest.mark.parametrize("name", API_PACKAGES)
def test_every_public_name_resolves_and_is_documented(name):
    pkg = importlib.import_module(name)
    assert isinstance(getattr(pkg, "__all__", None), list | tuple), f"{name} has no __all__"
    assert pkg.__all__, f"{name}.__all__ is empty"
    assert len(set(pkg.__all__)) == len(pkg.__all__), f"{name}.__all__ repeats a name"
    assert inspect.getdoc(pkg), f"{name} has no docstring"
    folder = Path(pkg.__file__).parent
    for public in pkg.__all__:
        value = getattr(pkg, public)  # AttributeError / ImportError: a broken entry
        if inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value):
            assert inspect.getdoc(value), f"{name}.{public} has no docstring"
        # a name that is also a submodule must be that submodule: a function re-exported
        # under its module's name would replace the module as the package's attribute
        if (folder / f"{public}.py").is_file() or (folder / public / "__init__.py").is_file():
            assert inspect.ismodule(value), f"{name}.{public} shadows the submodule {public}"
        assert public in dir(pkg)


@pytest.mark.parametrize("name", [p for p in API_PACKAGES if p != "fl.linalg"])
def test_lazy_packages_raise_attribute_error_for_other_names(name):
    """A lazy ``__getattr__`` must raise AttributeError for a name it does not know, so
    that ``from pkg import submodule`` still imports the submodule."""
    pkg = importlib.import_module(name)
    assert callable(getattr(pkg, "__getattr__", None)), f"{name} is not lazy"
    with pytest.raises(AttributeError, match="no_such_name"):
        pkg.no_such_name  # noqa: B018


def test_from_package_import_submodule_still_works():
    from audit.bounds import conformance as conformance_module
    from audit.bundle import replay as replay_module
    from audit.canaries import canary_set

    assert inspect.ismodule(conformance_module) and inspect.ismodule(replay_module)
    assert canary_set.new_canary_set is importlib.import_module("audit").new_canary_set
    assert importlib.import_module("audit").conformance is conformance_module.conformance


def test_benchmarks_init_defines_nothing():
    tree = ast.parse((ROOT / "benchmarks" / "__init__.py").read_text(encoding="utf-8"))
    body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) else tree.body
    assert not body, "benchmarks/__init__.py must hold only its docstring"


@pytest.mark.parametrize("name", ["audit", "fl", "attacks", "analysis", "pipeline"])
def test_importing_a_top_level_package_imports_no_torch(name):
    code = (
        "import sys\n"
        f"import {name}\n"
        f"{name}.__all__\n"
        "heavy = [m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-2000:]


# ----------------------------------------------------------------------------- private names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from M import _x`` and ``import M._x`` of the repository's own modules in one file."""
    where = path.relative_to(root)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            parts = (node.module or "").split(".")
            if node.level == 0 and parts[0] not in FIRST_PARTY:
                continue  # another project's private name is that project's business
            mod = "." * node.level + (node.module or "")
            if any(_private(p) for p in parts):
                found.append(f"{where}:{node.lineno}: from {mod} import ...")
            found += [
                f"{where}:{node.lineno}: from {mod} import {a.name}"
                for a in node.names
                if _private(a.name)
            ]
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in FIRST_PARTY and any(_private(p) for p in parts):
                    found.append(f"{where}:{node.lineno}: import {a.name}")
    return found


def test_the_scan_finds_private_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from __future__ import annotations\n"
        "from fl.linalg.core import _weights, client_weights\n"
        "from opacus.optimizers.optimizer import _generate_noise\n"
        "import audit._z\n"
        "from .sibling import _helper\n"
        "from fl.linalg import __all__\n"
        "from audit.report.document import format_cell as _fmt\n"
    )
    assert _private_imports(probe, tmp_path) == [
        "probe.py:2: from fl.linalg.core import _weights",
        "probe.py:4: import audit._z",
        "probe.py:5: from .sibling import _helper",
    ]


def test_no_module_imports_a_private_name_of_another():
    files = [p for top in SCANNED if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py")]
    assert len(files) > 100
    found = [hit for p in sorted(files) for hit in _private_imports(p)]
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------- records


def _scores(n=400, shift=1.0, seed=0):
    rng = np.random.default_rng(seed)
    included = rng.random(n) < 0.5
    return rng.normal(size=n) + shift * included, included


def _records():
    from audit import (
        check_claim,
        epsilon_lower_bound,
        epsilon_one_run,
        fdp_one_run_bound,
    )

    s, y = _scores()
    claim = dict(level="sample", noise_multiplier=1.0, clipping_norm=1.0, sampling="poisson",
                 sample_rate=0.01, steps_per_round=1000, rounds=1, claimed_epsilon=2.0,
                 delta=1e-5, noise_source="csprng")  # fmt: skip
    return {
        "ThresholdBound": epsilon_lower_bound(s[y], s[~y], 1e-5),
        "ThresholdBound gdp": epsilon_lower_bound(s[y], s[~y], 1e-5, method="gdp"),
        "OneRunBound": epsilon_one_run(s, y, 1e-5),
        "FdpBound": fdp_one_run_bound(s, y, 1e-5, family="dp"),
        "ClaimCheck": check_claim(claim),
    }


@pytest.fixture(scope="module")
def records():
    return _records()


@pytest.mark.parametrize("which", ["ThresholdBound", "ThresholdBound gdp", "OneRunBound",
                                   "FdpBound", "ClaimCheck"])  # fmt: skip
def test_results_are_records_and_read_only_dicts(records, which):
    import audit
    from audit.records import Record

    res = records[which]
    assert type(res) is getattr(audit, which.split()[0])
    assert isinstance(res, Record) and isinstance(res, dict)
    d = res.to_dict()
    assert type(d) is dict and d == res and list(d) == list(res)
    assert 10 <= len(d) <= 20
    for k, v in d.items():  # the attributes are the dict's values
        assert getattr(res, k) is v
        assert res[k] is v and res.get(k) is v and k in res
    assert json.dumps(res) == json.dumps(d)  # the JSON contract, key order included
    with pytest.raises(TypeError, match="read-only"):
        res["epsilon_pld" if which == "ClaimCheck" else "epsilon_lb"] = 0.0
    with pytest.raises(TypeError, match="read-only"):
        res.update(x=1)
    with pytest.raises(FrozenInstanceError):
        res.delta = 0.5
    for twin in (pickle.loads(pickle.dumps(res)), copy.deepcopy(res)):
        assert type(twin) is type(res) and twin == res and list(twin) == list(res)


def test_an_optional_key_is_absent_when_none(records):
    cp, gdp = records["ThresholdBound"], records["ThresholdBound gdp"]
    assert "mu_lb" not in cp and cp.mu_lb is None
    assert "mu_lb" in gdp and gdp.mu_lb == gdp["mu_lb"] > 0
    assert list(gdp)[-2:] == ["mu_lb", "epsilon_lb"]


def test_run_audit_keeps_the_dict_order_and_its_optional_keys():
    from audit import RunAudit

    fields = dict(run_dir="r", kind="run", method="fedavg", level="none",
                  claimed_epsilon=None, delta=None, epsilon_pld=None, epsilon_rdp=None,
                  understated=False, tampered=False, ratio=None, stored=None, recomputed=None,
                  findings=[], skipped=[], trusted=[], trusted_note=None, replay=None,
                  key_id=None, adapter_sha256="ab")  # fmt: skip
    res = RunAudit(**fields)
    assert list(res) == list(fields) and "sigma" not in res and "one_run" not in res
    dp = RunAudit(**{**fields, "level": "sample", "sigma": 1.0, "one_run": {"epsilon_lb": 0.1}})
    assert list(dp)[-4:] == ["key_id", "sigma", "one_run", "adapter_sha256"]
    assert dp.one_run["epsilon_lb"] == 0.1
    dp.findings.append({"code": "key_shared"})  # flag_shared_keys appends to the list
    assert dp["findings"] == [{"code": "key_shared"}]
