"""Per-client σ at sample level, the DP linear probe, the manifest's model block and the
non-member validation metrics (tiny runs)."""

from __future__ import annotations

import json

import pytest

from fl.privacy.accounting import calibrate_noise, epsilon_of_events
from fl.privacy.ledger import Ledger
from fl.run.engine import train
from fl.testing import tiny_config


@pytest.fixture(scope="module")
def skewed_run(tmp_path_factory):
    """Dirichlet(0.3) clients of different sizes, ε = 2: each gets its own σ_k (ε = 2,
    not 4: σ_k ≈ 1.3-5.6 rather than 0.9-3.1, whose PLDs, built at every calibration step
    and budget check, are several times smaller; nothing here depends on the target)."""
    out = tmp_path_factory.mktemp("skew") / "run"
    cfg = tiny_config(
        partition="dirichlet",
        dirichlet_alpha=0.3,
        clients=4,
        members=300,
        epsilon=2.0,
        insecure_deterministic_noise=True,
    )
    man = train(cfg, out, quiet=True)
    return cfg, man, out


def test_each_client_is_calibrated_to_its_own_rate(skewed_run):
    cfg, man, _ = skewed_run
    p = man["privacy"]
    assert p["level"] == "sample"
    sizes = p["client_sizes"]
    assert len(set(sizes.values())) > 1  # the partition is skewed
    sig = p["client_noise_multipliers"]
    assert set(sig) == set(sizes)
    for c, n in sizes.items():
        q = min(1.0, cfg.batch_size / n)
        want = calibrate_noise(cfg.epsilon, q, cfg.local_steps * cfg.rounds, p["delta"], "pld")
        assert sig[c] == pytest.approx(want, rel=1e-9)
    # a larger client (smaller q) needs less noise for the same ε
    small, large = min(sizes, key=sizes.get), max(sizes, key=sizes.get)
    assert sig[small] > sig[large]
    assert p["noise_multiplier"] == pytest.approx(max(sig.values()))


def test_every_client_meets_the_target_and_the_report_is_the_maximum(skewed_run):
    cfg, man, _ = skewed_run
    p = man["privacy"]
    ledger = Ledger.from_state_dict(p["ledger"])
    per_unit = {}
    for e in ledger.events:
        per_unit.setdefault(e.unit, []).append(e)
    eps = {u: epsilon_of_events(evs, p["delta"]) for u, evs in per_unit.items()}
    assert len(eps) == cfg.clients
    assert max(eps.values()) <= cfg.epsilon + 1e-6
    assert min(eps.values()) >= cfg.epsilon - 0.05  # each one spends (about) its budget
    assert p["epsilon"]["pld"] == pytest.approx(max(eps.values()), rel=1e-6)
    for u, evs in per_unit.items():
        cid = u.split(":", 1)[1]
        assert {e.noise_multiplier for e in evs} == {p["client_noise_multipliers"][cid]}


def test_probe_trains_the_head_only_and_caches_features(tmp_path):
    out = tmp_path / "probe"
    man = train(
        # ε = 2, not 8: the head learns under either (its σ ≈ 1.6, not 0.74, has a
        # smaller PLD to calibrate and check); ε is not what this test is about
        tiny_config(method="probe", epsilon=2.0, eval_nonmembers=True, rounds=2),
        out,
        quiet=True,
    )
    block = man["model"]
    assert block["frozen_prefix_layers"] == 2 and block["prefix_cache"] is True
    assert block["pooling"] == "cls" and block["head_init"] == "random"  # tiny_config's
    final = man["metrics"]["final"]
    assert 0.0 <= final["val_accuracy"] <= 1.0 and "val_balanced_accuracy" in final
    from safetensors.torch import load_file

    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = [v for k, v in tensors.items() if "lora_B" in k]
    head = [v for k, v in tensors.items() if "classifier" in k]
    assert b and all(float(t.abs().max()) == 0.0 for t in b)  # the encoder is unchanged
    assert head and any(float(t.abs().max()) > 0.0 for t in head)  # the head learned
    public = json.loads((out / "release" / "manifest.json").read_text())
    assert public["model"] == block
    assert "client_noise_multipliers" in public["privacy"]


def test_top_layer_lora_with_and_without_cache_agree(tmp_path):
    """The same run with the prefix cache on and off gives the same model (float
    rounding aside)."""
    import torch
    from safetensors.torch import load_file

    states = []
    for cache in (True, False):
        out = tmp_path / f"c{cache}"
        man = train(
            tiny_config(lora_layers=1, prefix_cache=cache, head_lr=0.05, rounds=1),
            out,
            quiet=True,
        )
        assert man["model"]["frozen_prefix_layers"] == 1
        assert man["model"]["prefix_cache"] is cache
        states.append(load_file(str(out / "adapter" / "adapter_model.safetensors")))
    a, b = states
    assert a.keys() == b.keys()
    assert not any(".layer.0." in k and "lora" in k for k in a)  # LoRA on the top layer only
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), k


def test_audit_accepts_per_client_sigma_and_catches_a_changed_one(skewed_run, tmp_path):
    import shutil

    from audit.bundle.audit import audit_run

    _, man, out = skewed_run
    res = audit_run(out)
    errors = [f for f in res["findings"] if f["severity"] == "error"]
    # the fixture uses seeded noise (fast and reproducible), which the audit reports
    assert [f["code"] for f in errors] == ["noise_reproducible"], errors
    assert res["recomputed"]["config"]["pld"] == pytest.approx(man["privacy"]["epsilon"]["pld"])
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    sig = doc["privacy"]["client_noise_multipliers"]
    big = max(sig, key=sig.get)
    sig[big] *= 2  # more noise stated for one client than its events carry
    doc["privacy"]["noise_multiplier"] = max(sig.values())
    (copy / "manifest.json").write_text(json.dumps(doc))
    res = audit_run(copy)
    assert "sigma_mismatch" in {f["code"] for f in res["findings"]}


def test_a_cached_prefix_run_replays_bit_for_bit(tmp_path):
    """The audit's replay (same key, same config) rebuilds the prefix cache the same way:
    the released adapter is reproduced exactly."""
    from audit.bundle.audit import audit_run

    out = tmp_path / "run"
    man = train(
        tiny_config(lora_layers=1, noise_multiplier=1.0, pooling="mean", rounds=1),
        out,
        quiet=True,
    )
    assert man["model"]["prefix_cache"] is True and man["model"]["frozen_prefix_layers"] == 1
    res = audit_run(out, key=out / "private" / "noise.key")
    assert res["replay"]["verified"] is True and res["replay"]["exact"] is True
