"""Gradient canaries in outside DP-SGD loops (audit.canaries.hooks.GradientCanaryHook): the plain
loop's observations against a slow, obvious reference; Opacus: a correct run stays below
its claim with a non-trivial bound, planted faults are caught as leaking more than
claimed."""

import json

import numpy as np
import pytest
import torch

from audit.canaries import canary_set as CS
from audit.canaries import outside as O
from audit.canaries.hooks import GradientCanaryHook, describe
from audit.claims.check import check_claim
from fl.privacy import rng as R


def _linear(seed=0, d_in=8, d_out=6):
    torch.manual_seed(seed)
    return torch.nn.Linear(d_in, d_out)


def _make_set(tmp_path, model, m, clip, name="set"):
    """A canary set from a fixed key (tests only), kept in the set's private/ as a fresh
    key would be: with the seeded data and noise, every audit here is reproducible."""
    import hashlib
    import shutil

    (tmp_path / "params.json").write_text(json.dumps(describe(model)))
    (tmp_path / f"key-{name}").mkdir()
    secret = hashlib.sha256(f"test_outside_gradient {name}".encode()).digest()
    kp = R.NoiseKey(secret).write(tmp_path / f"key-{name}")
    out = CS.new_canary_set(
        "gradient", m, tmp_path / name, params=str(tmp_path / "params.json"), clip=clip,
        key_file=kp,
    )  # fmt: skip
    shutil.copy(kp, out / "private" / "noise.key")
    return out


