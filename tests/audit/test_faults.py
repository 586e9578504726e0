"""Planted faults (``--inject-fault``, tests only: auditing the auditor; docs/audit.md
"Planted faults"): each fault does what it says at its code path, a faulted run is never
released, the audit never reads the fault, and the one-run audit of the white-box gradient
canaries flags a blatant fault and not the same run without it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl.errors import UsageError
from fl.privacy import gradient_canaries as G
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, StepFault, clip_and_noise, server_noise_fault
from fl.run.batches import fixed_batches
from fl.run.config import parse_fault
from fl.run.trainer import LocalTrainer
from fl.testing import tiny_config

SHAPES = ((4, 5), (7,))  # "factors/l/A" (20 coordinates), "head/b" (7)
NAMES = ["factors/l/A", "head/b"]


def _params(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in SHAPES:
        p = torch.nn.Parameter(torch.zeros(s))
        p.grad_sample = torch.randn((n, *s), generator=g) * 2
        out.append(p)
    return out


def _step(sigma, fault=None, canaries=None, batch=6, clip=1.5, seed=0, src=None):
    params = _params(seed)
    dp = DpSgdParams(sigma, clip, 1.0, 1.0)  # expected batch 1: .grad = the privatized sum
    src = src or R.SeededSource(7, ("dpsgd-noise", 0, "0", "train"))
    clip_and_noise(params, dp, src, batch, None, canaries, fault)
    return torch.cat([p.grad.reshape(-1) for p in params])


def _canary(flat, clip=1.5):
    return G.ClientCanaries(
        ids=np.arange(len(flat)),
        flat=torch.as_tensor(flat, dtype=torch.long),
        included=np.ones(len(flat), dtype=bool),
        coins=[np.ones(len(flat), dtype=bool)] * 4,
        clip=clip,
        meta={},
    )


# ------------------------------------------------------- each fault at its code path


def test_noise_scale_multiplies_the_noise_and_nothing_else():
    data = _step(0.0)
    honest = _step(2.0) - data
    scaled = _step(2.0, StepFault(noise_scale=0.25)) - data
    torch.testing.assert_close(scaled, 0.25 * honest)
    assert float(scaled.std()) == pytest.approx(0.25 * float(honest.std()), rel=1e-5)


def test_no_clip_lets_the_raw_gradients_and_a_kc_canary_through():
    C = 1.5
    params = _params()
    raw = torch.cat([p.grad_sample.reshape(6, -1) for p in params], 1).sum(0)
    assert torch.allclose(_step(0.0, StepFault(no_clip=True)), raw, atol=1e-5)
    assert not torch.allclose(_step(0.0), raw, atol=1e-3)  # the correct step clips
    # a canary enters as a per-example gradient K·C·e_j: clipped to exactly C, or K·C
    good = _step(0.0, canaries=_canary([3], C)) - _step(0.0)
    assert good[3].item() == pytest.approx(C, abs=1e-5)
    bad = _step(0.0, StepFault(no_clip=True), _canary([3], C)) - _step(0.0, StepFault(no_clip=True))
    assert bad[3].item() == pytest.approx(G.PRE_CLIP * C, rel=1e-5)


def test_canary_clip_gives_exactly_c_bit_for_bit():
    for C in (1.0, 1.5, 0.3, 7.77):
        summed = torch.zeros(10)
        _canary([2, 5], C).contribute(summed)
        assert torch.equal(summed[[2, 5]], torch.full((2,), C))  # the colleague's C·e_j


def test_head_unnoised_leaves_the_heads_sum_noiseless():
    unnoised = torch.tensor([False] * 20 + [True] * 7)
    data, noisy = _step(0.0), _step(3.0)
    got = _step(3.0, StepFault(unnoised=unnoised))
    assert torch.equal(got[20:], data[20:])  # the head: the clipped sum, no noise
    assert torch.equal(got[:20], noisy[:20])  # the rest: the same noise as the correct step


def test_trainer_plants_each_fault_on_its_group():
    from fl.run.local_step import DpSgd

    params = _params()

    def plant(spec):
        fake = type("T", (), {"cfg": tiny_config(noise_multiplier=1.0, inject_fault=spec)})()
        priv = DpSgd(DpSgdParams(1.0, 1.0, 1.0, 1.0), None)
        return LocalTrainer._plant_fault(fake, priv, params, NAMES), priv

    f, priv = plant("head_unnoised")
    assert priv.fault is f and f.unnoised.tolist() == [False] * 20 + [True] * 7
    f, _ = plant("factor_unnoised=A")
    assert f.unnoised.tolist() == [True] * 20 + [False] * 7
    assert plant("factor_unnoised=B")[0].unnoised.sum() == 0  # no B trained here
    assert plant("noise_scale=0.25")[0].noise_scale == 0.25
    assert plant("no_clip")[0].no_clip and plant("noise_reuse")[0].reuse
    assert plant("fixed_batches")[0] == "fixed_batches"


def test_noise_reuse_adds_one_draw_at_every_step():
    src = R.SeededSource(7, ("dpsgd-noise", 0, "0", "train"))
    fault = StepFault(reuse=True)
    a = _step(2.0, fault, batch=0, src=src)
    b = _step(2.0, fault, batch=0, src=src)
    assert torch.equal(a, b) and float(a.abs().sum()) > 0
    src = R.SeededSource(7, ("dpsgd-noise", 0, "0", "train"))
    assert not torch.equal(_step(2.0, batch=0, src=src), _step(2.0, batch=0, src=src))


def test_fixed_batches_cycle_a_secret_shuffle():
    src = R.SeededSource(3, ("poisson-batches", 0, "0", "train"))
    masks = fixed_batches(src, 10, 0.3, 8)
    assert [int(m.sum()) for m in masks] == [3, 3, 3, 1] * 2
    assert torch.equal(torch.stack(masks[:4]).sum(0), torch.ones(10, dtype=torch.long))
    assert all(torch.equal(masks[t], masks[t + 4]) for t in range(4))


def test_server_noise_faults_at_client_level():
    noise = torch.ones(5)
    cfg = tiny_config(dp_level="client", noise_multiplier=1.0, inject_fault="server_noise_omitted")
    assert torch.equal(server_noise_fault(noise, cfg), torch.zeros(5))
    cfg = tiny_config(dp_level="client", noise_multiplier=1.0, inject_fault="noise_scale=0.25")
    assert torch.equal(server_noise_fault(noise, cfg), torch.full((5,), 0.25))


def test_validation():
    ok = dict(noise_multiplier=1.0)
    for spec in ("noise_scale=0.5", "no_clip", "head_unnoised", "factor_unnoised=B"):
        tiny_config(**ok, inject_fault=spec).validate()
    bad = {
        "nope": "unknown inject_fault",
        "noise_scale": "needs a number",
        "noise_scale=1": "other than 1",
        "noise_scale=-2": "other than 1",
        "no_clip=3": "takes no value",
        "factor_unnoised=C": "'A', 'B'",
        "server_noise_omitted": "dp-level client",
        "fedask_stage2_unnoised": "no noise by design",
        "fedask_stage1_unnoised": "method fedask",
    }
    for spec, msg in bad.items():
        with pytest.raises(UsageError, match=msg):
            tiny_config(**ok, inject_fault=spec).validate()
    with pytest.raises(UsageError, match="DP training"):
        tiny_config(inject_fault="noise_scale=0.5").validate()
    assert parse_fault("factor_unnoised=A", "sample") == ("factor_unnoised", "A")


# ------------------------------------------------ release refused, audit blind to it


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    # σ = 10.5546875 is what ε = 1 calibrates to here (q = 1, 8 steps): the same runs as
    # with epsilon=1.0 (ledger ε 0.9997), without the calibration's PLDs
    base = dict(
        noise_multiplier=10.5546875,
        delta=1e-5,
        batch_size=80,
        canaries=2000,
        canary_kind="gradient",
    )
    key = R.NoiseKey(bytes(range(32)))
    out = {}
    for name, fault in (("correct", ""), ("faulted", "noise_scale=0.05")):
        d = tmp_path_factory.mktemp(name) / "run"
        m = train(tiny_config(**base, inject_fault=fault), d, quiet=True, noise_key=key)
        out[name] = (d, m, audit_run(d, one_run=True))
    return out


def _codes(res):
    return {f["code"] for f in res["findings"]}


def test_blatant_fault_is_flagged_and_the_correct_run_is_not(runs):
    _, _, ok = runs["correct"]
    _, _, bad = runs["faulted"]
    assert ok["epsilon_pld"] == pytest.approx(1.0, abs=0.02) == bad["epsilon_pld"]
    assert "empirical_exceeds_claim" not in _codes(ok)
    assert "empirical_exceeds_claim" in _codes(bad)
    assert bad["one_run"]["epsilon_lb"] > 1.0 >= ok["one_run"]["epsilon_lb"]
    noise = bad["one_run"]["observations"]["noise"]
    assert all(v["observed_over_claimed"] < 0.1 for v in noise.values())


def test_faulted_run_writes_no_release_and_export_refuses_it(runs, tmp_path, capsys):
    from pipeline.cli import main

    d, m, _ = runs["faulted"]
    assert m["injected_fault"] == "noise_scale=0.05"
    assert not (d / "release").exists()
    assert (runs["correct"][0] / "release").is_dir() and "injected_fault" not in runs["correct"][1]
    capsys.readouterr()
    assert main(["export", str(d), "--out", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err.strip()
    assert "planted privacy fault" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "bundle").exists()


def test_the_audit_never_reads_the_fault(runs, tmp_path):
    import shutil

    from audit.bundle.audit import audit_run
    from fl.run.integrity import seal
    from fl.run.release import run_key

    d, _, before = runs["faulted"]
    copy = tmp_path / "run"
    shutil.copytree(d, copy)
    mpath = copy / "manifest.json"
    man = json.loads(mpath.read_text())
    del man["injected_fault"]
    seal(man, run_key(copy, man), man["integrity"]["files"])  # the operator re-seals it
    mpath.write_text(json.dumps(man))
    after = audit_run(copy, one_run=True)
    assert after["one_run"] == before["one_run"] and _codes(after) == _codes(before)
    src = "".join(p.read_text() for p in Path("audit").rglob("*.py"))
    # (the Flower audit's inject_failures makes real clients fail: an option of the audit,
    # not a planted fault it could read)
    assert "inject_fault" not in src and "injected_fault" not in src
    assert "--inject" not in src and "fault_injector" not in src


# ------------------------------------------- the scores see a group that lost its noise


def _records(n):
    return [
        {"param": "factors/l/A" if j % 2 else "head/w", "included": bool((j // 2) % 2)}
        for j in range(n)
    ]


def _obs(recs, head_noise, q, reuse=False, T=4, sigma=10.0, seed=0):
    rng = np.random.default_rng(seed)
    b = np.array([c["included"] for c in recs], dtype=float)
    head = np.array([c["param"].startswith("head/") for c in recs])
    coins = rng.random((T, len(recs))) < q
    z = rng.normal(0, sigma, (T, len(recs)))
    hz = rng.normal(0, head_noise, (1 if reuse else T, len(recs))) * np.ones((T, 1))
    obs = b * coins + np.where(head, hz, z)
    ob = {"ids": np.arange(len(recs)), "obs": obs, "sigma": sigma, "clip": 1.0, "q": q}
    return [ob]


def test_correct_noise_keeps_the_claimed_sigma_scores_bit_for_bit():
    from audit.canaries import gradient as GC

    recs = _records(400)
    obs = _obs(recs, 10.0, 0.5)
    noise = GC.observed_noise(recs, obs)
    assert all(0.8 < r < 1.2 for r in noise.values())
    plain = GC.score_llr(obs[0]["obs"], 10.0, 0.5)
    assert np.array_equal(GC.canary_scores(recs, obs, "llr"), plain)


@pytest.mark.parametrize("q, reuse", [(1.0, False), (0.5, False), (0.5, True)])
def test_a_group_without_its_noise_is_scored_at_the_noise_observed(q, reuse):
    from audit.bounds.one_run import epsilon_one_run
    from audit.canaries import gradient as GC

    recs = _records(2000)
    obs = _obs(recs, 0.0 if not reuse else 10.0, q, reuse=reuse)
    noise = GC.observed_noise(recs, obs)
    assert noise["head"] < GC.NOISE_FLOOR <= noise["A"]
    s = GC.canary_scores(recs, obs, "llr")
    inc = np.array([c["included"] for c in recs])
    assert epsilon_one_run(s, inc, 1e-5)["epsilon_lb"] > 1.5
