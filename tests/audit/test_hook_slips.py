"""Slips in using the outside hooks, and runs that differ from their claims (#43 item 0).

- A run whose C, q, sampling, steps (or clients per round) differ from the claim is a
  finding naming the run's value and the claim's (exit 1), never a usage error; real usage
  errors (missing or unreadable files) stay exit 2.
- ``GradientCanaryHook.observe`` given the batch MEAN without ``scale=B``: detected from
  the data (the noise AND the canaries' contribution both about 1/B of the claim's) and
  named, while the run still fails; a noise that is truly too small (the canaries' C whole)
  is not excused as a division.
- Observations of the wrong shape: a clear error, expected against given.
- ``attach_opacus`` reads Opacus's q from the data loader (1/len(loader), also for the
  shuffled DataLoader of poisson_sampling=False, which has no ``sample_rate``) or from the
  accountant's hook, records the sampling, and a claim of Poisson sampling for shuffled
  batches is the finding ``sampling_differs``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings

import numpy as np
import pytest

from audit.canaries import canary_set as CS
from audit.canaries import observations as OB
from audit.canaries import outside as O
from audit.canaries.outside_conformance import averaged_hint
from audit.claims.check import check_claim
from fl.privacy import rng as R
from pipeline.cli import main

torch = pytest.importorskip("torch")

from audit.canaries.hooks import GradientCanaryHook, describe  # noqa: E402


def _model(d_in=8, d_out=6, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(d_in, d_out)


def _make_set(tmp_path, model, m, clip, name="set"):
    """A gradient canary set from a fixed key (tests only: reproducible), the key kept in
    the set's private/ as a fresh one would be."""
    (tmp_path / f"params-{name}.json").write_text(json.dumps(describe(model)))
    (tmp_path / f"key-{name}").mkdir()
    kp = R.NoiseKey(hashlib.sha256(f"test_hook_slips {name}".encode()).digest()).write(
        tmp_path / f"key-{name}"
    )
    out = CS.new_canary_set("gradient", m, tmp_path / name,
                            params=str(tmp_path / f"params-{name}.json"), clip=clip,
                            key_file=kp)  # fmt: skip
    shutil.copy(kp, out / "private" / "noise.key")
    return out


def _claim(**kw) -> dict:
    c = dict(level="sample", noise_multiplier=1.0, clipping_norm=1.0, sampling="poisson",
             sample_rate=0.5, steps_per_round=40, rounds=1, claimed_epsilon=50.0, delta=1e-5,
             noise_source="keyed_csprng")  # fmt: skip
    c.update(kw)
    return c


# --------------------------------------------------------------------------- a. the claim


def _honest_obs(tmp_path, steps=40, **change):
    """Observations of ``steps`` steps with the claim's noise (σ = 1, C = 1) and the
    canaries' C where their coins and bits say (what a correct run gives), then
    ``change``d. (Where the run's steps and the claim's differ, the run's are changed, not
    the claim's 40: every claim here is one mechanism, whose ε the accountant's cache then
    computes once.)"""
    model = _model()
    out = _make_set(tmp_path, model, 40, 1.0)
    cs = CS.load_canary_set(out)
    q = 0.5
    coins = O.gradient_coins(cs.key, steps, cs.count, q)
    x = np.random.default_rng(0).normal(size=(steps, cs.count)) + (coins & cs.included)
    f = dict(kind="gradient", set_sha256=cs.sha256, obs=x, sigma=1.0, clip=1.0, q=q)
    f.update(change)
    return out, OB.write_observations(tmp_path / "obs.npz", f)


def _audit_json(out, obs, claim, tmp_path, capsys):
    cp = tmp_path / "claim.json"
    cp.write_text(json.dumps(claim))
    rc = main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim", str(cp),
               "--json"])  # fmt: skip
    cap = capsys.readouterr()
    return rc, json.loads(cap.out) if rc != 2 else cap.err


