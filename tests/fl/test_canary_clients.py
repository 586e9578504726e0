"""Canary clients for client-level DP (fl.privacy.canary_clients): what they add to the
clipped sum, that nothing else changes, and which runs refuse them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fl.errors import UsageError
from fl.methods.fedavg import FedAvg, FedAvgOptions
from fl.methods.fedpower import server_aggregate
from fl.methods.rounds import Replies, RoundInfo
from fl.privacy import rng as R
from fl.privacy.canary_clients import FILE, CanaryClients, check_supported

C = 0.7
KEY = R.NoiseKey(bytes(range(32)))


def _state(seed: int, shift: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "factors": {
            f"l{i}": {
                "A": torch.randn(3, 6, generator=g) + shift,
                "B": torch.randn(5, 3, generator=g) + shift,
            }
            for i in range(2)
        },
        "head": {"w": torch.randn(2, 4, generator=g) + shift, "b": torch.randn(2, generator=g)},
    }


def _canaries(m=40, scheme="all", rate=1.0, method="fedavg") -> CanaryClients:
    rand = R.RunRandomness(KEY, seed=0)
    return CanaryClients(
        m, C, rand, None, method=method, scheme=scheme, rate=rate, rounds=3, sigma=0.0, delta=1e-5
    )


class _Server:
    """What ``client_level_dp_average`` reads of the ServerView, with σ = 0."""

    def __init__(self, canaries):
        self.dp_level, self.noise_multiplier, self.clip = "client", 0.0, C
        self.expected_clients_per_round = 2.0
        self.canary_clients = canaries
        self.released = []

    def noise_generator(self, rnd, purpose):
        return torch.Generator().manual_seed(0)

    def noise(self, shape, std, gen):
        return R.draw_normal(gen, shape, std)

    def record_client_level_release(self, rnd, stage, count=1, sigma=None):
        self.released.append((rnd.index, stage, count))

    def log(self, msg):
        pass


def _average(canaries, rnd=0):
    meth = FedAvg(_Server(canaries), FedAvgOptions())
    meth.init_state(_state(0))
    replies = Replies(ok={"a": {"state": _state(1), "n": 3}, "b": {"state": _state(2), "n": 5}})
    new, st = meth.client_level_dp_average(RoundInfo(rnd, 7, ["a", "b"]), replies)
    return meth, new, st


def _flat(state, names):
    from fl.models import factors as F

    flat = F.flatten_state(state)
    return torch.cat([flat[k].double().reshape(-1) for k in names])


def test_canary_contribution_is_exactly_its_norm_c_direction():
    cc = _canaries()
    meth, with_c, st = _average(cc)
    _, without, st0 = _average(None)
    names = cc._dense_set["names"]
    ids = cc.taking_part(0)
    assert 0 < ids.size < cc.m and np.array_equal(ids, np.flatnonzero(cc.included))
    ups = [
        u for chunk in cc.dense_update_chunks(names, cc._dense_set["shapes"], ids) for u in chunk
    ]
    flat = [torch.cat([t.double().reshape(-1) for t in u]) for u in ups]
    for v in flat:  # every canary update has norm C (so the clip leaves it as it is)
        assert float(v.norm()) == pytest.approx(C, rel=1e-6)
    # the released change is the clipped sum over m: the canaries' part is Σ_included c_j / m
    diff = (_flat(with_c, names) - _flat(without, names)) * 2.0
    assert torch.allclose(diff, torch.stack(flat).sum(0), atol=1e-6)
    # statistics (norms, clipped fraction) are the real clients'
    assert st == st0


def test_excluded_canaries_change_nothing_and_directions_are_orthogonal():
    cc = _canaries()
    _average(cc)
    names, shapes = cc._dense_set["names"], cc._dense_set["shapes"]
    every = [u for ch in cc.dense_update_chunks(names, shapes, np.arange(cc.m)) for u in ch]
    vec = torch.stack([torch.cat([t.double().reshape(-1) for t in u]) for u in every])
    gram = vec @ vec.T
    assert torch.allclose(gram, torch.eye(cc.m, dtype=torch.float64) * C * C, atol=1e-6)
    # no canary included: the release is the one without canaries, bit for bit
    cc2 = _canaries()
    cc2.included[:] = False
    _, new, _ = _average(cc2)
    _, ref, _ = _average(None)
    from fl.models import factors as F

    a, b = F.flatten_state(new), F.flatten_state(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_observation_recorded_for_every_canary():
    cc = _canaries()
    _average(cc)
    assert cc.observed[0] and not cc.observed[1:].any()
    cos = cc.cos_rounds[0]
    assert np.isfinite(cos).all() and np.all(np.abs(cos) <= 1 + 1e-9)
    # with σ = 0 and orthogonal canaries, the included ones correlate with the update
    assert cos[cc.included].mean() > cos[~cc.included].mean()


def test_poisson_participation_is_keyed_coins_per_round():
    cc = _canaries(m=400, scheme="poisson", rate=0.3)
    ids0, ids1 = cc.taking_part(0), cc.taking_part(1)
    assert set(ids0) <= set(np.flatnonzero(cc.included))
    assert not np.array_equal(ids0, ids1)
    assert 0.15 < ids0.size / cc.included.sum() < 0.45
    # the same key gives the same coins (a replay)
    again = _canaries(m=400, scheme="poisson", rate=0.3)
    assert np.array_equal(again.taking_part(0), ids0)
    assert np.array_equal(again.included, cc.included)


def test_fedpower_canary_is_at_both_clip_boundaries():
    cc = _canaries(m=6, method="fedpower")
    glob = _state(0)
    ids = np.arange(cc.m)
    states = cc.factored_states(glob, 2.0, ids, clip=C)
    res = server_aggregate(
        glob,
        states,
        [0.5] * len(states),
        scaling=2.0,
        rank=3,
        perturbation="none",
        clip=C,
        weight_bound=0.5,
    )
    assert torch.allclose(res.norms, torch.full((cc.m,), C, dtype=torch.float64), rtol=1e-5)
    for st in states:
        h = torch.cat(
            [(st["head"][k].double() - glob["head"][k].double()).reshape(-1) for k in st["head"]]
        )
        assert float(h.norm()) == pytest.approx(C, rel=1e-5)


def test_refusals():
    assert check_supported("fedavg", "client", "all", 0) == ""
    assert check_supported("ffa", "client", "poisson", 5) == "dense"
    assert check_supported("fedpower", "client", "all", 5) == "factored"
    with pytest.raises(UsageError, match="fedsa"):
        check_supported("fedsa", "client", "all", 5)
    with pytest.raises(UsageError, match="fixed-count"):
        check_supported("fedavg", "client", "uniform", 5)
    with pytest.raises(UsageError, match="dp-level client"):
        check_supported("fedavg", "sample", "all", 5)
    from fl.testing import tiny_config

    with pytest.raises(UsageError, match="dp-level client"):
        tiny_config(dp_level="sample", epsilon=3.0, canary_clients=5).validate()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from fl.run.engine import train
    from fl.testing import tiny_config

    base = dict(
        dp_level="client", epsilon=3.0, clients=3, members=60, local_steps=1, test=20, nonmembers=10
    )
    out = {}
    for name, extra in (("plain", {}), ("canary", {"canary_clients": 50})):
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train(tiny_config(**base, **extra), d, quiet=True, noise_key=KEY))
    return out


def test_run_with_canaries_keeps_the_ledger_and_files_private(runs):
    (dp, mp), (dc, mc) = runs["plain"], runs["canary"]
    assert not (dp / "private" / FILE).exists()
    assert (dc / "private" / FILE).exists()
    assert not list((dc / "release").rglob(FILE)) if (dc / "release").exists() else True
    for k in ("epsilon", "noise_multiplier", "ledger"):
        assert mp["privacy"][k] == mc["privacy"][k]
    from fl.privacy.canary_clients import read

    z = read(dc)
    assert z["observed"].all() and z["meta"]["space"] == "dense" and z["m"] == 50
    assert math.isclose(z["meta"]["canary_norm"], z["meta"]["clip"])
