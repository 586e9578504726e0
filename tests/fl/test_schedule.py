"""The learning-rate schedule across rounds (``lr_schedule``) and head-only warm-up rounds
(``head_warmup_rounds``): closed forms, what each round trains, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from fl.errors import UsageError
from fl.methods.rounds import RoundInfo
from fl.models import factors as F
from fl.run.contexts import ClientContext
from fl.testing import tiny_config


def test_cosine_scale_closed_form():
    cfg = tiny_config(rounds=4, lr_schedule="cosine")
    want = [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2]
    assert [cfg.lr_scale(r) for r in range(4)] == pytest.approx(want, abs=1e-12)
    assert [tiny_config(rounds=4).lr_scale(r) for r in range(4)] == [1.0] * 4


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(rounds=3, head_warmup_rounds=3), "head_warmup_rounds must be in"),
        (dict(head_warmup_rounds=-1), "head_warmup_rounds must be in"),
        (dict(lr_schedule="linear"), "lr_schedule"),
    ],
)
def test_bad_schedule_settings_are_refused(bad, match):
    with pytest.raises(UsageError, match=match):
        tiny_config(**bad).validate()


def test_warmup_is_refused_for_methods_that_refactorize(small_engine):
    with pytest.raises(UsageError, match="head_warmup_rounds: method 'flexlora'"):
        small_engine("wu-flex", method="flexlora", rounds=2, head_warmup_rounds=1)


def _delta(start: dict, state: dict) -> dict[str, torch.Tensor]:
    a, b = F.flatten_state(start), F.flatten_state(state)
    return {k: b[k] - a[k] for k in a}


@pytest.fixture(scope="module")
def sched_engine(small_engine):
    # SGD, so that one step's update is exactly -lr · grad; DP-SGD, so that the
    # privatizer's path (per-example clip, noise) is the one under test
    return small_engine(
        "sched",
        method="fedavg",
        optimizer="sgd",
        rounds=4,
        local_steps=1,
        lr_schedule="cosine",
        head_warmup_rounds=1,
        head_lr=0.2,
        noise_multiplier=0.5,
        dp_level="sample",
    )


def _train(eng, rnd: int, start: dict):
    ctx = ClientContext(eng, "0", RoundInfo(rnd, 99, ["0"]))
    return ctx, ctx.train(start)


def _start(eng) -> dict:
    start = eng.trainer.initial_state()
    g = torch.Generator().manual_seed(5)
    for ab in start["factors"].values():  # non-zero B, so that A gets gradients too
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    return start


def test_warmup_round_trains_the_head_alone(sched_engine):
    start = _start(sched_engine)
    _, res = _train(sched_engine, 0, start)
    d = _delta(start, res.state)
    assert all(float(v.abs().max()) == 0.0 for k, v in d.items() if k.startswith("factors/"))
    assert any(float(v.abs().max()) > 0.0 for k, v in d.items() if k.startswith("head/"))
    _, res = _train(sched_engine, 1, start)  # after the warm-up: the factors train too
    d = _delta(start, res.state)
    for which in ("A", "B"):
        assert any(float(v.abs().max()) > 0.0 for k, v in d.items() if k.endswith(f"/{which}")), (
            which
        )


def test_each_round_steps_at_its_scaled_lr(sched_engine):
    """With SGD and one step the update is -lr · scale(r) · g, where g (the clipped,
    noised gradient) depends on the round only through its seeds: the same round index
    with the schedule off gives g · lr, so the ratio of the two updates is scale(r)."""
    eng = sched_engine
    eng.rand.refuse_reuse = False  # the reference replays each round's noise on purpose
    start = _start(eng)
    for rnd in (1, 2, 3):
        ctx, res = _train(eng, rnd, start)
        scale = eng.cfg.lr_scale(rnd)
        assert eng.trainer.lr_scale == scale
        assert ctx.lr_of("head/w") == pytest.approx(0.2 * scale)  # SCAFFOLD's view
        assert ctx.lr_of("factors/x/A") == pytest.approx(eng.cfg.lr * scale)
        eng.cfg.lr_schedule = "constant"
        try:
            _, ref = _train(eng, rnd, start)
        finally:
            eng.cfg.lr_schedule = "cosine"
        d, d_ref = _delta(start, res.state), _delta(start, ref.state)
        moved = [k for k in d_ref if float(d_ref[k].abs().max()) > 0]
        assert any(k.startswith("factors/") for k in moved)
        for k in moved:
            torch.testing.assert_close(d[k], scale * d_ref[k], rtol=1e-4, atol=1e-7)


def test_a_warmup_run_with_kept_optimizer_state_trains_and_records_both(tmp_path):
    """``--no-reset-optimizer``: the head-only optimizer state is dropped when the
    factors join (its groups differ); the manifest records both settings."""
    from fl.run.engine import train

    # ε = 2, not 8: σ ≈ 1.3 rather than 0.7, a smaller PLD at each calibration step and
    # each round's budget check; the schedule, not the target, is what is tested
    man = train(
        tiny_config(
            method="fedavg",
            rounds=3,
            head_warmup_rounds=1,
            lr_schedule="cosine",
            reset_optimizer=False,
            epsilon=2.0,
        ),
        tmp_path / "run",
        quiet=True,
    )
    assert man["model"]["lr_schedule"] == "cosine"
    assert man["model"]["head_warmup_rounds"] == 1
    assert man["privacy"]["epsilon"]["pld"] <= 2.0 + 1e-6
