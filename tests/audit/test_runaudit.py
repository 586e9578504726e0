"""Auditing a run directory: recomputed ε, tampering, the one-run canary bound, CLI codes.

One tiny DP run (tiny-bert / synthetic, sample level, σ = 1, with canaries) is trained once
per module; each tampering test edits a copy of it.
"""

import json
import math
import shutil

import numpy as np
import pytest

from audit.bundle.audit import audit_run
from audit.bundle.one_run import canary_scores
from fl.errors import UsageError
from fl.privacy.accounting import epsilon


def _cfg(**kw):
    # module-scoped fixtures cannot use the tiny_cfg fixture: the same shared settings
    from fl.testing import tiny_config

    return tiny_config(**kw)


# σ 3, not 1: the run's and the audit's recomputed PLDs at σ 1 were most of this file's time;
# the checks (ε recomputed = an independent PLD at the same σ, edits flagged, one-run bound
# below the ledger's ε) hold at any σ
SIGMA = 3.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from fl.run.engine import train

    out = tmp_path_factory.mktemp("runs") / "dp"
    train(_cfg(dp_level="sample", noise_multiplier=SIGMA, canaries=20), out, quiet=True)
    return out


@pytest.fixture
def copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _edit_json(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def codes(res):
    return {f["code"] for f in res["findings"]}


def test_clean_run_passes(run):
    res = audit_run(run)
    m = json.loads((run / "manifest.json").read_text())
    splits = json.loads((run / "splits.json").read_text())
    # independent reference: every client took part in both rounds; q = B / n_c with
    # n_c its members before the (secret) canaries were added
    sizes = [sum(not i.startswith("canary:") for i in ids) for ids in splits["clients"].values()]
    assert sum(sizes) == len(splits["members"])
    refs = [epsilon(SIGMA, min(1.0, 16 / n), 4 * 2, m["privacy"]["delta"]) for n in sizes]
    assert res["epsilon_pld"] == pytest.approx(max(refs), rel=1e-9)
    assert res["recomputed"]["ledger"]["pld"] == pytest.approx(max(refs), rel=1e-9)
    assert res["recomputed"]["config"]["pld"] == pytest.approx(max(refs), rel=1e-9)
    assert res["claimed_epsilon"] == pytest.approx(m["privacy"]["epsilon"]["pld"])
    assert not res["understated"] and not res["tampered"]
    assert not [f for f in res["findings"] if f["severity"] == "error"]
    assert res["method"] == "fedavg" and res["level"] == "sample" and res["run_dir"] == str(run)


def test_understated_epsilon(copy):
    def lower(d):
        d["privacy"]["epsilon"]["pld"] *= 0.9

    _edit_json(copy / "manifest.json", lower)
    res = audit_run(copy)
    assert res["understated"] and "epsilon_understated" in codes(res)
    assert res["ratio"] == pytest.approx(1 / 0.9, rel=1e-6)
    # 0.5% lower is within the 1% tolerance
    _edit_json(copy / "manifest.json", lambda d: d["privacy"]["epsilon"].update(
        pld=d["privacy"]["epsilon"]["pld"] / 0.9 * 0.995))  # fmt: skip
    assert not audit_run(copy)["understated"]


def test_adapter_byte_flip(copy):
    p = copy / "adapter" / "adapter_model.safetensors"
    b = bytearray(p.read_bytes())
    b[-1] ^= 0x01
    p.write_bytes(bytes(b))
    res = audit_run(copy)
    assert res["tampered"] and "adapter_hash_mismatch" in codes(res)


def test_splits_and_ledger_file_tampering(copy):
    _edit_json(copy / "splits.json", lambda d: d["members"].pop())
    _edit_json(copy / "ledger.json", lambda d: d["events"].pop())
    res = audit_run(copy)
    assert {"splits_hash_mismatch", "ledger_file_mismatch"} <= codes(res) and res["tampered"]


def test_sigma_zero(copy):
    _edit_json(copy / "manifest.json", lambda d: d["privacy"].update(noise_multiplier=0.0))
    res = audit_run(copy)
    assert "noise_not_applied" in codes(res) and res["tampered"]
    assert math.isinf(res["recomputed"]["config"]["pld"]) and res["understated"]


def test_ledger_incomplete(copy):
    def drop(d):
        d["privacy"]["ledger"]["events"].pop()

    _edit_json(copy / "manifest.json", drop)
    _edit_json(copy / "ledger.json", lambda d: d["events"].pop())
    res = audit_run(copy)
    assert "ledger_incomplete" in codes(res) and res["tampered"]
    assert "ledger_file_mismatch" not in codes(res)


def test_ledger_delta_raised_is_caught_and_not_used(copy, run):
    """A larger δ in the ledger would lower the ledger's ε: the audit names the mismatch
    and recomputes the ledger at the smaller δ (the clean run's ε)."""
    clean = audit_run(run)

    def raise_delta(ledger):
        ledger["delta"] = ledger["delta"] * 100

    _edit_json(copy / "manifest.json", lambda d: raise_delta(d["privacy"]["ledger"]))
    _edit_json(copy / "ledger.json", raise_delta)
    res = audit_run(copy)
    assert "delta_mismatch" in codes(res) and res["tampered"]
    for a in ("pld", "rdp"):
        assert res["recomputed"]["ledger"][a] == pytest.approx(
            clean["recomputed"]["ledger"][a], rel=1e-12
        )


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["privacy"].pop("delta"), "delta"),
        (lambda d: d["privacy"].update(ledger={"version": 1, "level": "sample"}), "ledger"),
        (lambda d: d["config"].update(batch_size="16"), "batch_size"),
    ],
)
def test_bad_manifest(copy, edit, match):
    _edit_json(copy / "manifest.json", edit)
    with pytest.raises(UsageError, match=match):
        audit_run(copy)