def test_an_honest_run_passes(tmp_path, capsys):
    """Nothing found; the claim's Poisson sampling at q = 0.5 is the one part the outside
    audit cannot test (the hook's coins are not the sampler's): incomplete, exit 4."""
    out, obs = _honest_obs(tmp_path)
    rc, doc = _audit_json(out, obs, _claim(), tmp_path, capsys)
    assert rc == 4 and doc["verdict"] == "incomplete" and doc["run_differs"] == []
    assert doc["conformance"]["passed"] and doc["coverage"]["untested"] == ["sampling"]


@pytest.mark.parametrize(
    "change, claim, code, words",
    [
        (dict(q=0.25), {}, "sample_rate_differs", ["q = 0.25", "0.5"]),
        (dict(clip=2.0), {}, "clip_differs", ["C = 2", "clipping_norm = 1"]),
        (dict(steps=50), {}, "steps_differs", ["50 DP-SGD steps", "accounts 40"]),
        (dict(sampling="shuffle"), {}, "sampling_differs", ["'shuffle'", "'poisson'", "Opacus"]),
        ({}, dict(sampling="shuffle"), "sample_rate_differs", ["q = 0.5", "'shuffle'"]),
    ],
)
def test_a_run_that_differs_from_its_claim_is_a_finding(change, claim, code, words, tmp_path,
                                                        capsys):  # fmt: skip
    out, obs = _honest_obs(tmp_path, **change)
    rc, doc = _audit_json(out, obs, _claim(**claim), tmp_path, capsys)
    assert rc == 1, doc
    assert doc["verdict"] == "does not implement its claim"
    assert code in doc["run_differs"]
    found = [f for f in doc["findings"] if f["code"] == code]
    assert found and all(f["severity"] == "error" for f in found)
    text = " ".join(f["message"] for f in found)
    for w in words:
        assert w in text, text
    # the noise was the claim's: the finding alone fails the run
    assert doc["conformance"]["passed"] and not doc["mechanism_mismatch"]


def test_fewer_steps_than_claimed_is_a_note_not_a_finding(tmp_path, capsys):
    out, obs = _honest_obs(tmp_path, steps=30)
    rc, doc = _audit_json(out, obs, _claim(), tmp_path, capsys)
    assert rc == 4 and doc["run_differs"] == []  # incomplete: sampling untested, as above
    assert any("30 of the claim's 40 steps" in n for n in doc["notes"])


def test_shuffled_run_under_a_shuffle_claim_is_a_note(tmp_path, capsys):
    out, obs = _honest_obs(tmp_path, sampling="shuffle")
    rc, doc = _audit_json(out, obs, _claim(sampling="shuffle"), tmp_path, capsys)
    assert doc["run_differs"] == [], doc["findings"]
    assert any("weaker test" in n for n in doc["notes"])


