"""benchmarks.auditing.faults --grid quick: one short run per new sampling rate (q = 0.05, 0.01)
with a blatant fault (noise × ¼) and one correct FedASK run (W-space slots, Dirichlet); the
rows carry both findings, the conformance ratios and the audit's time, and the tables render."""

from __future__ import annotations

import json

import pytest

from benchmarks.auditing import faults as F
from benchmarks.auditing import faults_table as FT


def test_grids_are_well_formed():
    full = F.grid_full()
    cells = [c for c in full if not c.get("power")]
    # every target fault at every q with 10 seeds at ε = 3
    for s in F.TINY_QS:
        for f in F.TARGET_FAULTS + F.OTHER_FAULTS:
            assert any(
                c["fault"] == f and c["setting"] == s and c["eps"] == 3.0 and c["seeds"] == 10
                for c in cells
            ), (f, s)
    assert {c["setting"] for c in full if c.get("power")} == set(F.TINY_QS)
    correct = [c for c in cells if c["fault"] == "none"]
    assert sum(c["seeds"] for c in correct) >= 60
    assert {c["method"] for c in correct} >= {"fedavg", "ffa", "fedask", "fedpower", "plora"}
    assert {c["partition"] for c in correct} == {"iid", "dirichlet"}
    assert {F.SETTINGS[c["setting"]].get("dp_level", "sample") for c in correct} == {
        "sample",
        "client",
    }
    # q = batch / members per client, and >= 100 steps at the small rates
    for s in F.TINY_QS:
        cfg = F.config(s, 3.0, "fedavg", "iid", "", 0)
        assert cfg.batch_size / (cfg.members / cfg.clients) == pytest.approx(F.Q[s])
        if F.Q[s] <= 0.05:
            assert cfg.rounds * cfg.local_steps >= 100


def test_quick_grid_flags_the_blatant_fault(tmp_path):
    assert F.main(["--grid", "quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = doc["runs"]
    assert len(rows) == 3
    for r in rows:
        for k in (
            "q",
            "steps",
            "sigma",
            "epsilon_claimed",
            "epsilon_lb",
            "implied_epsilon",
            "mechanism_mismatch",
            "empirical_exceeds_claim",
            "flagged",
            "conformance",
            "train_s",
            "audit_s",
        ):
            assert k in r, k
        assert isinstance(r["conformance"], dict) and r["audit_s"] > 0
    faulty = [r for r in rows if r["fault"] != "none"]
    assert {r["q"] for r in faulty} == {0.05, 0.01}
    for r in faulty:
        assert r["flagged"] and r["mechanism_mismatch"], r
        ratios = {
            t["group"]: t["observed_over_claimed"]
            for t in r["conformance"]["tests"]
            if t["test"] == "scale"
        }
        assert set(ratios) == {"A", "B", "head"}
        # the data's own gradient adds to the head's variation where σ is small (q = 0.01)
        assert 0.15 < ratios["A"] < 0.4 and 0.15 < ratios["B"] < 0.4, ratios
        assert ratios["head"] < 0.7, ratios
        assert r["implied_epsilon"] > 2 * r["epsilon_claimed"]
    (ok,) = [r for r in rows if r["fault"] == "none"]
    assert ok["method"] == "fedask" and not ok["flagged"]
    assert "B (W-space)" in {t["group"] for t in ok["conformance"]["tests"]}
    # the correct run carries sampler canaries: their permutation test is in the family
    assert ok["sampler_canaries"] == 100 and ok["conformance"]["sampling"] is not None
    assert all(r["sampler_canaries"] == 0 for r in faulty)
    assert doc["false_alarms"]["all"]["runs"] == 1
    md = (tmp_path / "table.md").read_text()
    assert md.startswith("# Planted faults") and "command: `" in md and "commit" in md


def test_clopper_pearson_and_power_curve():
    lo, hi = FT.clopper_pearson(0, 60)
    assert lo == 0.0 and 0.05 < hi < 0.07
    row = dict(method="fedavg", partition="iid", eps=3.0, level="sample", setting="q1")
    rows = [dict(row, fault="noise_scale=0.9", flagged=i < 9) for i in range(10)]
    rows += [dict(row, fault="noise_scale=0.95", flagged=i < 8) for i in range(10)]
    pc = FT.power_curve(rows)
    assert pc["q1"]["largest_f_flagged_9_of_10"] == 0.9
