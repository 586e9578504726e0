"""audit.findings: one code list; each code carries its severity and whether it is tampering."""

import json

import pytest

from audit.findings import TAMPER_CODES, Code, Finding, Findings, Severity

# the codes that mean tampering (the run's files contradict each other or the replay)
TAMPERING = {
    "adapter_hash_mismatch",
    "adapter_missing",
    "splits_hash_mismatch",
    "splits_missing",
    "ledger_file_mismatch",
    "config_file_mismatch",
    "noise_not_applied",
    "ledger_incomplete",
    "sigma_mismatch",
    "delta_mismatch",
    "sample_rate_mismatch",
    "replay_mismatch",
    "fields_contradict",
    "sealed_file_mismatch",
    "manifest_mac_mismatch",
    "release_mismatch",
}


def test_tamper_codes_and_severities():
    assert set(TAMPER_CODES) == TAMPERING
    assert all(c.severity is Severity.ERROR for c in TAMPER_CODES)
    for name in (
        "noise_reproducible",
        "key_mismatch",
        "delta_too_large",
        "epsilon_invalid",
        "adapter_nonfinite",
        "key_reused",
        "key_shared",
    ):
        assert name not in TAMPER_CODES and Code(name).severity is Severity.ERROR
    assert Code("clipping_norm_missing").severity is Severity.INFO
    assert Code("metrics_missing").severity is Severity.WARNING
    for name in ("manifest_unsealed", "replay_inexact", "epsilon_overstated"):
        assert Code(name).severity is Severity.WARNING
    assert len({c.value for c in Code}) == len(Code)


def test_finding_serializes_to_the_documents_dict():
    f = Finding(Code.SIGMA_MISMATCH, "σ differs")
    d = f.to_dict()
    assert d == {"code": "sigma_mismatch", "severity": "error", "message": "σ differs"}
    assert json.loads(json.dumps(d)) == d and Finding.from_dict(d) == f
    assert f.is_error and f.tampering
    w = Finding("noise_reproducible", "unstated source", "warning")  # strings are parsed
    assert w.code is Code.NOISE_REPRODUCIBLE and w.severity is Severity.WARNING
    assert not w.is_error


def test_a_finding_is_never_stronger_than_its_code():
    with pytest.raises(ValueError, match="above"):
        Finding(Code.METRICS_MISSING, "x", Severity.ERROR)
    with pytest.raises(ValueError):
        Finding("not_a_code", "x")


def test_findings_collector_keeps_order_and_first_explanation():
    fs = Findings()
    fs.add(Code.NO_DP, "a")
    fs.add_once(Code.DELTA_TOO_LARGE, "first")
    fs.add_once(Code.DELTA_TOO_LARGE, "second")
    assert [f["message"] for f in fs.to_dicts()] == ["a", "first"]
    assert fs.has(Code.NO_DP) and not fs.has(Code.KEY_MISMATCH)