@pytest.mark.parametrize("what", ["missing", "unreadable", "bad_q", "bad_sampling"])
def test_usage_errors_stay_exit_2(what, tmp_path, capsys):
    change = {"bad_q": dict(q=1.5), "bad_sampling": dict(sampling="banana")}.get(what, {})
    out, obs = _honest_obs(tmp_path, **change)
    if what == "missing":
        obs = tmp_path / "none.npz"
    elif what == "unreadable":
        obs.write_bytes(b"PK\x03\x04junk")
    rc, err = _audit_json(out, obs, _claim(), tmp_path, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--observations" in err


def test_client_level_mismatches_are_findings(tmp_path):
    """Canary clients (every round): a server that divides by another m, clips at another
    C or releases more rounds than claimed: findings, exit 1."""
    from audit.canaries.client_hook import ClientCanaryHook

    (tmp_path / "k").mkdir()
    kp = R.NoiseKey(bytes(range(32))).write(tmp_path / "k")
    m, d, clip, sigma, rounds, clients = 200, 2000, 0.5, 4.0, 3, 10
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=clip, dim=d, key_file=kp)
    hook = ClientCanaryHook.load(out, key_file=kp)
    rng = np.random.default_rng(2)
    for r in range(1, rounds + 1):
        s = hook.contribution(r) + rng.normal(size=d) * sigma * clip
        hook.observe(r, s / clients, sigma=sigma, clip=clip, clients_per_round=clients)
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = dict(level="client", noise_multiplier=sigma, clipping_norm=clip, sampling="all",
                 rounds=rounds, clients_per_round=clients, total_clients=clients,
                 claimed_epsilon=1.0, delta=1e-5, noise_source="keyed_csprng")  # fmt: skip
    claim["claimed_epsilon"] = check_claim(claim)["epsilon_pld"]
    ok = O.audit_outside(out, obs, claim, key_file=kp)
    # nothing found; incomplete (exit 4): canary clients enter after the server's clip
    assert ok["run_differs"] == [] and O.exit_code(ok) == 4, ok["findings"]
    assert ok["coverage"]["untested"] == ["clipping"]
    for bad, code, words in (
        (dict(clients_per_round=20, total_clients=20), "clients_per_round_differs",
         ["divided by 10", "clients_per_round = 20"]),
        (dict(clipping_norm=1.0), "clip_differs", ["C = 0.5", "clipping_norm = 1"]),
        (dict(rounds=2), "steps_differs", ["3 rounds", "accounts 2"]),
    ):  # fmt: skip
        res = O.audit_outside(out, obs, {**claim, **bad}, key_file=kp)
        assert code in res["run_differs"] and O.exit_code(res) == 1, res["findings"]
        (f,) = [f for f in res["findings"] if f["code"] == code][:1]
        assert all(w in f["message"] for w in words), f["message"]


# --------------------------------------------------------------------------- b. scale=


def _plain_loop(hook, model, *, steps, n, q, sigma, clip, mean_by=None, scale=1.0,
                noise_factor=1.0, seed=1):  # fmt: skip
    """A plain DP-SGD loop: Poisson batches of n records, per-sample gradients (random, of
    norm up to 3C), the hook's canary rows, flat clip to C, sum, Gaussian noise σC
    (× ``noise_factor``); ``observe(noisy / mean_by, scale=scale)``."""
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    for _ in range(steps):
        k = int((torch.rand(n, generator=gen) < q).sum())
        per = [torch.randn((k, *p.shape), generator=gen) * 0.3 for p in params]
        per = [torch.cat([g, r]) for g, r in zip(per, hook.canary_rows())]
        norms = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in per))
        f = torch.clamp(clip / norms, max=1.0)
        summed = [torch.einsum("i,i...->...", f, g) for g in per]
        noisy = [s + torch.randn(s.shape, generator=gen) * sigma * clip * noise_factor
                 for s in summed]  # fmt: skip
        if mean_by is not None:
            noisy = [t / mean_by for t in noisy]
        hook.observe(noisy, scale=scale)


