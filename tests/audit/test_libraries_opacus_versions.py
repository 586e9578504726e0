"""audit.libraries.opacus (#47 item 4): the supported opacus range (1.4.0 … 1.6.x), what the
module imports from each release, and one clear error outside the range."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
opacus = pytest.importorskip("opacus")

from audit.libraries.opacus import SUPPORTED, SamplerCanaries  # noqa: E402
from audit.libraries.opacus.versions import check_version, ghost_optimizer_class  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_libraries_opacus_verdicts import _claim, _train  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")


@pytest.mark.parametrize("v", ["1.4.0", "1.4.1", "1.5.2", "1.5.4", "1.6.0", "1.6.1+cu121"])
def test_versions_in_range_are_accepted(v):
    assert check_version(v) == v


@pytest.mark.parametrize("v", ["1.3.0", "0.15.0", "1.7.0", "2.0.0", "unknown"])
def test_a_version_outside_the_range_is_one_clear_line(v):
    with pytest.raises(RuntimeError) as e:
        check_version(v)
    msg = str(e.value)
    assert "\n" not in msg and f"installed opacus is {v}" in msg and SUPPORTED in msg
    assert "1.4.0" in SUPPORTED and "1.7" in SUPPORTED


def test_attach_names_an_installed_release_outside_the_range(monkeypatch):
    monkeypatch.setattr(opacus, "__version__", "1.3.0")
    can = SamplerCanaries(m=4, seed=0)
    can.model(torch.nn.Linear(3, 2))
    with pytest.raises(
        RuntimeError, match=r"supports opacus >= 1\.4\.0.*installed opacus is 1\.3\.0"
    ):
        can.attach(None, None, None)


def test_a_release_without_ghost_clipping_imports_and_audits_flat(monkeypatch):
    """opacus 1.4 has no optimizer_fast_gradient_clipping: the module does not import it
    unconditionally; ghost mode is simply not looked for, flat clipping is audited."""
    monkeypatch.setitem(sys.modules, "opacus.optimizers.optimizer_fast_gradient_clipping", None)
    assert ghost_optimizer_class() is None
    audit, pe, q = _train(steps=12)
    res = audit.audit(_claim(audit, q), permutations=49, seed=0)
    assert res["mode"] == "flat" and res["run"]["opacus_version"] == opacus.__version__
    assert res["coverage"]["tested"]["clipping"]