def test_not_a_run(tmp_path):
    with pytest.raises(UsageError, match="manifest.json"):
        audit_run(tmp_path)


@pytest.mark.parametrize("loader", ["attacks.signals", "own"])
def test_canary_scores_reproduce_released_model(run, loader, monkeypatch):
    """−mean score on the test split must equal the run's final test loss (both loaders:
    attacks.signals when present, the private fallback when it is not importable)."""
    import sys

    from fl.data.datasets import load_dataset

    if loader == "own":
        monkeypatch.setitem(sys.modules, "attacks.signals", None)  # import -> ImportError

    m = json.loads((run / "manifest.json").read_text())
    splits = json.loads((run / "splits.json").read_text())
    ds = load_dataset("synthetic")
    pos = {i: k for k, i in enumerate(ds.ids)}
    idx = [pos[i] for i in splits["test"]]
    s = canary_scores(run, [ds.texts[i] for i in idx], [int(ds.labels[i]) for i in idx])
    assert s.shape == (len(idx),) and np.all(s <= 0)
    assert -s.mean() == pytest.approx(m["metrics"]["final"]["loss"], rel=1e-4)


def test_one_run_cli(run, capsys):
    from pipeline.cli import main

    assert main(["audit", str(run), "--one-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    one = doc["one_run"]
    assert {"epsilon_lb", "m", "r", "v", "alpha", "delta"} <= set(one)
    assert one["m"] == 20 and math.isfinite(one["epsilon_lb"]) and one["epsilon_lb"] >= 0
    assert one["epsilon_lb"] <= doc["epsilon_pld"]
    # the same figures from splits.json's canaries scored here: the scores and the
    # included flags are aligned canary by canary (a mix-up would change r, v or k)
    from audit.bounds.one_run import epsilon_one_run

    canaries = json.loads((run / "splits.json").read_text())["canaries"]
    s = canary_scores(run, [c["text"] for c in canaries], [int(c["label"]) for c in canaries])
    inc = np.array([bool(c["included"]) for c in canaries])
    ref = epsilon_one_run(s, inc, one["delta"], alpha=one["alpha"])
    assert one["n_included"] == int(inc.sum())
    for k in ("epsilon_lb", "r", "v", "k_pos", "k_neg"):
        assert one[k] == pytest.approx(ref[k], rel=1e-12), k
    # and they are not what swapped flags give, unless the guesses happen to agree
    flipped = epsilon_one_run(s, ~inc, one["delta"], alpha=one["alpha"])
    assert (flipped["r"], flipped["v"]) != (one["r"], one["v"]) or one["v"] * 2 == one["r"]


def test_cli_exit_codes(run, copy, capsys, tmp_path):
    from pipeline.cli import main

    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "recomputed ε (PLD)" in out and "findings: none" in out
    _edit_json(copy / "manifest.json", lambda d: d["privacy"]["epsilon"].update(pld=0.1))
    assert main(["audit", str(copy), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["understated"] is True
    assert main(["audit", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error:") and err.count("\n") == 1


def test_client_level_run(tmp_path):
    from fl.run.engine import train

    out = tmp_path / "cl"
    cfg = _cfg(
        dp_level="client", noise_multiplier=SIGMA, clients=4, clients_per_round=2,
        client_sampling="poisson", rounds=3, local_steps=2, delta=1e-3,
    )  # fmt: skip
    m = train(cfg, out, quiet=True)
    res = audit_run(out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # every round releases (an empty cohort too: pure noise), so all rounds compose
    ref = epsilon(SIGMA, 0.5, len(rows), m["privacy"]["delta"])
    assert res["epsilon_pld"] == pytest.approx(ref, rel=1e-9)
    assert not res["understated"] and not res["tampered"]


def test_one_run_claim_check_at_client_level_allows_replace_one_client():
    """A canary changes one client's data: under client-level (add/remove-one-client) DP at
    ε that is (2ε, (1 + e^ε)δ) by group privacy, so a bound between ε and 2ε is no leak;
    at sample level the same bound exceeds the claim."""
    from audit.bounds.fdp import fdp_one_run_bound
    from audit.bounds.one_run import epsilon_one_run
    from audit.bundle.one_run import claim_check

    rng = np.random.default_rng(0)
    inc = rng.random(1000) < 0.5
    scores = inc + rng.normal(size=1000) * 0.01  # perfectly separated canaries
    res = epsilon_one_run(scores, inc, 1e-5, alpha=0.05)
    assert 4.0 < res["epsilon_lb"]  # ≈ 4.57 with 1000 canaries
    sample = claim_check({"privacy": {"level": "sample"}}, scores, inc, 1e-5, 0.05, 2.3, res)
    assert sample["exceeds"] and sample["epsilon"] == 2.3
    client = claim_check({"privacy": {"level": "client"}}, scores, inc, 1e-5, 0.05, 2.3, res)
    assert client["epsilon"] == 4.6 and client["delta"] == pytest.approx((1 + math.e**2.3) * 1e-5)
    # the claim is tested with the larger of the two certified bounds, each at α/2
    d2 = client["delta"]
    want = max(
        epsilon_one_run(scores, inc, d2, alpha=0.025)["epsilon_lb"],
        fdp_one_run_bound(scores, inc, d2, alpha=0.025, family="dp")["epsilon_lb"],
    )
    assert client["epsilon_lb"] == pytest.approx(want) and 2.3 < want < 4.6
    assert not client["exceeds"]  # between ε and 2ε: allowed for one canary
    tight = claim_check({"privacy": {"level": "client"}}, scores, inc, 1e-5, 0.05, 1.0, res)
    assert tight["exceeds"] and tight["epsilon"] == 2.0  # above 2ε: a leak