def _slip_run(tmp_path, name, **kw):
    """M = 60 canaries, 40 steps at q = 0.5 over N = 16 records (expected batch 8), σ = 1,
    C = 1; the audit of the observations against the run's claim."""
    model = _model(d_in=16, d_out=8)
    out = _make_set(tmp_path, model, 60, 1.0, name)
    hook = GradientCanaryHook.load(out, sample_rate=0.5, sigma=1.0, expected_batch_size=8)
    hook.bind(model.named_parameters())
    _plain_loop(hook, model, steps=40, n=16, q=0.5, sigma=1.0, clip=1.0, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs = hook.write_observations(tmp_path / f"{name}.npz")
    said = [str(w.message) for w in caught if "look divided" in str(w.message)]
    res = O.audit_outside(out, obs, _claim())
    return res, said


def _averaged(res):
    return [f for f in res["findings"] if f["code"] == "observations_look_averaged"]


def test_the_mean_without_scale_is_named_and_still_fails(tmp_path):
    res, said = _slip_run(tmp_path, "mean", mean_by=8.0)
    assert res["verdict"] == "does not implement its claim" and O.exit_code(res) == 1
    assert "mechanism_mismatch" in [f["code"] for f in res["findings"]]
    (f,) = _averaged(res)
    assert f["severity"] == "warning" and f["batch"] == 8
    assert "divided by ≈ 8" in f["message"] and "pass scale=B to observe()" in f["message"]
    assert "expected batch size 8" in f["message"] and "scale = 1 at every step" in f["message"]
    lo, hi = f["batch_range"]
    assert lo < 8 < hi and hi / lo < 1.5
    assert res["conformance"]["averaged"]["batch"] == 8
    # the hook said so when it wrote the file
    assert len(said) == 1 and "≈ 8" in said[0]


def test_the_mean_with_scale_passes(tmp_path):
    res, said = _slip_run(tmp_path, "scaled", mean_by=8.0, scale=8.0)
    # nothing found (the sampler itself is not observed: incomplete, not a finding)
    assert res["verdict"] == "incomplete", res["findings"]
    assert res["coverage"]["untested"] == ["sampling"]
    assert not _averaged(res) and not said


def test_noise_truly_too_small_is_not_excused_as_a_division(tmp_path):
    """σ × 1/8 on the SUM: the noise is 1/8 of the claim's, as with the slip, but each canary
    adds its C whole: no division named; the run fails."""
    res, said = _slip_run(tmp_path, "small", noise_factor=1 / 8)
    assert res["verdict"] == "does not implement its claim"
    assert not _averaged(res) and not said


def test_a_mean_over_an_unknown_batch_names_the_nearest_integer(tmp_path):
    model = _model(d_in=16, d_out=8)
    out = _make_set(tmp_path, model, 60, 1.0, "unknown")
    hook = GradientCanaryHook.load(out, sample_rate=0.5, sigma=1.0)  # no expected batch
    hook.bind(model.named_parameters())
    _plain_loop(hook, model, steps=40, n=16, q=0.5, sigma=1.0, clip=1.0, mean_by=5.0)
    with pytest.warns(UserWarning, match="look divided by ≈ "):
        obs = hook.write_observations(tmp_path / "u.npz")
    (f,) = _averaged(O.audit_outside(out, obs, _claim()))
    # the integer nearest 1/â, from a range (99%) that holds the true 5
    lo, hi = f["batch_range"]
    assert lo <= 5 <= hi and lo <= f["batch"] <= hi and hi / lo < 1.5
    assert "nearest integer" in f["message"]


def test_averaged_hint_against_a_closed_form():
    """u = (Z σ + v)/B exactly (no data): the contribution estimate is 1/B within its
    interval, the noise's ratio 1/B; B named from its range; at B = 1 nothing is named."""
    rng = np.random.default_rng(5)
    T, M, sigma = 200, 100, 1.0
    v = rng.random((T, M)) < 0.3
    for b in (2, 3, 16):
        u = (rng.normal(size=(T, M)) * sigma + v) / b
        h = averaged_hint(u, v, sigma)
        assert h is not None and h["batch"] == b, (b, h)
        assert h["batch_range"][0] <= b <= h["batch_range"][1]
    u = rng.normal(size=(T, M)) * sigma + v
    assert averaged_hint(u, v, sigma) is None
    # every canary in every step (q = 1): the contribution is measured across tracks
    inc = rng.random(M) < 0.5
    v1 = np.broadcast_to(inc, (T, M))
    u = (rng.normal(size=(T, M)) + v1) / 4
    assert averaged_hint(u, v1, 1.0)["batch"] == 4
    u = rng.normal(size=(T, M)) / 4 + v1  # the noise alone is small: the canaries add C
    assert averaged_hint(u, v1, 1.0) is None


# --------------------------------------------------------------------------- b. the shape


def test_observations_of_the_wrong_shape_are_named(tmp_path):
    model = _model()
    out = _make_set(tmp_path, model, 10, 1.0)
    hook = GradientCanaryHook.load(out, sample_rate=1.0, sigma=1.0)
    hook.bind(model.named_parameters())
    w, b = model.weight, model.bias
    hook.canary_rows()
    per_sample = [torch.zeros((4, *w.shape)), torch.zeros((4, *b.shape))]
    with pytest.raises(O.UsageError, match=r"'weight' has shape \(6, 8\), the tensor given for "
                       r"it \(4, 6, 8\) \(a leading dimension of per-sample"):  # fmt: skip
        hook.observe(per_sample)
    with pytest.raises(O.UsageError, match="expected 2 tensors .* got 1"):
        hook.observe([torch.zeros_like(w)])
    with pytest.raises(O.UsageError, match=r"no tensor for parameter\(s\) \['bias'\]"):
        hook.observe({"weight": torch.zeros_like(w)})
    with pytest.raises(O.UsageError, match="got one Tensor of shape"):
        hook.observe(torch.zeros_like(w))
    with pytest.raises(O.UsageError, match=r"'bias' has shape \(6,\), .* \(5,\)"):
        hook.observe([torch.zeros_like(w), torch.zeros(5)])
    with pytest.raises(O.UsageError, match="scale must be"):
        hook.observe([torch.zeros_like(w), torch.zeros_like(b)], scale=0)
    with pytest.raises(O.UsageError, match="NaN or Inf"):
        hook.observe([torch.full_like(w, float("nan")), torch.zeros_like(b)])
    # nothing was recorded by the refusals; a flattened tensor or a numpy array is fine
    assert hook.step == 0
    hook.observe({"weight": w.detach().reshape(-1).clone(), "bias": b.detach().numpy().copy()})
    assert hook.step == 1 and len(hook.observed) == 1


# --------------------------------------------------------------------------- c. Opacus's q


def _opacus(model, poisson: bool, n=60, batch=20):
    from opacus import PrivacyEngine

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 6, (n,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch,
                                         shuffle=not poisson)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=poisson,
        )  # fmt: skip


