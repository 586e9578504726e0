"""Conformance tests of trainings done elsewhere (audit.canaries.outside): the hand-written
DP-SGD loop of docs/examples/dpsgd_bug_audit.py passes when its noise is right (on the sum,
or on the average at σC/B) and is a mechanism_mismatch when the noise is divided by B twice
or when it clips the batch sum instead of each example (the two-sided clip test);
the tests use the claim's σ, never the file's; without the key only the clipping test is
skipped; the coins are the hook's; canary clients get the same tests; the implied ε's core
is the run audit's."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from audit.bounds.conformance import Block, conformance
from audit.canaries import canary_set as CS
from audit.canaries import outside as O
from audit.canaries import outside_conformance as OC
from audit.claims.check import check_claim
from audit.claims.implied import epsilon_of_scaled_claim, epsilon_of_scaled_events
from pipeline.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "dpsgd_bug_audit.py"
SMALL = dict(steps=60, records=200, canaries=300, features=40, hidden=32, seed=3)
B = 0.05 * 200  # the expected batch size at SMALL


def _example():
    spec = importlib.util.spec_from_file_location("dpsgd_bug_audit", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example at a small size, run once: (work folder, its results, what it printed)."""
    import contextlib
    import io

    work = tmp_path_factory.mktemp("dpsgd")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = _example().run(work, **SMALL)
    return work, out, buf.getvalue()


def _scale(res):
    (t,) = [t for t in res["conformance"]["tests"] if t["test"] == "scale"]
    return t


def _codes(res):
    return [f["code"] for f in res["findings"]]


@pytest.mark.parametrize("variant", ["correct", "average"])
def test_right_noise_passes(example, variant):
    """Noise N(0, σ²C²) on the sum, or N(0, (σC/B)²) on the average (the same mechanism):
    nothing found. The loop's own Poisson sampler (q = 0.05) is not observed by the hook:
    sampling untested, the verdict incomplete (exit 4), every other part tested."""
    _, out, _ = example
    res, rc, true_ratio, _ = out[variant]
    c = res["conformance"]
    assert rc == 4 and res["verdict"] == "incomplete", c["rejected"]
    assert res["coverage"]["untested"] == ["sampling"]
    assert res["coverage"]["tested"]["clipping"] == ["canaries"]
    assert c["performed"] and c["passed"] and "mechanism_mismatch" not in _codes(res)
    assert c["coins"] == "re-drawn from the set's key" and not c["skipped"]
    assert {t["test"] for t in c["tests"]} == {"scale", "fresh", "clip", "contribution"}
    assert true_ratio == 1.0 and 0.97 < _scale(res)["observed_over_claimed"] < 1.1
    # the implied ε is the claim's own up to the noise factor's confidence bound
    assert c["implied_factor"] > 0.97 and not c["implied_epsilon_at_least"]
    assert res["claim"]["epsilon_pld"] <= c["implied_epsilon"] < 1.1 * res["claim"]["epsilon_pld"]


def test_noise_divided_twice_is_a_mechanism_mismatch(example):
    """σC/B added to the sum: the hook sees 1/B of the claimed noise."""
    _, out, _ = example
    res, rc, true_ratio, acc = out["bug"]
    c = res["conformance"]
    assert rc == 1 and res["verdict"] == "does not implement its claim"
    assert true_ratio == 1 / B
    assert {"other:scale", "other:fresh"} <= set(c["rejected"])
    t = _scale(res)
    # the data's own variation only adds: at or a little above 1/B, its interval covers 1/B
    assert 0.98 / B < t["observed_over_claimed"] < 1.5 / B
    assert t["ratio_ci"][1] >= 1 / B
    mm = [f for f in res["findings"] if f["code"] == "mechanism_mismatch"]
    assert mm and all(f["severity"] == "error" for f in mm)
    assert "scale test" in mm[0]["message"] and "observed/claimed noise 0.1" in mm[0]["message"]
    # the noise alone is 1/B (the canaries add their C whole): not named as observations
    # divided by B (audit.canaries.outside_conformance.averaged_hint)
    assert "observations_look_averaged" not in _codes(res)
    # the implied ε at σ × the factor's upper bound (≈ 1/B): at the floor σ = 0.25, "at least"
    assert c["implied_factor"] < 1.5 / B and c["implied_epsilon_at_least"]
    assert c["implied_epsilon"] > 10 * res["claim"]["claimed_epsilon"]
    assert acc > out["correct"][3]  # what the bug buys: a model trained with little noise


