"""Gradient-space (Dirac) canaries of sample-level DP-SGD (``--canary-kind gradient``):
the contribution, the noise untouched, the observations, the one-run audit, and that
nothing of them reaches the release bundle (fl/privacy/gradient_canaries.py,
audit/canaries/gradient.py)."""

import json
import math

import numpy as np
import pytest
import torch

from audit.bounds.one_run import epsilon_one_run
from audit.canaries import gradient as GC
from fl.errors import UsageError
from fl.privacy import accounting
from fl.privacy import gradient_canaries as G
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, clip_and_noise
from fl.testing import tiny_config

FIXED_KEY = R.NoiseKey(bytes(range(32)))  # tests only: a fixed key makes runs repeatable


def _params(seed: int, n: int = 6, shapes=((4, 5), (7,))):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.zeros(s))
        p.grad_sample = torch.randn((n, *s), generator=g) * 2
        out.append(p)
    return out


def _canaries(flat, included, coins, clip):
    k = len(flat)
    return G.ClientCanaries(
        ids=np.arange(k),
        flat=torch.as_tensor(flat, dtype=torch.long),
        included=np.asarray(included, dtype=bool),
        coins=[np.asarray(c, dtype=bool) for c in coins],
        clip=clip,
        meta={"round": 0, "client": "0", "stage": "train", "attempt": 0},
    )


def _step(canaries, sigma=0.0, seed=0, clip=1.5, batch=6):
    params = _params(seed)
    dp = DpSgdParams(sigma, clip, 0.5, 4.0)
    src = R.SeededSource(1, ("dpsgd-noise", 0, "0", "train")) if sigma > 0 else None
    clip_and_noise(params, dp, src, batch_size=batch, canaries=canaries)
    return torch.cat([p.grad.reshape(-1) for p in params])


# ---------------------------------------------------------------- (a) the contribution


@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_sampled_canary_adds_exactly_c_at_its_coordinate_before_the_noise(sigma):
    C, E = 1.5, 4.0
    flat = [3, 21, 24]  # two in the first tensor's 20 coordinates, one in the second
    plain = _step(None, sigma, clip=C)
    cc = _canaries(flat, [True, True, False], [[True, False, True]], C)
    with_c = _step(cc, sigma, clip=C)
    diff = (with_c - plain) * E  # back to the privatized sum's scale
    others = torch.ones_like(diff, dtype=torch.bool)
    others[flat] = False
    assert torch.equal(with_c[others], plain[others])  # the noise and the rest: bit for bit
    assert diff[3].item() == pytest.approx(C, abs=1e-5)  # sampled and included: C·e_j
    assert diff[21].item() == 0.0  # included, not sampled this step
    assert diff[24].item() == 0.0  # sampled, not included
    # the observation is the privatized sum (before ÷ q·n) at every canary coordinate
    obs = cc.result()["obs"]
    assert obs.shape == (1, 3)
    np.testing.assert_allclose(obs[0], (with_c[flat] * E).double().numpy(), rtol=1e-6)


def test_empty_batch_canary_still_contributes():
    C = 2.0
    cc = _canaries([0], [True], [[True]], C)
    g = _step(cc, 0.0, clip=C, batch=0)
    assert g[0].item() == pytest.approx(C / 4.0)
    assert torch.count_nonzero(g[1:]) == 0


def test_head_split_clip_with_canary():
    params = _params(2)
    head_cols = torch.zeros(27, dtype=torch.bool)
    head_cols[20:] = True
    dp = DpSgdParams(0.0, 1.0, 0.5, 2.0, head_share=0.3)
    clip_and_noise(params, dp, None, 6, head_cols)
    plain = torch.cat([p.grad.reshape(-1) for p in params])
    params = _params(2)
    clip_and_noise(params, dp, None, 6, head_cols, _canaries([22], [True], [[True]], 1.0))
    got = torch.cat([p.grad.reshape(-1) for p in params])
    assert (got - plain)[22].item() == pytest.approx(0.5, abs=1e-6)
    assert torch.equal(torch.cat([got[:22], got[23:]]), torch.cat([plain[:22], plain[23:]]))


