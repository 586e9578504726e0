"""audit.libraries.opacus, adaptive clipping (#47 item 3): ``make_private(clipping="adaptive")``
(``AdaClipDPOptimizer``). The clip C_t is recorded at every step and each step is tested at
its own C (noise σ·C_t); ε is recomputed at the σ passed to make_private; where the
optimizer holds the adjusted σ_eff (opacus ≤ 1.5, simulated here on 1.6 by restoring its
``__init__`` and ``add_noise``), the σ Opacus's accountant used is named and flagged."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from opacus.optimizers.adaclipoptimizer import AdaClipDPOptimizer  # noqa: E402
from opacus.optimizers.optimizer import DPOptimizer, _generate_noise  # noqa: E402

from audit.libraries.opacus.recorder import adjusted_sigma  # noqa: E402
from audit.libraries.opacus.versions import adaclip_overwrites_sigma  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_libraries_opacus_verdicts import DELTA, _claim, _train  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")


def _adaptive(std=5.0, steps=60, seed=0):
    return _train(
        steps=steps, seed=seed, clipping="adaptive", target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.5, max_clipbound=10.0, min_clipbound=0.05,
        unclipped_num_std=std,
    )  # fmt: skip


def test_correct_adaptive_run_passes_each_step_at_its_own_clip():
    audit, pe, q = _adaptive()
    res = audit.audit(_claim(audit, q, eps=pe.get_epsilon(DELTA)), permutations=199, seed=0)
    assert res["mode"] == "adaptive"
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    run = res["run"]
    clips = run["clip_per_step"]
    assert len(clips) == run["steps"] and max(clips) / min(clips) > 1.3  # the clip moved
    # the noise is σ_eff·C_t at every step: in units of each step's C its scale is σ_eff,
    # not σ × the largest C (the old false alarm: about min(C)/max(C) of the claim)
    sigma_eff = adjusted_sigma(1.0, 5.0)
    assert run["noise_noise_multiplier"] == pytest.approx(sigma_eff)
    scale = next(t for t in res["conformance"]["tests"] if t["test"] == "scale")
    assert 0.9 < scale["observed_over_claimed"] < 1.12
    assert res["canary_clip_error"] < 1e-5  # each drawn canary clipped to its step's C_t
    # opacus 1.6's accountant reads the σ passed: nothing to flag
    assert run["accountant_noise_multiplier"] == pytest.approx(1.0)
    assert "accountant_sigma_adjusted" not in {f["code"] for f in res["findings"]}
    assert res["recomputed_epsilon"] == pytest.approx(res["accountant_epsilon"], rel=0.15)


def _opacus_14_adaclip(monkeypatch):
    """AdaClipDPOptimizer as opacus 1.4 / 1.5 wrote it: __init__ overwrites noise_multiplier
    with σ_eff (which the accountant then reads); add_noise adds σ_eff·C (DPOptimizer's)."""
    init16 = AdaClipDPOptimizer.__init__

    def init14(self, *a, **kw):
        init16(self, *a, **kw)
        self.noise_multiplier = adjusted_sigma(self.noise_multiplier, self.unclipped_num_std)

    def add_noise14(self):
        DPOptimizer.add_noise(self)
        noise = _generate_noise(
            std=self.unclipped_num_std,
            reference=torch.as_tensor(self.unclipped_num, dtype=torch.float),
            generator=self.generator,
        )
        self.unclipped_num = float(self.unclipped_num) + noise

    monkeypatch.setattr(AdaClipDPOptimizer, "__init__", init14)
    monkeypatch.setattr(AdaClipDPOptimizer, "add_noise", add_noise14)


def test_accountant_reading_the_adjusted_sigma_is_flagged(monkeypatch):
    assert not adaclip_overwrites_sigma()  # the installed 1.6
    _opacus_14_adaclip(monkeypatch)
    assert adaclip_overwrites_sigma()  # the probe sees the 1.4 behaviour
    std = 0.6  # σ_eff = (1 − 1/1.44)^(-1/2) ≈ 1.81 for σ = 1
    audit, pe, q = _adaptive(std=std, steps=40)
    eps_acc = pe.get_epsilon(DELTA)  # what a user of opacus 1.4 claims
    res = audit.audit(_claim(audit, q, eps=eps_acc), permutations=99, seed=0)
    run = res["run"]
    assert run["adaclip_holds_adjusted_sigma"]
    assert run["noise_multiplier"] == pytest.approx(1.0)  # the σ passed, recovered
    assert run["accountant_noise_multiplier"] == pytest.approx(adjusted_sigma(1.0, std))
    codes = {f["code"] for f in res["findings"] if f.get("severity", "error") == "error"}
    assert {"accountant_sigma_adjusted", "epsilon_understated"} <= codes
    assert res["verdict"] == "fail"
    assert res["recomputed_epsilon"] > 1.5 * eps_acc
    # the noise itself is σ_eff·C_t: at least the claim's σ·C_t, the scale test passes
    assert "canary:scale" not in res["conformance_rejected"]