def test_a_clip_of_the_batch_sum_is_a_mechanism_mismatch(example):
    """The loop clips the batch sum instead of each example: the noise is the claim's and
    no canary adds more than C (the one-sided clip test passes), but each drawn canary adds
    about C/√(canaries drawn): the two-sided clip test rejects."""
    _, out, _ = example
    res, rc, true_ratio, _ = out["batch_clip"]
    c = res["conformance"]
    assert rc == 1 and res["verdict"] == "does not implement its claim"
    assert true_ratio == 1.0 and 0.97 < _scale(res)["observed_over_claimed"] < 1.1
    tests = {t["test"]: t for t in c["tests"]}
    assert tests["clip"]["p_value"] == 1.0 and not tests["clip"]["rejected"]
    t = tests["contribution"]
    assert c["rejected"] == ["other:contribution"] and t["log10_p"] < -10
    assert 0.2 < t["statistic"] < 0.5  # about 1/√7.5 (300 canaries, half in, q = 0.05)
    # the correct loops' contribution is 1 within its noise
    for v in ("correct", "average"):
        (tv,) = [x for x in out[v][0]["conformance"]["tests"] if x["test"] == "contribution"]
        assert not tv["rejected"] and 0.75 < tv["statistic"] < 1.25


def test_example_prints_the_verdicts(example):
    text = example[2]
    assert "(expected batch B = 10), 60 steps" in text and "claimed ε = 2" in text
    assert "correct: verdict INCOMPLETE (exit 4)" in text
    assert "average: verdict INCOMPLETE (exit 4)" in text
    assert "bug: verdict DOES NOT IMPLEMENT ITS CLAIM (exit 1)" in text
    assert "true 0.1000" in text and "conformance tests rejected: other:scale, other:fresh" in text
    assert "batch_clip: verdict DOES NOT IMPLEMENT ITS CLAIM (exit 1)" in text
    assert "conformance tests rejected: other:contribution" in text
    assert "a drawn canary adds 0.3" in text and "two-sided p = " in text


def _rewrite(path: Path, dest: Path, **fields) -> Path:
    with np.load(path) as z:
        doc = {k: z[k] for k in z.files}
    doc.update({k: np.asarray(v) for k, v in fields.items()})
    np.savez(dest, **doc)
    return dest


