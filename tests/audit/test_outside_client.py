"""Canary clients at an outside server (audit.canaries.client_hook.ClientCanaryHook): the numpy core
against direct computations, the Flower wrapper in process (no network), and the audit of
a correct and a faulted server loop."""

import json

import numpy as np
import pytest

from audit.canaries import canary_set as CS
from audit.canaries import outside as O
from audit.canaries.client_hook import ClientCanaryHook
from audit.claims.check import check_claim


def _directions(out, m, d):
    """Unit directions (M, d) straight from directions.npz."""
    with np.load(out / "directions.npz") as z:
        if str(z["mode"]) == "isotropic":
            return z["dirs"].astype(np.float64)
        u = np.zeros((m, d))
        for j in range(m):
            u[j, z["support"][j]] = z["signs"][j]
        return u


@pytest.mark.parametrize("m, d", [(50, 300), (400, 300)])  # disjoint supports, isotropic
def test_numpy_core_matches_direct(m, d, tmp_path):
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=0.5, dim=d)
    hook = ClientCanaryHook.load(out)
    u = _directions(out, m, d)
    np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, rtol=1e-6)
    bits = np.array(json.loads((out / "private" / "inclusion.json").read_text())["included"])
    np.testing.assert_allclose(hook.contribution(1), 0.5 * u[bits == 1].sum(0), atol=1e-6)
    v = np.random.default_rng(0).normal(size=d)
    hook.observe(1, v, sigma=1.0, clip=0.5, clients_per_round=3)
    hook.observe(2, 2 * v, sigma=1.0, clip=0.5, clients_per_round=3)
    o = hook.observations()
    np.testing.assert_allclose(o["inner"], np.stack([u @ v, u @ (2 * v)]), atol=1e-6)
    np.testing.assert_allclose(o["norms"], [np.linalg.norm(v), 2 * np.linalg.norm(v)])
    np.testing.assert_allclose(o["final_inner"], u @ (3 * v), atol=1e-6)


def test_poisson_participation_uses_keyed_coins(tmp_path):
    from fl.privacy import rng as R

    out = CS.new_canary_set(
        "client", 200, tmp_path / "set", clip=1.0, dim=1000, participation="poisson", rate=0.25
    )
    hook = ClientCanaryHook.load(out)
    key = R.NoiseKey.read(out / "private" / "noise.key")
    for r in (1, 2):
        coins = key.stream("canary-client-coins", r).uniform(200).numpy() < 0.25
        assert np.array_equal(hook.taking_part(r), np.flatnonzero(coins & hook.included))


@pytest.fixture
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = old


class _Grid:  # what FedAvg.configure_train asks of a grid
    def get_node_ids(self):
        return [1, 2, 3]


