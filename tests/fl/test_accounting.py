import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from fl.privacy.accounting import (
    Event,
    PrivacyError,
    calibrate_noise,
    epsilon,
    epsilon_of_events,
)
from fl.privacy.ledger import Ledger


def direct(sigma, q, steps, delta, acc):
    ev = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    a = pld.PLDAccountant() if acc == "pld" else rdp.RdpAccountant()
    a.compose(ev)
    return a.get_epsilon(delta)


@pytest.mark.parametrize("acc", ["pld", "rdp"])
def test_epsilon_matches_dp_accounting(acc):
    for sigma, q, steps in [(1.0, 0.01, 1000), (0.8, 0.1, 50), (2.0, 0.5, 10)]:
        ours = epsilon(sigma, q, steps, 1e-5, acc)
        ref = direct(sigma, q, steps, 1e-5, acc)
        assert ours == pytest.approx(ref, rel=1e-9)


def test_ledger_composes_rounds_and_takes_max_over_units():
    # σ = 2, not 1: each PLD (four here) is a third of the size; the composition and the
    # maximum over units are what is tested, at any σ
    led = Ledger("sample", 1e-5)
    for r in range(3):
        led.record(Event("poisson_gaussian", 2.0, 0.05, 20, unit="client:0", round=r))
    led.record(Event("poisson_gaussian", 2.0, 0.05, 20, unit="client:1", round=0))
    # client 0 took part 3 times: 60 steps; client 1 once: 20 steps.
    assert led.epsilon("pld") == pytest.approx(direct(2.0, 0.05, 60, 1e-5, "pld"), rel=1e-9)
    by = led.epsilon_by_unit("pld")
    assert by["client:1"] == pytest.approx(direct(2.0, 0.05, 20, 1e-5, "pld"), rel=1e-9)
    assert by["client:0"] > by["client:1"]


def test_ledger_mixed_mechanisms_equal_direct_composition():
    # the first at σ = 1.5, not 1 (its PLD, the largest of the three, is half the size);
    # three distinct mechanisms still compose
    evs = [
        Event("poisson_gaussian", 1.5, 0.05, 20, unit="u"),
        Event("poisson_gaussian", 2.0, 0.1, 5, unit="u"),
        Event("gaussian", 3.0, 1.0, 2, unit="u"),
    ]
    a = pld.PLDAccountant()
    a.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.5)),
                    20,
                ),
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(2.0)), 5
                ),
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 2),
            ]
        )
    )
    assert epsilon_of_events(evs, 1e-5) == pytest.approx(a.get_epsilon(1e-5), rel=1e-6)


def test_zero_noise_is_infinite_epsilon():
    assert math.isinf(epsilon(0.0, 0.1, 10, 1e-5))
    led = Ledger("sample", 1e-5)
    led.record(Event("poisson_gaussian", 1.0, 0.1, 10, unit="a"))
    led.record(Event("poisson_gaussian", 0.0, 0.1, 1, unit="a"))
    assert math.isinf(led.epsilon())


def test_ledger_round_trip_and_validation():
    led = Ledger("client", 1e-6, budget=3.0)
    led.record(Event("gaussian", 1.5, 1.0, 3, unit="federation", round=0, stage="agg"))
    assert led.state_dict()["neighbouring"] == "add/remove one client"
    back = Ledger.from_state_dict(led.state_dict())
    assert back.epsilon() == led.epsilon()
    assert back.events == led.events
    with pytest.raises(PrivacyError, match="missing field"):
        Ledger.from_state_dict(
            {"version": 1, "level": "sample", "delta": 1e-5, "events": [{"kind": "gaussian"}]}
        )
    with pytest.raises(PrivacyError, match="version"):
        Ledger.from_state_dict({"version": 99})


def test_would_exceed_is_non_mutating():
    led = Ledger("sample", 1e-5, budget=1.0)
    big = [Event("poisson_gaussian", 1.0, 0.5, 10, unit="c")]  # ε ≈ 10.5, ten times the budget
    assert led.would_exceed(big)
    assert led.events == []
    assert not led.would_exceed([Event("poisson_gaussian", 10.0, 0.01, 1, unit="c")])


@pytest.mark.parametrize(
    "bad",
    [
        dict(noise_multiplier=-1.0),
        dict(noise_multiplier=float("nan")),
        dict(sample_rate=0.0),
        dict(sample_rate=1.5),
    ],
)
def test_invalid_event_parameters(bad):
    kw = dict(kind="poisson_gaussian", noise_multiplier=1.0, sample_rate=0.1, count=1, unit="u")
    kw.update(bad)
    with pytest.raises(PrivacyError):
        Event(**kw)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, float("nan")])
def test_invalid_delta(delta):
    with pytest.raises(PrivacyError, match="delta"):
        epsilon(1.0, 0.1, 10, delta)


def test_invalid_target_epsilon():
    for e in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(PrivacyError):
            calibrate_noise(e, 0.1, 10, 1e-5)


@settings(max_examples=6, deadline=None)
@given(
    target=st.floats(0.5, 20.0),
    q=st.floats(0.005, 1.0),
    steps=st.integers(1, 120),
    acc=st.sampled_from(["pld", "rdp"]),
)
def test_calibrated_sigma_never_overshoots(target, q, steps, acc):
    sigma = calibrate_noise(target, q, steps, 1e-5, acc)
    achieved = epsilon(sigma, q, steps, 1e-5, acc)
    assert achieved <= target
    # ... and is tight: 2% less noise would overshoot (unless at the search floor).
    if sigma > 2e-4:
        assert epsilon(sigma * 0.98, q, steps, 1e-5, acc) > target


@pytest.mark.parametrize(
    "name,sigma,text",
    [
        ("minilm-tweets-dp.toml", 0.8989, "σ = 0.899"),
        ("minilm-tweets-probe.toml", 2.283, "σ = 2.28"),
        ("minilm-tweets-dp-top1.toml", 2.283, "σ = 2.28"),
    ],
)
def test_shipped_dp_recipe_parses_and_calibrates_to_its_stated_sigma(name, sigma, text):
    """The recipes in configs/ are valid TrainConfigs, and ε = 8 over their rounds × steps
    at q = B / (members / clients) calibrates to the σ their comments state."""
    from pathlib import Path

    from fl.privacy.accounting import calibrate_noise
    from fl.run.config import TrainConfig, load_toml

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = TrainConfig(**load_toml(str(path)), epsilon=8.0)
    cfg.validate()
    assert cfg.dp_level == "sample"  # --epsilon alone means sample level
    per_client = cfg.members // cfg.clients
    q = cfg.batch_size / per_client
    got = calibrate_noise(8.0, q, cfg.rounds * cfg.local_steps, 1e-5)
    assert got == pytest.approx(sigma, abs=5e-4)
    assert text in path.read_text(encoding="utf-8")
