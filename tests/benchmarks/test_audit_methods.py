"""benchmarks.auditing.audit_methods at a tiny size: one sample-level and one client-level run of
FedAvg-LoRA, a refusal row, and the table; every certified bound is at most the ledger's ε."""

from __future__ import annotations

import json
import math

from benchmarks.auditing import audit_methods as AM


def test_one_method_both_levels(tmp_path, monkeypatch):
    # small canary counts: the full 4 000 / 8 000 are the benchmark's, not the test's
    monkeypatch.setitem(AM.LEVELS, "sample", ("eps8", dict(canaries=400)))
    monkeypatch.setitem(AM.LEVELS, "client", ("client3", dict(canary_clients=400)))
    out = tmp_path / "am"
    rc = AM.main(["--methods", "fedavg", "--eps", "8", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["method"], r["level"]) for r in rows] == [("fedavg", "sample"), ("fedavg", "client")]
    for r in rows:
        eps = r["epsilon_ledger"]
        assert math.isfinite(eps) and 7.9 < eps <= 8.0
        lbs = (
            [r["epsilon_lb"], r["epsilon_lb_fdp"]]
            if r["level"] == "sample"
            else [r["certified_all_iterates"], r["certified_fdp_all_iterates"]]
        )
        assert all(0 <= lb <= eps for lb in lbs), lbs
        assert "empirical_exceeds_claim" not in r["findings"]
    assert rows[1]["estimate"] > 0  # the Gaussian-fit estimate, reported beside the bounds
    table = (out / "table.md").read_text()
    assert table.count("| fedavg | ") == 2 and "not a bound" in table
    # a refusal is a row with its reason, not a crash
    assert "refused: x" in AM.table([{**rows[0], "refused": "x"}])


def test_bad_arguments_exit_2(tmp_path):
    assert AM.main(["--methods", "nope", "--out", str(tmp_path)]) == 2
    assert AM.main(["--eps", "0", "--out", str(tmp_path)]) == 2
