"""The two-sided clip test (audit.bounds.contribution.clip_contribution_test) on the engine's
own step (fl.privacy.dpsgd.clip_and_noise with its gradient canaries,
fl.privacy.gradient_canaries.ClientCanaries): per-example data gradients that are NOT zero at
the canaries' coordinates (large, drifting, heavy-tailed), Poisson batches, the real noise
code. A correct step passes at q in {1, 0.25, 0.05}; the planted fault no_clip (a canary adds
K·C) is rejected at each q; the family (audit.bundle.conformance) holds the test and names
it."""

import math

import numpy as np
import pytest
import torch

from audit.bounds.conformance import Block, conformance
from audit.bounds.contribution import clip_contribution_test
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, StepFault, clip_and_noise
from fl.privacy.gradient_canaries import ClientCanaries

D, M, N = 600, 200, 40  # coordinates, canaries, records of the client


def _engine_block(q: float, fault: bool, seed: int, steps: int) -> Block:
    """``steps`` DP-SGD steps of one client through the engine's clip_and_noise, its
    canaries observed as the engine observes them; the block the run audit builds."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(D))
    flat = torch.as_tensor(rng.choice(D, M, replace=False), dtype=torch.long)
    included = rng.random(M) < 0.5
    coins = [rng.random(M) < q for _ in range(steps)]
    cc = ClientCanaries(np.arange(M), flat, included, coins, clip=1.0, meta={})
    dp = DpSgdParams(noise_multiplier=0.9, clip=1.0, sample_rate=q, expected_batch=q * N)
    base = torch.as_tensor(rng.standard_t(3, size=(N, D)), dtype=torch.float32)
    for t in range(steps):
        batch = torch.nonzero(torch.rand(N) < q).flatten()
        g = base[batch] * (1 + 0.05 * t) + 0.3 * torch.randn(len(batch), D)
        p.grad_sample = g
        fault_t = StepFault(no_clip=True) if fault else None
        src = R.SeededSource(seed, ("noise", t))
        clip_and_noise([p], dp, src, len(batch), canaries=cc, fault=fault_t)
    obs = cc.result()["obs"]
    return Block(
        u=obs / dp.clip,
        tracks=np.arange(M),
        groups=np.array(["A"] * M),
        sigma=dp.noise_multiplier,
        included=included,
        coins=np.stack(coins),
        q=q,
    )


@pytest.mark.parametrize("q,steps", [(1.0, 4), (0.25, 8), (0.05, 12)])
def test_engine_step_correct_passes_and_no_clip_is_rejected(q, steps):
    ok = _engine_block(q, False, seed=11, steps=steps)
    (t,) = clip_contribution_test([ok])
    assert t.test == "contribution" and t.group == "A"
    assert t.log10_p > math.log10(0.05), t  # the data at the coordinates are not zero
    bad = _engine_block(q, True, seed=11, steps=steps)
    (tb,) = clip_contribution_test([bad])
    assert tb.statistic > 20 and tb.log10_p < -10, tb  # a drawn canary adds K·C = 100·C
    res = conformance([bad], extra=(tb,))
    assert "A:contribution" in res.to_dict()["rejected"]


def _sim(seed, *, q, T=30, m=150, sigma=0.8, fault=None):
    """A block whose data add a large, drifting, heavy-tailed term that reacts to the past
    noise at every canary coordinate; ``fault``: "batch" (the batch sum clipped: the drawn
    canaries share one clip and the data vanish when one is drawn) or "half" (a canary adds
    C/2)."""
    rng = np.random.default_rng(seed)
    inc = rng.random(m) < 0.5
    coins = rng.random((T, m)) < q
    v = (coins & inc).astype(float)
    z = rng.normal(0, sigma, (T, m))
    base = rng.standard_t(3, m) * 2
    D_ = np.stack([base * (1 + 0.03 * t) + (0.5 * z[t - 1] if t else 0) for t in range(T)])
    if fault == "batch":
        nd = v.sum(1, keepdims=True)
        u = np.where(nd > 0, 0.0, D_) + v / np.sqrt(np.maximum(nd, 1)) + z
    elif fault == "half":
        u = D_ + 0.5 * v + z
    else:
        u = D_ + v + z
    g = np.array(["g"] * m)
    return Block(u=u, tracks=np.arange(m), groups=g, sigma=sigma, included=inc, coins=coins, q=q)


def test_false_alarms_over_correct_runs_of_the_statistic():
    """120 simulated correct runs (data far from zero at the coordinates): no p-value under
    0.01 (Ville's bound is conservative; the level would allow 1.2)."""
    logs = [clip_contribution_test([_sim(s, q=q)])[0].log10_p for s in range(60) for q in (0.05, 1)]
    assert len(logs) == 120 and min(logs) > -2


@pytest.mark.parametrize("fault", ["batch", "half"])
def test_a_canary_adding_less_than_c_is_rejected(fault):
    (t,) = clip_contribution_test([_sim(1, q=0.1, T=60, m=300, fault=fault)])
    assert t.statistic < 0.75 and t.log10_p < -4, t


def test_without_coins_nothing_is_tested():
    b = _sim(2, q=0.1)
    nb = Block(u=b.u, tracks=b.tracks, groups=b.groups, sigma=b.sigma, included=b.included)
    assert clip_contribution_test([nb]) == ()


def test_the_verdict_table_names_a_rejected_contribution_test():
    from audit.report.verdict_table import rejected_text

    c = {"tests": [{"group": "B", "test": "contribution", "rejected": True, "statistic": 0.31}]}
    assert rejected_text(c) == "B contribution: a drawn canary does not add exactly C (0.31·C)"