def test_attach_opacus_reads_q_for_shuffled_batches_and_the_claim_differs(tmp_path):
    model = _model()
    out = _make_set(tmp_path, model, 30, 1.0)
    model, opt, loader = _opacus(model, poisson=False)
    # Opacus keeps the user's DataLoader when poisson_sampling=False: no .sample_rate there
    assert not hasattr(loader, "sample_rate")
    hook = GradientCanaryHook.load(out)
    hook.attach_opacus(opt, model, data_loader=loader)
    assert hook.q == pytest.approx(1 / 3) and hook.sampling == "shuffle"
    steps = 0
    while steps < 30:
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps += 1
    obs = hook.write_observations(tmp_path / "o.npz")
    claim = _claim(sample_rate=1 / 3, steps_per_round=30, claimed_epsilon=100.0)
    res = O.audit_outside(out, obs, claim)
    assert "sampling_differs" in res["run_differs"] and O.exit_code(res) == 1
    (f,) = [f for f in res["findings"] if f["code"] == "sampling_differs"]
    assert "counts the shuffled batches as Poisson" in f["message"]
    assert res["observations"]["sampling"] == "shuffle"
    # the same run under a claim that says shuffle: no such finding
    res2 = O.audit_outside(out, obs, dict(claim, sampling="shuffle"))
    assert "sampling_differs" not in res2["run_differs"]


def test_attach_opacus_q_from_the_accountant_or_a_clear_error(tmp_path):
    from opacus.optimizers.optimizer import DPOptimizer

    model = _model()
    out = _make_set(tmp_path, model, 10, 1.0)
    model, opt, loader = _opacus(model, poisson=True)
    hook = GradientCanaryHook.load(out)
    hook.attach_opacus(opt, model)  # the rate make_private gave the accountant's hook
    assert hook.q == pytest.approx(loader.sample_rate) and hook.sampling is None
    hook2 = GradientCanaryHook.load(out)
    with pytest.raises(O.UsageError, match="sample_rate = 0.5 but the data loader's rate"):
        hook2.attach_opacus(opt, model, sample_rate=0.5, data_loader=loader)
    # a DPOptimizer built by hand (no PrivacyEngine): no accountant hook, no loader
    bare = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                       max_grad_norm=1.0, expected_batch_size=20)  # fmt: skip
    with pytest.raises(O.UsageError, match="pass data_loader="):
        GradientCanaryHook.load(out).attach_opacus(bare, model)
