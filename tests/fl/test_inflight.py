"""fl.run.inflight.decide: what resume charges for a journaled round, on hand-built journals."""

import pytest

from fl.privacy.accounting import Event
from fl.run.inflight import decide

ENV = {"torch": "t", "cpu_capability": "AVX2", "threads": 2, "machine": "x", "processor": "p"}


def _ev(unit, stage="local", rnd=4):
    return Event("poisson_gaussian", 1.5, 0.1, 20, unit=unit, round=rnd, stage=stage)


def _journal(**kw):
    doc = {
        "round": 4,
        "attempt": 0,
        "device": "cpu",
        "transport": "inprocess",
        "environment": dict(ENV),
        "planned": [_ev("client:0").to_dict(), _ev("client:1").to_dict()],
    }
    doc.update(kw)
    return doc


def test_bit_exact_replay_charges_nothing_and_keeps_the_attempt():
    res = decide(_journal(attempt=2), True, ENV, "sample")
    assert res.replay and res.attempt == 2 and res.charged == [] and res.round == 4


def test_other_environment_device_or_transport_charges_the_plan_as_a_new_attempt():
    other = dict(ENV, threads=3)
    for doc, here_exact, env in (
        (_journal(), True, other),  # another thread count
        (_journal(device="cuda"), True, ENV),  # journaled on a GPU
        (_journal(transport="flower"), True, ENV),  # over Flower
        (_journal(), False, ENV),  # this engine cannot replay (GPU or Flower now)
    ):
        res = decide(doc, here_exact, env, "sample")
        assert not res.replay and res.attempt == 1
        assert [(e.unit, e.round, e.stage) for e in res.charged] == [
            ("client:0", 4, "interrupted"),
            ("client:1", 4, "interrupted"),
        ]
        assert [(e.noise_multiplier, e.sample_rate, e.count) for e in res.charged] == [
            (1.5, 0.1, 20)
        ] * 2
    assert "environment differs" in decide(_journal(), True, other, "sample").message()


def test_a_journal_without_environment_is_judged_by_device_and_transport():
    doc = _journal()
    del doc["environment"]
    assert decide(doc, True, ENV, "sample").replay
    assert not decide(dict(doc, device="cuda"), True, ENV, "sample").replay


def test_earlier_attempts_charges_are_carried_in_both_branches():
    earlier = [_ev("client:0", "interrupted").to_dict()]
    replay = decide(_journal(attempt=1, charged=earlier), True, ENV, "sample")
    assert replay.replay and [e.unit for e in replay.charged] == ["client:0"]
    assert replay.earlier == 1 and "charged again" in replay.message()
    rerun = decide(_journal(attempt=1, charged=earlier), False, ENV, "sample")
    assert rerun.attempt == 2 and rerun.earlier == 1
    assert [e.unit for e in rerun.charged] == ["client:0", "client:0", "client:1"]


def test_non_private_runs_charge_nothing():
    res = decide(_journal(device="cuda"), False, ENV, "none")
    assert res.replay and res.charged == [] and res.attempt == 0


def test_final_attempt_and_the_ledger_parse():
    from fl.errors import UsageError
    from fl.run.inflight import NOTE, attempts_from_ledger, final_attempt

    def charged(a, unit):
        return Event("poisson_gaussian", 1.5, 0.1, 20, unit=unit, round=4,
                     stage="interrupted", note=NOTE.format(a=a))  # fmt: skip

    assert final_attempt([]) == 0
    assert final_attempt([charged(0, "client:0"), charged(0, "client:1")]) == 1
    assert final_attempt([charged(0, "client:0"), charged(1, "client:0")]) == 2
    ledger = [_ev("client:0", rnd=3).to_dict(), charged(0, "client:0").to_dict(),
              _ev("client:0").to_dict(), charged(0, "client:1").to_dict()]  # fmt: skip
    got = attempts_from_ledger(ledger)
    assert list(got) == [4] and [e.unit for e in got[4]] == ["client:0", "client:1"]
    bad = dict(charged(0, "client:0").to_dict(), note="edited")
    with pytest.raises(UsageError, match="does not name its attempt"):
        attempts_from_ledger([bad])
    with pytest.raises(UsageError, match="ledger event 0"):
        attempts_from_ledger([dict(bad, noise_multiplier=-1.0)])