def _plain_loop(model, hook, x, y, steps, q, sigma, clip, gen, mode="rows"):
    """A plain DP-SGD loop: per-example gradients by one backward per example, Poisson
    masks, flat clip, sum, Gaussian noise; the hook's rows go in before the clip."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums, noises, masks = [], [], []
    for _ in range(steps):
        mask = torch.rand(len(x), generator=gen) < q
        per = [[] for _ in params]
        for i in np.flatnonzero(mask.numpy()):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
            for k, p in enumerate(params):
                per[k].append(p.grad.detach().clone())
        per = [torch.stack(g) if g else torch.zeros((0, *p.shape)) for g, p in zip(per, params)]
        if mode == "rows":
            per = [torch.cat([g, r]) for g, r in zip(per, hook.canary_rows())]
        norms = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in per))
        f = torch.clamp(clip / norms, max=1.0)
        summed = [torch.einsum("i,i...->...", f, g) for g in per]
        if mode == "clipped":
            hook.add_clipped(summed)
        noise = [torch.randn(p.shape, generator=gen) * sigma * clip for p in params]
        noisy = [s + z for s, z in zip(summed, noise)]
        hook.observe(noisy)
        # data-only clipped sum (canaries excluded) for the reference
        n_data = int(mask.sum())
        data = [torch.einsum("i,i...->...", f[:n_data], g[:n_data]) for g in per]
        sums.append(data)
        noises.append(noise)
        masks.append(mask)
        with torch.no_grad():
            for p, g in zip(params, noisy):
                p -= 0.1 * g / max(1, len(x) * q)
    return sums, noises


@pytest.mark.parametrize("mode", ["rows", "clipped"])
def test_plain_loop_matches_reference(mode, tmp_path):
    model = _linear()
    m, clip, q, sigma, steps = 40, 0.7, 0.5, 0.8, 5
    out = _make_set(tmp_path, model, m, clip)
    hook = GradientCanaryHook.load(out, sample_rate=q, sigma=sigma)
    hook.bind(model.named_parameters())
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 6, (12,), generator=gen)
    sums, noises = _plain_loop(model, hook, x, y, steps, q, sigma, clip, gen, mode)
    got = hook.observations()

    # the reference, from the files and the key alone
    doc = json.loads((out / "canaries.json").read_text())
    bits = np.array(json.loads((out / "private" / "inclusion.json").read_text())["included"])
    key = R.NoiseKey.read(out / "private" / "noise.key")
    names = [n for n, _ in model.named_parameters()]
    expected = np.zeros((steps, m))
    entered = 0
    for t in range(steps):
        u = key.stream("outside-gradient-coins", t).uniform(m).numpy()
        for j, c in enumerate(doc["gradient"]["coordinates"]):
            k = names.index(c["param"])
            v = float(sums[t][k].reshape(-1)[c["index"]]) + float(
                noises[t][k].reshape(-1)[c["index"]]
            )
            if bits[j] and u[j] < q:
                v += clip  # the canary's clipped gradient C·e_j
                entered += 1
            expected[t, j] = v
    assert got["obs"].shape == (steps, m)
    np.testing.assert_allclose(got["obs"], expected, rtol=1e-5, atol=1e-5)
    assert got["sigma"] == sigma and got["clip"] == clip and got["q"] == q
    # how the canaries entered: the audit tests the clip only on per-example rows
    assert got["canaries_entered"] == {"rows": "per_example", "clipped": "clipped_sum"}[mode]
    assert got["set_sha256"] == CS.load_canary_set(out).sha256
    assert entered > 20  # canaries did enter (about M·q·steps/2 = 50)


def test_plain_hook_order_is_enforced(tmp_path):
    model = _linear()
    out = _make_set(tmp_path, model, 10, 1.0)
    hook = GradientCanaryHook.load(out, sample_rate=1.0, sigma=1.0)
    hook.bind(model.named_parameters())
    zeros = [torch.zeros_like(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="no canaries were placed"):
        hook.observe(zeros)
    hook.canary_rows()
    with pytest.raises(RuntimeError, match="already placed"):
        hook.canary_rows()
    other = torch.nn.Linear(8, 7)
    with pytest.raises(O.UsageError, match="shape"):
        hook.bind(other.named_parameters())


# --------------------------------------------------------------------------- Opacus


def _opacus_run(tmp_path, *, sigma, steps, m, n=64, batch=64, clip=1.0, tamper=None, name="set"):
    """A small Opacus DP-SGD training of a linear classifier with gradient canaries;
    returns (canary folder, observation file, claim dict at the recomputed ε)."""
    from opacus import PrivacyEngine

    model = _linear(d_in=32, d_out=64)
    out = _make_set(tmp_path, model, m, clip, name)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 32, generator=g), torch.randint(0, 64, (n,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pe = PrivacyEngine(accountant="rdp")
    model, opt, loader = pe.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=clip, poisson_sampling=True,
    )  # fmt: skip
    if tamper is not None:
        tamper(opt)
    hook = GradientCanaryHook.load(out)
    hook.attach_opacus(opt, model, sample_rate=loader.sample_rate)
    done = 0
    while done < steps:
        for xb, yb in loader:
            if done == steps:
                break
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            done += 1
    obs = hook.write_observations(tmp_path / f"{name}.npz")
    claim = dict(level="sample", noise_multiplier=sigma, clipping_norm=clip, sampling="poisson",
                 sample_rate=loader.sample_rate, steps_per_round=steps, rounds=1,
                 claimed_epsilon=1.0, delta=1e-5, noise_source="csprng")  # fmt: skip
    claim["claimed_epsilon"] = check_claim(claim)["epsilon_pld"]
    return out, obs, claim


def test_opacus_correct_run_strong_setting(tmp_path):
    """σ = 1, q = 1, 4 steps (ε ≈ 10): the certified bound is well above 0 and below ε."""
    out, obs, claim = _opacus_run(tmp_path, sigma=1.0, steps=4, m=2000)
    res = O.audit_outside(out, obs, claim)
    assert res["verdict"] == "ok" and not res["leaks_more_than_claimed"]
    assert 1.0 < res["epsilon_lb"] <= claim["claimed_epsilon"], res["epsilon_lb"]
    assert res["observations"]["source"] == "opacus"
    for g in res["observations"]["noise"].values():  # Opacus's noise is as claimed
        assert 0.8 < g["observed_over_claimed"] < 1.3


def test_opacus_faults_leak_more_than_claimed(tmp_path, capsys):
    """Claimed ε ≈ 1 (σ ≈ 7.5, 4 steps at q = 1). A correct run is consistent; the same
    loop with its noise × ¼ (true ε ≈ 4.7) or its clip skipped is caught (exit 1)."""
    from opacus.optimizers.optimizer import _generate_noise

    from pipeline.cli import main

    def quarter_noise(opt):
        def add_noise():
            for p in opt.params:
                z = _generate_noise(std=opt.noise_multiplier * opt.max_grad_norm / 4,
                                    reference=p.summed_grad)  # fmt: skip
                p.grad = (p.summed_grad + z).view_as(p)

        opt.add_noise = add_noise

    def no_clip(opt):
        def clip_and_accumulate():
            for p in opt.params:
                p.summed_grad = opt._get_flat_grad_sample(p).sum(0)

        opt.clip_and_accumulate = clip_and_accumulate

    results = {}
    for name, tamper in (("ok", None), ("quarter", quarter_noise), ("noclip", no_clip)):
        out, obs, claim = _opacus_run(tmp_path, sigma=7.5, steps=4, m=2000, tamper=tamper,
                                      name=name)  # fmt: skip
        cp = tmp_path / f"{name}.json"
        cp.write_text(json.dumps(claim))
        rc = main(["audit", "--canaries", str(out), "--observations", str(obs),
                   "--claim", str(cp), "--json"])  # fmt: skip
        results[name] = (rc, json.loads(capsys.readouterr().out))
    rc, ok = results["ok"]
    assert rc == 0 and ok["verdict"] == "ok" and ok["epsilon_lb"] < ok["allowed_epsilon"]
    assert 0.9 < ok["allowed_epsilon"] < 1.2
    assert ok["conformance"]["passed"] and ok["conformance"]["coins"].startswith("re-drawn")
    for name in ("quarter", "noclip"):
        rc, r = results[name]
        # the conformance tests name the fault first; the one-run bound leaks as well
        assert rc == 1 and r["verdict"] == "does not implement its claim", name
        assert r["leaks_more_than_claimed"], (name, r["epsilon_lb"])
        codes = {f["code"] for f in r["findings"]}
        assert {"empirical_exceeds_claim", "mechanism_mismatch"} <= codes
    assert results["noclip"][1]["epsilon_lb"] > 3
    # noise × ¼: the scale test in every group, at about ¼ of the claimed noise
    scale = [t for t in results["quarter"][1]["conformance"]["tests"] if t["test"] == "scale"]
    assert scale and all(t["rejected"] and 0.2 < t["observed_over_claimed"] < 0.35 for t in scale)
    # clip skipped: a canary adds K·C, which the clipping test sees through the coins
    assert any(r.endswith(":clip") for r in results["noclip"][1]["conformance"]["rejected"])


def test_opacus_records_a_wrong_clip_and_refuses_another_optimizer(tmp_path):
    from opacus import PrivacyEngine

    model = _linear()
    out = _make_set(tmp_path, model, 10, 1.0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 6, (8,))), batch_size=4
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=2.0
    )
    # a C other than the set's is the run's, recorded (the audit's finding clip_differs)
    hook = GradientCanaryHook.load(out)
    with pytest.warns(UserWarning, match="max_grad_norm = 2"):
        hook.attach_opacus(opt, model, data_loader=loader)
    assert hook.run_clip == 2.0 and hook.q == 1 / len(loader) and hook.sampling == "poisson"
    with pytest.raises(O.UsageError, match="DPOptimizer"):
        GradientCanaryHook.load(out).attach_opacus(torch.optim.SGD(model.parameters()), model)
