"""`fedlora audit --key`: replaying a run from its noise key verifies what an audit without
the key can only take on trust; seeded noise is reported as reproducible.

Tiny runs (tiny-bert / synthetic, DP sample level, 1–2 rounds, a second on one core),
replayed on the CPU: the tests that train alike share one training (a module fixture) and
each reads, edits and replays its own copy of it.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from audit.bundle.audit import CUDA_RTOL, TAMPER_CODES, audit_run, compare_adapters
from audit.bundle.replay import trained_device
from fl.privacy.ledger import Ledger
from pipeline.cli import main

TRUSTED_WITHOUT_KEY = {
    "config",
    "privacy.noise_multiplier",
    "privacy.delta",
    "privacy.ledger.events",
    "privacy.sampling",
    "privacy.sample_rates",
    "privacy.client_sampling",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One training per configuration for the whole module (tests that train alike share
    it); each test gets its own copy to read, edit or replay. Two local steps, not TINY's
    four: what a replay verifies (bit for bit, or an edit found) does not depend on the
    number of steps, and each replay retrains the whole run."""
    from fl.run.engine import train
    from fl.testing import tiny_config

    root, done = tmp_path_factory.mktemp("trained"), {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in done:
            done[key] = root / f"run{len(done)}"
            train(
                tiny_config(**{"dp_level": "sample", "local_steps": 2, **kw}), done[key], quiet=True
            )
        return done[key]

    return get


def _train(tmp_path, trained, name="run", **kw):
    """A copy under ``tmp_path`` of the module's training with ``kw``."""
    out = tmp_path / name
    shutil.copytree(trained(**kw), out)
    return out


def _read(path):
    return json.loads(path.read_text())


def _write(path, doc):
    path.write_text(json.dumps(doc, indent=2))


def codes(res):
    return {f["code"] for f in res["findings"]}


def _consistent_metrics_and_no_seal(d, m):
    """The rest of a consistent edit: ε per round in metrics.jsonl recomputed from the
    edited ledger, and the manifest's seal (file hashes, MAC) removed, since its MAC cannot
    be remade without the key (an unsealed manifest is a warning without the key)."""
    led = Ledger.from_state_dict(m["privacy"]["ledger"])
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        part = [e for e in led.events if e.round < r["round"]]
        r["epsilon"] = Ledger(level=led.level, delta=led.delta, events=part).epsilon("pld")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m.pop("integrity", None)


def _edit_sigma(d, sigma, bundle):
    """What an attacker does to raise the stated σ consistently: the config, the privacy
    block, every ledger event, ε recomputed from the edited ledger, and every copy the
    audit compares (ledger.json, config.json); the adapter and splits are untouched, so
    their hashes still match."""
    m = _read(d / "manifest.json")
    m["config"]["noise_multiplier"] = sigma
    m["privacy"]["noise_multiplier"] = sigma
    per = m["privacy"].get("client_noise_multipliers") or {}
    m["privacy"]["client_noise_multipliers"] = {c: sigma for c in per}
    for e in m["privacy"]["ledger"]["events"]:
        e["noise_multiplier"] = sigma
    led = Ledger.from_state_dict(m["privacy"]["ledger"])
    m["privacy"]["epsilon"] = {"pld": led.epsilon("pld"), "rdp": led.epsilon("rdp")}
    _consistent_metrics_and_no_seal(d, m)
    _write(d / "manifest.json", m)
    if not bundle:
        cfg = _read(d / "config.json")
        cfg["noise_multiplier"] = sigma
        _write(d / "config.json", cfg)
        _write(d / "ledger.json", m["privacy"]["ledger"])
    return m


# The key's tests share one one-round training (a replay retrains the whole run, twice in
# the first test: JSON and text); a two-round run's replay, the trajectory carried from round
# to round, is verified in test_a_run_with_a_round_rerun_after_a_stop_is_verified.
def test_honest_run_is_verified_by_replay(tmp_path, trained, capsys):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    plain = audit_run(run)
    assert plain["kind"] == "run" and plain["skipped"] == [] and plain["replay"] is None
    assert TRUSTED_WITHOUT_KEY <= set(plain["trusted"]) and plain["trusted_note"]

    key = run / "private" / "noise.key"
    assert main(["audit", str(run), "--key", str(key), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert "retraining the whole run" in cap.err  # the announcement, on stderr
    rep = doc["replay"]
    assert rep["verified"] is True and rep["exact"] is True
    assert rep["max_abs_diff"] == 0.0 and rep["seconds"] > 0
    assert rep["privacy_fields_differing"] == []
    assert doc["findings"] == [] and doc["trusted"] == [] and doc["tampered"] is False
    # the text form says so in one line
    assert main(["audit", str(run), "--key", str(key)]) == 0
    assert "replay: verified bit for bit" in capsys.readouterr().out


def test_consistently_edited_run_needs_the_key(tmp_path, trained):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    before = _read(run / "manifest.json")["privacy"]["epsilon"]["pld"]
    m = _edit_sigma(run, 30.0, bundle=False)
    assert m["privacy"]["epsilon"]["pld"] < before / 5  # the edit claims far more privacy

    res = audit_run(run)  # without the key the edit cannot be seen...
    assert not res["tampered"] and not res["understated"]
    assert not [f for f in res["findings"] if f["severity"] == "error"], res["findings"]
    assert res["claimed_epsilon"] == pytest.approx(m["privacy"]["epsilon"]["pld"])
    assert TRUSTED_WITHOUT_KEY <= set(res["trusted"])  # ...and the audit says so

    res = audit_run(run, key=run / "private" / "noise.key")
    assert "replay_mismatch" in codes(res) and "replay_mismatch" in TAMPER_CODES
    assert res["tampered"] and res["replay"]["verified"] is False
    assert res["replay"]["max_abs_diff"] > 0 and res["trusted"] == []
    msg = next(f["message"] for f in res["findings"] if f["code"] == "replay_mismatch")
    assert res["replay"]["worst_tensor"] in msg


def test_consistently_edited_bundle_needs_the_key(tmp_path, trained, capsys):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    bundle = tmp_path / "published"
    shutil.copytree(run / "release", bundle)
    _edit_sigma(bundle, 30.0, bundle=True)

    res = audit_run(bundle)
    assert res["kind"] == "bundle" and not res["tampered"] and not res["understated"]
    assert not [f for f in res["findings"] if f["severity"] == "error"], res["findings"]
    assert {"splits_hash", "ledger_file", "config_file"} <= {s["check"] for s in res["skipped"]}
    assert all(s["reason"] for s in res["skipped"])
    assert TRUSTED_WITHOUT_KEY <= set(res["trusted"])
    assert main(["audit", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "skipped: splits_hash" in out and "taken on trust (no --key)" in out

    rc = main(["audit", str(bundle), "--key", str(run / "private" / "noise.key"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and "replay_mismatch" in codes(doc) and doc["tampered"]
    assert doc["replay"]["verified"] is False and doc["replay"]["config_source"].startswith(
        "the manifest"
    )


def test_honest_bundle_is_verified_and_privacy_fields_are_compared(tmp_path, trained):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    key = run / "private" / "noise.key"
    res = audit_run(run / "release", key=key)
    assert res["replay"]["verified"] and res["findings"] == [] and res["trusted"] == []

    # δ does not change the adapter (σ is given directly), only the accounting: the
    # adapter replays bit for bit and the privacy block comparison catches the edit.
    bundle = tmp_path / "b"
    shutil.copytree(run / "release", bundle)
    m = _read(bundle / "manifest.json")
    m["privacy"]["delta"] = m["privacy"]["ledger"]["delta"] = 1e-3
    led = Ledger.from_state_dict(m["privacy"]["ledger"])
    m["privacy"]["epsilon"] = {"pld": led.epsilon("pld"), "rdp": led.epsilon("rdp")}
    _consistent_metrics_and_no_seal(bundle, m)
    _write(bundle / "manifest.json", m)
    assert not audit_run(bundle)["tampered"]
    res = audit_run(bundle, key=key)
    assert res["replay"]["exact"] and not res["replay"]["verified"]
    assert "privacy.delta" in res["replay"]["privacy_fields_differing"]
    msg = next(f["message"] for f in res["findings"] if f["code"] == "replay_mismatch")
    assert "privacy.delta (audited 0.001, replay 1e-05)" in msg


def test_honest_client_level_bundle_is_verified(tmp_path, trained):
    """A client-level bundle publishes no per-client steps: the replay is compared with the
    public manifest it would have released, not the operator's."""
    run = _train(tmp_path, trained, dp_level="client", noise_multiplier=1.0, rounds=1)
    assert _read(run / "release" / "manifest.json")["privacy"]["steps_per_round"] == {}
    res = audit_run(run / "release", key=run / "private" / "noise.key")
    assert res["replay"]["verified"] and res["findings"] == []
    assert res["replay"]["privacy_fields_differing"] == []


def test_wrong_key_is_key_mismatch(tmp_path, trained, capsys):
    from fl.privacy.rng import NoiseKey

    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    (tmp_path / "other").mkdir()
    other = NoiseKey.generate().write(tmp_path / "other")
    res = audit_run(run, key=other)
    assert "key_mismatch" in codes(res) and "key_mismatch" not in TAMPER_CODES
    assert res["replay"] == {"performed": False, "verified": False, "reason": "key_mismatch"}
    assert TRUSTED_WITHOUT_KEY <= set(res["trusted"])  # nothing was verified
    assert main(["audit", str(run / "release"), "--key", str(other)]) == 1
    assert "key_mismatch" in capsys.readouterr().out
    # not a key file at all: one line, exit 2
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    assert main(["audit", str(run), "--key", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error:") and err.count("\n") == 1


def test_seeded_noise_is_reproducible(tmp_path, trained, capsys):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1,
                 insecure_deterministic_noise=True)  # fmt: skip
    for d in (run, run / "release"):
        res = audit_run(d)
        f = next(f for f in res["findings"] if f["code"] == "noise_reproducible")
        assert f["severity"] == "error" and "seed" in f["message"] and "subtract" in f["message"]
        assert "noise_reproducible" not in TAMPER_CODES and not res["tampered"]
    assert main(["audit", str(run)]) == 1
    capsys.readouterr()
    # there is no key to replay with: a usage error, not a finding
    assert main(["audit", str(run), "--key", str(tmp_path / "any.key")]) == 2
    assert "not drawn from a key" in capsys.readouterr().err


def test_runs_before_keyed_noise_are_reproducible(tmp_path, trained):
    run = _train(tmp_path, trained, noise_multiplier=3.0, rounds=1)
    assert "noise_reproducible" not in codes(audit_run(run))
    for d in (run, run / "release"):  # a run made before keyed noise has no noise block
        m = _read(d / "manifest.json")
        del m["privacy"]["noise"]
        _write(d / "manifest.json", m)
        res = audit_run(d)
        f = next(f for f in res["findings"] if f["code"] == "noise_reproducible")
        assert "before" in f["message"] and not res["tampered"]


def test_compare_adapters_exact_and_tolerance(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"x.lora_A.weight": torch.randn(4, 8, generator=g), "head": torch.randn(2, 8, generator=g)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({k: v.clone() for k, v in a.items()}, str(tmp_path / "same.safetensors"))
    near = {k: v.clone() for k, v in a.items()}
    near["head"][0, 0] += 1e-6 * a["head"].abs().max()
    save_file(near, str(tmp_path / "near.safetensors"))
    far = {k: v.clone() for k, v in a.items()}
    far["x.lora_A.weight"][1, 2] += 0.1
    save_file(far, str(tmp_path / "far.safetensors"))
    save_file({"other": a["head"]}, str(tmp_path / "names.safetensors"))

    same = compare_adapters(tmp_path / "a.safetensors", tmp_path / "same.safetensors")
    assert same["equal"] and same["max_abs_diff"] == 0.0 and same["worst_tensor"] is None
    n = compare_adapters(tmp_path / "a.safetensors", tmp_path / "near.safetensors", CUDA_RTOL)
    assert not n["equal"] and n["within_tolerance"] and n["worst_tensor"] == "head"
    f = compare_adapters(tmp_path / "a.safetensors", tmp_path / "far.safetensors", CUDA_RTOL)
    assert not f["within_tolerance"] and f["worst_tensor"] == "x.lora_A.weight"
    assert f["max_abs_diff"] == pytest.approx(0.1, rel=1e-5)
    d = compare_adapters(tmp_path / "a.safetensors", tmp_path / "names.safetensors", CUDA_RTOL)
    assert not d["equal"] and not d["within_tolerance"] and "names differ" in d["problem"]


def test_trained_device(tmp_path):
    m = {"config": {"device": "cuda"}}
    assert trained_device(tmp_path, m, bundle=True)[0] == "cuda"
    assert trained_device(tmp_path, {"config": {"device": "cpu"}}, bundle=True)[0] == "cpu"
    assert trained_device(tmp_path, {"config": {"device": "auto"}}, bundle=True)[0] == "unknown"
    # a run directory: the engine's start line in run.log says where it actually ran
    (tmp_path / "run.log").write_text("fedlora train: method=fedavg dp=sample device=cuda:0\n")
    assert trained_device(tmp_path, {"config": {"device": "auto"}}, bundle=False)[0] == "cuda"


def test_a_run_with_a_round_rerun_after_a_stop_is_verified(tmp_path, tiny_cfg, monkeypatch):
    """Round 2 stopped midway and re-run (not bit-exactly: another thread count) as attempt
    1 with fresh streams and a charge: the replay re-runs it as attempt 1 too, with the
    charge at the same place in the ledger, and verifies the run."""
    from fl.run.contexts import ClientContext
    from fl.run.engine import Engine, train

    # two local steps (TINY's four add nothing to the stop, the journal or the replay)
    cfg = tiny_cfg(dp_level="sample", noise_multiplier=2.0, rounds=2, local_steps=2)
    real = ClientContext.train

    def die_in_round_two(self, *a, **kw):
        if self.round.index == 1:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(ClientContext, "train", die_in_round_two)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Engine(cfg, run, quiet=True).run()
    journal = run / "checkpoint" / "inflight.json"
    doc = _read(journal)
    doc["environment"]["threads"] += 1
    _write(journal, doc)
    monkeypatch.setattr(ClientContext, "train", real)
    man = train(cfg, run, resume=True)
    assert any(e["stage"] == "interrupted" for e in man["privacy"]["ledger"]["events"])
    key = run / "private" / "noise.key"
    for target in (run, run / "release"):
        res = audit_run(target, key=key)
        assert res["replay"]["verified"] and res["replay"]["exact"], target
        # the re-run round's charge: more steps than one call per round, included in ε
        assert codes(res) == {"ledger_extra_events"}, (target, res["findings"])