def test_a_false_stated_sigma_does_not_rescue_the_bug(example, tmp_path, capsys):
    """The bug's observation file re-written to state σ/B (exactly the noise it added): the
    tests still use the claim's σ and reject; the file's σ is an error finding naming both;
    the CLI exits 1, not 2."""
    work, out, _ = example
    claim = json.loads((work / "claim.json").read_text())
    sigma = claim["noise_multiplier"]
    obs = _rewrite(work / "obs-bug.npz", tmp_path / "lying.npz", sigma=sigma / B)
    kp = work / "key-bug" / "private" / "noise.key"
    res = O.audit_outside(work / "canaries-bug", obs, work / "claim.json", key_file=kp)
    assert res["verdict"] == "does not implement its claim"
    assert res["conformance"]["sigma"] == sigma and "other:scale" in res["conformance"]["rejected"]
    (f,) = [f for f in res["findings"] if f["code"] == O.STATED_SIGMA_DIFFERS]
    assert f["severity"] == "error"
    assert f"σ = {sigma / B:g}" in f["message"] and f"noise_multiplier = {sigma:g}" in f["message"]
    # had the file's σ been used, the scale test would have passed: the claim's σ decides
    x = np.load(obs)["obs"]
    cs = CS.load_canary_set(work / "canaries-bug", key_file=kp)
    groups = np.full(cs.count, "other")
    own = Block(u=x, tracks=np.arange(cs.count), groups=groups, sigma=sigma / B,
                included=cs.included, q=0.05)  # fmt: skip
    assert not any(t.test == "scale" and t.rejected for t in conformance([own]).tests)
    rc = main(["audit", "--canaries", str(work / "canaries-bug"), "--observations", str(obs),
               "--claim", str(work / "claim.json"), "--key", str(kp)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 1 and "DOES NOT IMPLEMENT ITS CLAIM" in text and "stated_sigma_differs" in text


def test_a_stated_sigma_alone_is_reported_not_refused(example, tmp_path):
    """A correct training whose file states another σ: audited (no exit 2); below the claim's
    it is an error finding (verdict 'claim not supported'), above it a warning (nothing
    found: incomplete, the sampler being unobserved)."""
    work, out, _ = example
    sigma = json.loads((work / "claim.json").read_text())["noise_multiplier"]
    kp = work / "key-correct" / "private" / "noise.key"
    for stated, severity, verdict in ((sigma / 2, "error", "claim not supported"),
                                      (2 * sigma, "warning", "incomplete")):  # fmt: skip
        obs = _rewrite(work / "obs-correct.npz", tmp_path / "o.npz", sigma=stated)
        res = O.audit_outside(work / "canaries-correct", obs, work / "claim.json", key_file=kp)
        (f,) = [f for f in res["findings"] if f["code"] == O.STATED_SIGMA_DIFFERS]
        assert f["severity"] == severity and res["verdict"] == verdict
        assert res["conformance"]["passed"] and res["conformance"]["sigma"] == sigma
        assert O.exit_code(res) == (1 if severity == "error" else 4)


def test_without_the_key_only_the_clipping_test_is_skipped(example, capsys):
    """The sets were made with --key: audited without it the coins are unknown; the scale
    and freshness tests still run (and still catch the bug), the clipping test is skipped
    and the output says so (clipping untested beside sampling)."""
    work, out, _ = example
    for variant, verdict in (("correct", "incomplete"), ("bug", "does not implement its claim")):
        res = O.audit_outside(work / f"canaries-{variant}", work / f"obs-{variant}.npz",
                              work / "claim.json")  # fmt: skip
        c = res["conformance"]
        assert c["performed"] and c["coins"].startswith("unknown") and "--key" in c["coins"]
        assert {t["test"] for t in c["tests"]} == {"scale", "fresh"}
        assert c["skipped"] == ["clip (the canaries' coins are unknown)"]
        assert any("clipping test is skipped" in n for n in res["notes"])
        assert res["verdict"] == verdict
        assert "clipping" in res["coverage"]["untested"]
        with_key = out[variant][0]["conformance"]
        assert _scale(res)["terms"] == _scale(out[variant][0])["terms"]
        assert {t["test"] for t in with_key["tests"]} == {"scale", "fresh", "clip", "contribution"}
    rc = main(["audit", "--canaries", str(work / "canaries-correct"), "--observations",
               str(work / "obs-correct.npz"), "--claim", str(work / "claim.json")])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 4 and "canaries' coins" in text and "unknown" in text
    assert "INCOMPLETE: sampling, clipping untested (exit 4)" in text
    assert "clipping test is skipped" in text


def test_coins_are_the_hooks(tmp_path):
    """gradient_coins re-draws exactly the canaries the hook placed, step by step."""
    import torch

    from audit.canaries.hooks import GradientCanaryHook, describe

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6)
    (tmp_path / "p.json").write_text(json.dumps(describe(model)))
    out = CS.new_canary_set("gradient", 40, tmp_path / "set", params=tmp_path / "p.json", clip=0.5)
    q, steps = 0.3, 6
    hook = GradientCanaryHook.load(out, sample_rate=q, sigma=1.0)  # a fresh key: any key
    hook.bind(model.named_parameters())
    cs = CS.load_canary_set(out)
    where = {(c["param"], c["index"]): j for j, c in enumerate(cs.spec["coordinates"])}
    names = [n for n, _ in model.named_parameters()]
    coins = O.gradient_coins(cs.key, steps, cs.count, q)
    placed_total = 0
    for t in range(steps):
        rows = hook.canary_rows()
        placed = set()
        for name, r in zip(names, rows):
            for i, flat in zip(*np.nonzero(r.reshape(len(r), -1).numpy())):
                assert r.reshape(len(r), -1)[i, flat] == hook.pre_clip * hook.clip
                placed.add(where[(name, int(flat))])
        assert placed == set(np.flatnonzero(coins[t] & cs.included).tolist())
        placed_total += len(placed)
        hook.observe([torch.zeros_like(p) for p in model.parameters()])
    assert placed_total > 5  # about 40 · ½ · 0.3 · 6 = 36


# --------------------------------------------------------------------------- canary clients


def _keyfile(tmp_path, label: str) -> Path:
    """A fixed key (tests only: reproducible draws, hence not secret)."""
    import hashlib

    from fl.privacy.rng import NoiseKey

    (tmp_path / "key").mkdir(exist_ok=True)
    secret = hashlib.sha256(f"test_outside_conformance {label}".encode()).digest()
    return NoiseKey(secret).write(tmp_path / "key", overwrite=True)


def _server(hook, *, rounds, clients, d, clip, sigma, noise_scale, seed):
    """A numpy DP-FedAvg server (tests/audit/test_outside_client.py's), the canaries' sum
    added before the noise σC × ``noise_scale``, divided by m."""
    rng = np.random.default_rng(seed)
    for r in range(1, rounds + 1):
        ups = rng.normal(size=(clients, d)) * 0.01
        ups *= np.minimum(1.0, clip / np.linalg.norm(ups, axis=1))[:, None]
        s = ups.sum(0) + hook.contribution(r) + rng.normal(size=d) * sigma * clip * noise_scale
        hook.observe(r, s / clients, sigma=sigma, clip=clip, clients_per_round=clients)


def _client_claim(sigma, clip, rounds, clients, total, sampling):
    c = dict(level="client", noise_multiplier=sigma, clipping_norm=clip, sampling=sampling,
             rounds=rounds, clients_per_round=clients, total_clients=total,
             claimed_epsilon=1.0, delta=1e-5, noise_source="keyed_csprng")  # fmt: skip
    c["claimed_epsilon"] = check_claim(c)["epsilon_pld"]
    return c


@pytest.mark.parametrize("noise_scale", [1.0, 0.25])
def test_canary_clients_every_round(noise_scale, tmp_path):
    from audit.canaries.client_hook import ClientCanaryHook

    m, d, clip, sigma, rounds, clients = 1000, 10000, 0.5, 4.0, 4, 10
    kp = _keyfile(tmp_path, "every round")
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=clip, dim=d, key_file=kp)
    hook = ClientCanaryHook.load(out, key_file=kp)
    _server(hook, rounds=rounds, clients=clients, d=d, clip=clip, sigma=sigma,
            noise_scale=noise_scale, seed=5)  # fmt: skip
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = _client_claim(sigma, clip, rounds, clients, clients, "all")
    res = O.audit_outside(out, obs, claim, key_file=kp)
    c = res["conformance"]
    assert c["performed"] and c["coins"].startswith("every round")
    ratio = _scale(res)["observed_over_claimed"]
    if noise_scale == 1.0:
        assert c["passed"] and 0.95 < ratio < 1.1, c["rejected"]
        assert c["implied_epsilon"] < 1.1 * res["claim"]["epsilon_pld"]
    else:
        assert res["verdict"] == "does not implement its claim" and "clients:scale" in c["rejected"]
        assert 0.23 < ratio < 0.3 and c["implied_factor"] < 0.3
        assert c["implied_epsilon"] > 3 * res["claim"]["epsilon_pld"]


