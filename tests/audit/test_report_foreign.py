"""`fedlora report` on what an outside user has: a foreign adapter's attack folder and the
saved JSON of `fedlora audit --claim FILE --json` (audit.report.build.build_report directly)."""

import json

import numpy as np
import pytest

from attacks.metrics import roc_metrics
from audit.claims.check import check_claim
from audit.report.build import build_report
from fl.errors import UsageError


@pytest.fixture
def foreign(tmp_path):
    att = tmp_path / "my_adapter" / "attacks"
    att.mkdir(parents=True)
    rng = np.random.default_rng(0)
    is_member = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    loss = rng.normal(size=100) + 0.5 * is_member
    res = roc_metrics(loss, is_member, n_bootstrap=20, seed=0)
    res.update(threat_model="loss threshold", seconds=0.1)
    doc = {"schema_version": 1, "seed": 0, "shadows": None, "attacks": {"loss": res},
           "target": {"adapter": str(tmp_path / "my_adapter"), "model": "minilm",
                      "n_members": 50, "n_nonmembers": 50}}  # fmt: skip
    (att / "attacks.json").write_text(json.dumps(doc))
    np.savez(att / "scores.npz", ids=np.arange(100).astype(str), is_member=is_member, loss=loss)
    claim = dict(level="sample", noise_multiplier=1.0, clipping_norm=1.0, sampling="poisson",
                 batch_size=50, dataset_size=1000, steps_per_round=40, rounds=1,
                 accounting="composed", noise_source="csprng", claimed_epsilon=1.0,
                 delta=1e-5)  # fmt: skip
    cj = tmp_path / "claim_audit.json"
    cj.write_text(json.dumps(check_claim(claim)))
    return att, cj


def test_report_of_a_foreign_adapter_and_a_claim(foreign, tmp_path):
    att, cj = foreign
    s = build_report([], str(tmp_path / "rep"), attack_dirs=[str(att)], claim_audits=[str(cj)])
    (row,) = s["runs"]
    assert row["run"] == "my_adapter" and row["kind"] == "adapter"
    assert row["epsilon_claimed"] == 1.0 and row["epsilon_recomputed"] > 1.0
    assert row["verdict"].startswith("ε understated")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "my_adapter" in md and "loss threshold" in md
    assert "fedlora audit --claim" in md and "fedlora attack --adapter" in md
    assert "Membership inference" in s["sections"]


def test_report_of_an_attack_folder_alone_and_bad_inputs(foreign, tmp_path):
    att, cj = foreign
    s = build_report([], str(tmp_path / "rep"), attack_dirs=[str(att)])
    assert s["runs"][0]["verdict"].startswith("not audited: no claim audit given")
    with pytest.raises(UsageError, match="no attacks.json"):
        build_report([], str(tmp_path / "r2"), attack_dirs=[str(tmp_path)])
    with pytest.raises(UsageError, match="not the output of `fedlora audit --claim"):
        build_report([], str(tmp_path / "r3"), claim_audits=[str(att / "attacks.json")])
    with pytest.raises(UsageError, match="give run directories"):
        build_report([], str(tmp_path / "r4"))
