"""benchmarks.auditing.tightness at a tiny size: one seed on tiny-bert, M = 500 gradient canaries and
500 canary clients; the files are written and every figure is finite, each certified ε_lb at
most the ledger's ε (the targets are not asserted: they need the full size). The utility
pairing and the ideal-mechanism simulation on small inputs."""

from __future__ import annotations

import json
import math

from benchmarks.auditing.tightness import main
from benchmarks.auditing.tightness_tables import ideal, utility_summary


def test_tightness_tiny(tmp_path, capsys):
    out = tmp_path / "tightness"
    rc = main(
        [
            "--seeds", "1",
            "--datasets", "tiny",
            "--settings", "eps8_util,client3",
            "--canaries", "500",
            "--canary-clients", "500",
            "--utility-seeds", "0",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()
    assert "tiny | eps8_util" in table and "tiny | client3" in table
    runs = [r for r in doc["runs"] if r.get("audit_s") is not None]
    assert {r["setting"] for r in runs} == {"eps8_util", "client3"}
    for r in runs:
        eps = r["epsilon_ledger"]
        assert math.isfinite(eps) and eps > 0
        if r["setting"] == "eps8_util":
            assert r["canaries"] == 500
            lbs = [r["epsilon_lb"], r["epsilon_lb_fdp"]]
        else:
            assert r["canary_clients"] == 500
            lbs = [r["epsilon_lb"], r["certified_all_iterates"], r["certified_fdp_all_iterates"]]
            assert math.isfinite(r["estimate"]) and r["estimate"] >= 0
            lo, hi = r["estimate_interval"]
            assert lo <= r["estimate"] <= hi
        for lb in lbs:
            assert math.isfinite(lb) and 0 <= lb <= eps, (r["setting"], lb, eps)
    s = doc["summary"]
    assert set(s) == {"tiny @ eps8_util", "tiny @ client3"}
    assert s["tiny @ client3"]["met"] in (True, False)
    assert doc["utility"] == {}
    assert "tiny | eps8_util | 0" in capsys.readouterr().out


def test_utility_pairs_seeds_and_ideal_is_below_the_ledger():
    rows = [
        {"dataset": "d", "setting": "eps8_util", "seed": 0, "canaries": 5, "accuracy": 0.7},
        {"dataset": "d", "setting": "eps8_util", "seed": 0, "canaries": 0, "accuracy": 0.6},
        {"dataset": "d", "setting": "eps8_util", "seed": 1, "canaries": 5, "accuracy": 0.5},
    ]
    u = utility_summary(rows)["d"]
    assert u["seeds"] == [0] and abs(u["mean_diff"] - 0.1) < 1e-12
    r = ideal(2, cases=((4.0, 400),))["eps4_m400"]
    assert 0.9 < r["mu"] < 0.95 and r["n"] == 2
    assert 0 <= r["steinke"]["max"] <= 4 and 0 <= r["fdp"]["max"] <= 4
    assert 0 <= r["p_median5_fdp_ge_3.5"] <= 1