def test_canary_clients_poisson_coins_are_redrawn(tmp_path):
    from audit.canaries.client_hook import ClientCanaryHook

    m, d, clip, sigma, rounds, clients, total = 1000, 5000, 1.0, 3.0, 8, 10, 40
    kp = _keyfile(tmp_path, "poisson")
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=clip, dim=d,
                            participation="poisson", rate=clients / total, key_file=kp)  # fmt: skip
    hook = ClientCanaryHook.load(out, key_file=kp)
    _server(hook, rounds=rounds, clients=clients, d=d, clip=clip, sigma=sigma, noise_scale=1.0,
            seed=6)  # fmt: skip
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = _client_claim(sigma, clip, rounds, clients, total, "poisson")
    res = O.audit_outside(out, obs, claim, key_file=kp)
    c = res["conformance"]
    assert c["coins"].startswith("re-drawn") and c["passed"], c["rejected"]
    assert {t["test"] for t in c["tests"]} == {"scale", "fresh", "clip"}
    # a canary that enters at twice its weight (a server that weighs it 2/m) is caught by the
    # clipping test: the coins pull the innovations up
    hook2 = ClientCanaryHook.load(out, key_file=kp)
    contribution = hook2.contribution
    hook2.contribution = lambda r: 2 * contribution(r)
    _server(hook2, rounds=rounds, clients=clients, d=d, clip=clip, sigma=sigma, noise_scale=1.0,
            seed=6)  # fmt: skip
    res2 = O.audit_outside(out, hook2.write_observations(tmp_path / "obs2.npz"), claim, key_file=kp)
    # without the key the coins are unknown: the clipping test is skipped, said so
    res3 = O.audit_outside(out, obs, claim)
    assert res3["conformance"]["coins"].startswith("unknown")
    assert "clip" not in {t["test"] for t in res3["conformance"]["tests"]}
    assert "clients:clip" in res2["conformance"]["rejected"], res2["conformance"]["tests"]
    assert res2["verdict"] == "does not implement its claim"