def test_flower_wrapper_in_process(task_identity, tmp_path):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    shapes = [(4, 5), (7,)]
    d, m_clients, clip = 27, 3, 0.5
    out = CS.new_canary_set("client", 6, tmp_path / "set", clip=clip, dim=d)
    hook = ClientCanaryHook.load(out)
    u = _directions(out, 6, d)
    inner = FedAvg(fraction_train=1.0, min_available_nodes=3, min_train_nodes=3)
    dp = DifferentialPrivacyServerSideFixedClipping(inner, 0.0, clip, m_clients)  # σ = 0: exact
    assert hook.attach_flower(dp) is dp
    rng = np.random.default_rng(1)
    glob = [rng.normal(size=s).astype(np.float32) for s in shapes]
    for rnd in (1, 2):
        msgs = list(dp.configure_train(rnd, ArrayRecord(glob), ConfigRecord({}), _Grid()))
        ups = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in msgs]
        replies = [
            Message(RecordDict({"arrays": ArrayRecord([g + x for g, x in zip(glob, up)]),
                                "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)
            for msg, up in zip(msgs, ups)
        ]  # fmt: skip
        arrays, _ = dp.aggregate_train(rnd, replies)
        new = arrays.to_numpy_ndarrays()
        # what the server should release at σ = 0: mean of the clipped updates + Σ canaries / m
        flat = [np.concatenate([x.reshape(-1) for x in up]).astype(np.float64) for up in ups]
        clipped = [f * min(1.0, clip / np.linalg.norm(f)) for f in flat]
        want = sum(clipped) / m_clients + hook.contribution(rnd) / m_clients
        delta = np.concatenate([(a - b).reshape(-1) for a, b in zip(new, glob)]).astype(np.float64)
        np.testing.assert_allclose(delta, want, atol=1e-5)
        np.testing.assert_allclose(hook.inner[-1], u @ delta, atol=1e-5)
        glob = new
    o = hook.observations()
    assert o["clients_per_round"] == 3 and o["clip"] == clip and o["sigma"] == 0.0
    assert list(o["rounds"]) == [1, 2]


@pytest.mark.parametrize(
    # correct: incomplete — the canary clients enter after the server's clip, so the clip
    # itself is not exercised (clipping untested), never "ok"
    "server_sigma, verdict",
    [(2.0, "incomplete"), (0.5, "does not implement its claim")],
)
def test_flower_conformance(server_sigma, verdict, task_identity, tmp_path):
    """The Flower wrapper's observations in the tests' units (⟨ĉ_j, Δ_r⟩·m/C: noise
    N(0, σ²)): a server at the claimed σ = 2 conforms; one at σ = 0.5 is a mismatch at
    about ¼ of the claimed noise, whatever σ its file states."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    from fl.privacy.rng import NoiseKey

    shapes = [(40, 50)]
    d, m_clients, clip, sigma, rounds, M = 2000, 3, 0.5, 2.0, 5, 400
    (tmp_path / "k").mkdir()
    kp = NoiseKey(bytes(range(1, 33))).write(tmp_path / "k")  # fixed: reproducible
    out = CS.new_canary_set("client", M, tmp_path / "set", clip=clip, dim=d, key_file=kp)
    hook = ClientCanaryHook.load(out, key_file=kp)
    inner = FedAvg(fraction_train=1.0, min_available_nodes=3, min_train_nodes=3)
    wrapper = DifferentialPrivacyServerSideFixedClipping(inner, server_sigma, clip, m_clients)
    hook.attach_flower(wrapper)
    state = np.random.get_state()
    np.random.seed(7)  # Flower draws its noise from numpy's global generator
    try:
        rng = np.random.default_rng(1)
        glob = [rng.normal(size=s).astype(np.float32) for s in shapes]
        for rnd in range(1, rounds + 1):
            msgs = list(wrapper.configure_train(rnd, ArrayRecord(glob), ConfigRecord({}), _Grid()))
            ups = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in msgs]
            replies = [
                Message(RecordDict({"arrays": ArrayRecord([g + x for g, x in zip(glob, up)]),
                                    "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)
                for msg, up in zip(msgs, ups)
            ]  # fmt: skip
            arrays, _ = wrapper.aggregate_train(rnd, replies)
            glob = arrays.to_numpy_ndarrays()
    finally:
        np.random.set_state(state)
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = dict(level="client", noise_multiplier=sigma, clipping_norm=clip, sampling="all",
                 rounds=rounds, clients_per_round=m_clients, total_clients=m_clients,
                 claimed_epsilon=100.0, delta=1e-5, noise_source="csprng")  # fmt: skip
    res = O.audit_outside(out, obs, claim, key_file=kp)
    c = res["conformance"]
    assert res["verdict"] == verdict and c["sigma"] == sigma, c["rejected"]
    (scale,) = [t for t in c["tests"] if t["test"] == "scale"]
    assert abs(scale["observed_over_claimed"] - server_sigma / sigma) < 0.06 * server_sigma / sigma
    if server_sigma != sigma:
        assert any(f["code"] == "stated_sigma_differs" for f in res["findings"])


def _server_loop(hook, *, rounds, clients, d, clip, sigma, noise_scale, seed):
    """A numpy DP-FedAvg server: clipped client updates, canaries in the sum, Gaussian
    noise σC (× ``noise_scale``: a planted fault), divided by the m clients."""
    rng = np.random.default_rng(seed)
    for r in range(1, rounds + 1):
        ups = rng.normal(size=(clients, d)) * 0.01
        ups *= np.minimum(1.0, clip / np.linalg.norm(ups, axis=1))[:, None]
        s = ups.sum(0) + hook.contribution(r)
        s += rng.normal(size=d) * sigma * clip * noise_scale
        hook.observe(r, s / clients, sigma=sigma, clip=clip, clients_per_round=clients)


@pytest.mark.parametrize(
    "noise_scale, verdict", [(1.0, "incomplete"), (0.0, "does not implement its claim")]
)
def test_client_audit(noise_scale, verdict, tmp_path):
    from fl.privacy.rng import NoiseKey

    m, d, clip, sigma, rounds, clients = 2000, 20000, 0.5, 4.0, 3, 10
    # a fixed key as well as a fixed server seed: the audit's outcome is reproducible (each
    # of its tests has a false-alarm rate <= α over keys and noise)
    (tmp_path / "k").mkdir()
    kp = NoiseKey(bytes(range(32))).write(tmp_path / "k")
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=clip, dim=d, key_file=kp)
    hook = ClientCanaryHook.load(out, key_file=kp)
    _server_loop(hook, rounds=rounds, clients=clients, d=d, clip=clip, sigma=sigma,
                 noise_scale=noise_scale, seed=2)  # fmt: skip
    obs = hook.write_observations(tmp_path / "obs.npz")
    claim = dict(level="client", noise_multiplier=sigma, clipping_norm=clip, sampling="all",
                 rounds=rounds, clients_per_round=clients, total_clients=clients,
                 claimed_epsilon=1.0, delta=1e-5, noise_source="keyed_csprng")  # fmt: skip
    claim["claimed_epsilon"] = check_claim(claim)["epsilon_pld"]
    res = O.audit_outside(out, obs, claim, key_file=kp)
    assert res["verdict"] == verdict, (res["epsilon_lb"], res["conformance"]["rejected"])
    if verdict == "incomplete":
        assert res["coverage"]["untested"] == ["clipping"]
    assert res["relation"].startswith("a canary client is one client")
    est = res["estimate"]["all_iterates"]
    assert est["kind"] == "estimate"
    if noise_scale == 1.0:
        # Andrew et al.'s estimate is near the claim (ε ≈ 1.5 here), the bound below it
        assert 0.5 * claim["claimed_epsilon"] < est["epsilon"] < 1.5 * claim["claimed_epsilon"]
        assert res["epsilon_lb"] <= claim["claimed_epsilon"]
    else:  # no noise: the conformance tests say so first, the one-run bound leaks too
        assert res["leaks_more_than_claimed"] and not res["conformance"]["passed"]
    # a claim whose participation does not match the canaries' is refused
    bad = dict(claim, sampling="poisson", clients_per_round=10, total_clients=20)
    with pytest.raises(O.UsageError, match="every round"):
        O.audit_outside(out, obs, bad, key_file=kp)
    # a σ the file states otherwise is a finding (the hook's σ = 4 above a claimed 2: a
    # warning), not a refusal; the tests use the claim's σ
    res2 = O.audit_outside(out, obs, dict(claim, noise_multiplier=2.0), key_file=kp)
    (f,) = [f for f in res2["findings"] if f["code"] == "stated_sigma_differs"]
    assert f["severity"] == "warning" and "σ = 4" in f["message"]
    assert "noise_multiplier = 2" in f["message"] and res2["conformance"]["sigma"] == 2.0