# ------------------------------------------------------------- (b) not included: nothing


def test_non_included_canaries_change_nothing_in_a_step():
    plain = _step(None, 0.7, seed=3)
    cc = _canaries([0, 5, 26], [False] * 3, [[True, True, True]], 1.5)
    assert torch.equal(_step(cc, 0.7, seed=3), plain)
    assert cc.result()["obs"].shape == (1, 3)  # still observed


@pytest.mark.parametrize("method", ["fedavg", "fedask"])  # flat DP-SGD; FedASK's W-space
def test_non_included_canaries_leave_a_run_bit_exact(tmp_path, monkeypatch, method):
    from fl.run.engine import train

    # σ 3, not 1 (the PLDs at σ 1 were most of the time): bit-exactness is the same at any σ
    base = dict(method=method, noise_multiplier=3.0, delta=1e-5, rounds=1, local_steps=3)
    train(tiny_config(**base), tmp_path / "plain", quiet=True, noise_key=FIXED_KEY)
    built = []
    orig = G.GradientCanaries.for_engine.__func__

    def none_included(cls, engine):
        gc = orig(cls, engine)
        for c in gc.records:
            c["included"] = False
        built.append(gc)
        return gc

    monkeypatch.setattr(G.GradientCanaries, "for_engine", classmethod(none_included))
    cfg = tiny_config(**base, canaries=300, canary_kind="gradient")
    train(cfg, tmp_path / "canaries", quiet=True, noise_key=FIXED_KEY)
    assert built
    a = (tmp_path / "plain" / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (tmp_path / "canaries" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b
    p1 = json.loads((tmp_path / "plain" / "manifest.json").read_text())["privacy"]
    p2 = json.loads((tmp_path / "canaries" / "manifest.json").read_text())["privacy"]
    assert p1["ledger"] == p2["ledger"] and p1["epsilon"] == p2["epsilon"]
    assert p1["sample_rates"] == p2["sample_rates"]
    obs = G.read_observations(tmp_path / "canaries")
    assert len(obs) == 3 and all(o["obs"].shape[0] == 3 for o in obs)  # one per client
    if method == "fedask":
        assert all(o["space"] == "w" for o in obs)
        groups = {G.group_of(c["param"]) for c in built[0].records}
        assert groups == {"B", "head"}  # FedASK trains B and the head only


# ---------------------------------------------- (c) the bound: sound, and powerful at σ≈0


def _simulate(sigma: float, q: float, steps: int, m: int = 600, seed: int = 0):
    """Canaries through the real step function: a (steps × m) run of clip_and_noise on
    one parameter of m coordinates with data gradients, each coordinate a canary."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    coins = [rng.random(m) < q for _ in range(steps)]
    cc = _canaries(np.arange(m), included, coins, 1.0)
    src = R.SeededSource(seed, ("dpsgd-noise", 0, "0", "train"))
    dp = DpSgdParams(sigma, 1.0, q, 8.0 * q)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p = torch.nn.Parameter(torch.zeros(m))
        p.grad_sample = torch.randn(8, m, generator=g) * 0.01
        clip_and_noise([p], dp, src, batch_size=8, canaries=cc)
    rec = {**cc.result(), "sigma": sigma, "clip": 1.0, "q": q}
    records = [{"included": bool(b)} for b in included]
    return included, {st: GC.canary_scores(records, [rec], st) for st in GC.STATISTICS}


def test_without_noise_the_scores_separate_perfectly():
    inc, scores = _simulate(sigma=1e-4, q=0.5, steps=30)  # P(never sampled) = 2⁻³⁰
    for s in scores.values():
        assert s[inc].min() > s[~inc].max()
    lb = epsilon_one_run(scores["llr"], inc, 1e-5)["epsilon_lb"]
    assert lb > 3.0


@pytest.mark.parametrize("q", [1.0, 0.3])
def test_with_large_noise_the_bound_stays_below_the_ledger(q):
    sigma, steps, delta = 4.0, 6, 1e-5
    eps = accounting.epsilon(sigma, q, steps, delta)
    inc, scores = _simulate(sigma=sigma, q=q, steps=steps, m=2000, seed=1)
    for s in scores.values():
        assert epsilon_one_run(s, inc, delta)["epsilon_lb"] <= eps


def test_llr_is_the_linear_statistic_when_every_step_samples():
    u = np.random.default_rng(0).normal(size=(5, 7))
    np.testing.assert_allclose(
        GC.score_llr(u, 2.0, 1.0), GC.score_linear(u, 2.0) / 2.0 - 5 * 0.5 / 4.0
    )


# -------------------------------------------------- (d) a real run, audited: ε = 1, M = 2000


@pytest.fixture(scope="module")
def audited_run(tmp_path_factory):
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    # q = 1 (batch = the clients' 80 examples): the plain Gaussian, where the one-run
    # audit is strongest; σ for ε = 1 at δ = 1e-5 over 2 × 4 steps
    sigma = accounting.calibrate_noise(1.0, 1.0, 8, 1e-5)
    out = tmp_path_factory.mktemp("gc") / "run"
    cfg = tiny_config(
        noise_multiplier=sigma,
        delta=1e-5,
        batch_size=80,
        canaries=2000,
        canary_kind="gradient",
    )
    m = train(cfg, out, quiet=True, noise_key=FIXED_KEY)
    return out, m, audit_run(out, one_run=True)


def test_audit_of_a_real_run_is_sound_and_not_vacuous(audited_run):
    out, m, res = audited_run
    one = res["one_run"]
    eps = res["epsilon_pld"]
    assert eps == pytest.approx(1.0, abs=0.02)
    assert one["kind"] == "gradient" and one["statistic"] == "llr"
    assert one["m"] == 2000 and one["observations"]["files"] == 6
    assert 0.0 < one["epsilon_lb"] <= eps
    assert not one["claim_check"]["exceeds"]
    assert "empirical_exceeds_claim" not in {f["code"] for f in res["findings"]}
    print(f"gradient canaries, ε = {eps:.3f}: one-run ε_lb = {one['epsilon_lb']:.3f}")


def test_canary_set_is_recorded_for_the_operator(audited_run):
    out, m, _ = audited_run
    cans = json.loads((out / "splits.json").read_text())["canaries"]
    assert len(cans) == 2000
    keys = {(c["param"], c["index"]) for c in cans}
    assert len(keys) == 2000  # never two canaries on one coordinate
    assert all(c["kind"] == "gradient" and c["client"] in ("0", "1", "2") for c in cans)
    # stratified: the head's 130 coordinates all taken (min(M/3, 130)), A and B share the rest
    groups = [G.group_of(c["param"]) for c in cans]
    assert groups.count("head") == 130 and groups.count("A") + groups.count("B") == 1870
    assert abs(groups.count("A") - groups.count("B")) <= 1  # 1024 coordinates each
    priv = out / "private" / G.OBS_DIR
    assert (priv.stat().st_mode & 0o077) == 0 and ((out / "private").stat().st_mode & 0o077) == 0


# ----------------------------------------------- (e) from the key only, never released


def test_release_bundle_holds_no_canary_information(audited_run):
    out, m, _ = audited_run
    cans = json.loads((out / "splits.json").read_text())["canaries"]
    rel = out / "release"
    names = [p.relative_to(rel).as_posix() for p in rel.rglob("*") if p.is_file()]
    assert not any("canary" in n or n.endswith(".npz") or "private" in n for n in names)
    text = "".join(
        (rel / n).read_text(encoding="utf-8", errors="ignore")
        for n in names
        if not n.endswith(".safetensors")
    )
    assert "canary:" not in text and "canary_observations" not in text
    assert not any(c["param"] in text for c in cans[:50])


def test_canary_set_comes_from_the_key_not_the_seed():
    lora, head = [("factors/x/A", 300), ("factors/x/B", 200)], [("head/w", 50)]

    def make(key):
        rand = R.RunRandomness(key, seed=0)
        return G.make_canary_set(rand, 100, ["0", "1"], lora, head)

    a, b = make(R.NoiseKey(bytes(32))), make(R.NoiseKey(bytes([1]) * 32))
    assert a == make(R.NoiseKey(bytes(32)))  # a function of the key
    assert [c["included"] for c in a] != [c["included"] for c in b]
    assert [(c["param"], c["index"]) for c in a] != [(c["param"], c["index"]) for c in b]


def test_coordinates_are_stratified_over_the_trained_groups():
    lora = [("factors/x/A", 30), ("factors/x/B", 20), ("factors/y/A", 10)]
    head = [("head/w", 10), ("head/b", 2)]
    rand = R.RunRandomness(FIXED_KEY, seed=0)
    cs = G.make_canary_set(rand, 30, ["0"], lora, head)
    groups = [G.group_of(c["param"]) for c in cs]
    # at least min(M/G, size) = min(10, size) each, the rest in proportion to the sizes
    assert groups.count("head") == 10 and groups.count("B") == 10 and groups.count("A") == 10
    assert len({(c["param"], c["index"]) for c in cs}) == 30
    assert all(0 <= c["index"] < dict(lora + head)[c["param"]] for c in cs)
    full = G.make_canary_set(R.RunRandomness(FIXED_KEY, seed=0), 72, ["0"], lora, head)
    assert len({(c["param"], c["index"]) for c in full}) == 72  # every coordinate
    with pytest.raises(UsageError, match="72"):
        G.make_canary_set(R.RunRandomness(FIXED_KEY, seed=0), 73, ["0"], lora, head)


@pytest.mark.parametrize(
    "m, sizes, want",
    [
        (5000, [4096, 4096, 130], [2435, 2435, 130]),
        (30, [40, 20, 12], [10, 10, 10]),
        (60, [40, 20, 12], [28, 20, 12]),
        (7, [1, 100], [1, 6]),
        (3, [1, 1, 1], [1, 1, 1]),
    ],
)
def test_allocation_is_proportional_with_a_floor(m, sizes, want):
    got = G.allocate(m, sizes)
    assert got == want and sum(got) == m
    assert all(k >= min(m / len(sizes), n) - 1 for k, n in zip(got, sizes))


# ----------------------------------------------------------------- validation


def test_validation():
    with pytest.raises(UsageError, match="dp-level sample"):
        tiny_config(canaries=5, canary_kind="gradient").validate()
    with pytest.raises(UsageError, match="dp-level sample"):
        tiny_config(
            canaries=5, canary_kind="gradient", dp_level="client", noise_multiplier=1.0
        ).validate()
    with pytest.raises(UsageError, match="inprocess"):
        tiny_config(
            canaries=5, canary_kind="gradient", noise_multiplier=1.0, transport="flower"
        ).validate()
    tiny_config(canaries=5, canary_kind="gradient", noise_multiplier=1.0).validate()


def test_too_many_canaries_refused_at_setup(tmp_path):
    from fl.run.engine import Engine

    cfg = tiny_config(noise_multiplier=1.0, canaries=2179, canary_kind="gradient")
    eng = Engine(cfg, tmp_path / "run", quiet=True)
    eng.prepare_out()
    with pytest.raises(UsageError, match="2178"):
        eng.setup()


def test_score_of_a_never_observed_canary_is_zero():
    recs = [{"included": True}, {"included": False}]
    ob = {"ids": np.array([1]), "obs": np.array([[2.0], [1.0]]), "sigma": 1.0, "clip": 2.0}
    ob["q"] = 1.0
    s = GC.canary_scores(recs, [ob], "linear")
    assert s[0] == 0.0 and s[1] == pytest.approx(1.5)
    assert math.isfinite(GC.canary_scores(recs, [ob], "llr")[1])