def test_isotropic_canary_clients_are_not_tested(tmp_path, capsys):
    from audit.canaries.client_hook import ClientCanaryHook

    m, d, clip, sigma, clients = 300, 200, 0.5, 4.0, 5
    kp = _keyfile(tmp_path, "isotropic")
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=clip, dim=d, key_file=kp)
    hook = ClientCanaryHook.load(out, key_file=kp)
    _server(hook, rounds=2, clients=clients, d=d, clip=clip, sigma=sigma, noise_scale=1.0, seed=1)
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = _client_claim(sigma, clip, 2, clients, clients, "all")
    res = O.audit_outside(out, obs, claim, key_file=kp)
    assert not res["conformance"]["performed"]
    why = res["conformance"]["reason"]
    assert "isotropic" in why and "correlated" in why
    cp = tmp_path / "claim.json"
    cp.write_text(json.dumps(claim))
    main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim", str(cp),
          "--key", str(kp)])  # fmt: skip
    text = capsys.readouterr().out
    assert "not tested: the canary clients' directions are isotropic" in text


# --------------------------------------------------------------------------- the implied ε


def test_implied_core_is_the_run_audits():
    """epsilon_of_scaled_events gives what audit.bundle.conformance.implied_epsilon gives for a
    ledger (per unit, the max; the floor at 0.25 marked 'at least').

    σ = 3 and 2.5 keep the PLDs at factors 1 and 0.6 cheap (a PLD's grid grows as σ falls);
    at factor 0.05 both units' σ fall below the floor and become 60 steps at σ = 0.25, q =
    0.05: the mechanism of the example's bug at the floor (the module's `example`), whose ε
    the accountant's memo then holds (computed afresh when this test runs alone)."""
    from audit.bundle.conformance import implied_epsilon
    from fl.privacy.accounting import Event

    events = [
        Event("poisson_gaussian", 3.0, 0.05, 30, unit="client:0", round=0),
        Event("poisson_gaussian", 3.0, 0.05, 30, unit="client:0", round=1),
        Event("poisson_gaussian", 2.5, 0.05, 60, unit="client:1", round=0),
    ]
    manifest = {"privacy": {"ledger": {"events": [e.to_dict() for e in events]}}}
    units = [[e for e in events if e.unit == u] for u in ("client:0", "client:1")]
    for factor in (1.0, 0.6, 0.05, 0.0):
        assert epsilon_of_scaled_events(units, factor, 1e-5) == implied_epsilon(
            manifest, factor, 1e-5
        )
    assert epsilon_of_scaled_events(units, 0.05, 1e-5)[1] is True
    assert epsilon_of_scaled_events(units, 0.6, 1e-5)[1] is False


@pytest.mark.parametrize(
    "claim",
    [
        # σ = 2.4 and 2 (not 1.2 and 1): the PLDs at σ and σ/2 cost a third as much
        dict(sampling="poisson", sample_rate=0.05, steps_per_round=50, noise_multiplier=2.4),
        # ε = 1.031 at q = 20/90, 0.924 at Opacus's 1/ceil(90/20) = 0.2: the check reads 0.2
        # (σ = 3, not 2 (1.797 and 1.618): the PLDs at σ and σ/2 in 0.57 s of CPU, not 0.98)
        dict(
            sampling="poisson",
            batch_size=20,
            dataset_size=90,
            steps_per_round=10,
            noise_multiplier=3.0,
            claimed_epsilon=0.925,
        ),
        dict(sampling="all", steps_per_round=4, noise_multiplier=3.0),
        dict(
            sampling="fixed_batch",
            batch_size=10,
            dataset_size=100,
            steps_per_round=4,
            noise_multiplier=3.0,
        ),
    ],
)
def test_implied_epsilon_of_the_claim_at_factor_one_is_the_recomputed(claim):
    from audit.claims.schema import Claim

    base = dict(level="sample", rounds=1, claimed_epsilon=50.0, delta=1e-5, clipping_norm=1.0)
    c = Claim.from_dict({**base, **claim})
    checked = check_claim(c)
    mech = OC.claim_mechanism(c, checked)
    eps, at_least = epsilon_of_scaled_claim(mech, c.noise_multiplier, 1.0, c.delta)
    assert eps == checked["epsilon_pld"] and not at_least
    half, _ = epsilon_of_scaled_claim(mech, c.noise_multiplier, 0.5, c.delta)
    assert half > eps
    if "claimed_epsilon" in claim:
        assert any(f["code"] == "opacus_sample_rate" for f in checked["findings"])
        assert mech.q == pytest.approx(0.2)
