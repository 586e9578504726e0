"""The server charges what it planned (issue 37, item 5).

A client reply that drops or shrinks its DP events (fewer steps, larger σ, ...) must not
leave the ledger short: for every client sent a training stage the ledger is charged
the server's plan (``PrivacyPlan.planned_client_event``), the reply is rejected, and the
aggregate weighs clients by the server's own counts, never the client-reported ``n``.
Each run below is compared with an honest run made with the same noise key: the
ledgers must be equal (the plan), and where the tampered reply is still used (an
inflated ``n`` only) the released adapter too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fl.methods.rounds import RoundInfo
from fl.privacy.accounting import Event
from fl.run.contexts import InProcessTransport
from fl.run.engine import Engine
from fl.run.transport import Delivery, Dispatcher
from fl.testing import tiny_config

SMALL = dict(
    members=120,
    nonmembers=30,
    test=40,
    max_length=16,
    clients=2,
    rounds=1,
    local_steps=2,
    dp_level="sample",
    # σ 3, not 1: the runs' PLDs at σ 1 cost most of their time, and the checks (a reply that
    # differs from the plan is rejected, the plan is what is charged) hold at any σ
    noise_multiplier=3.0,
)


def _cfg(**kw):
    return tiny_config(**{**SMALL, **kw})


class Tamper:
    """The in-process transport, with client "1"'s delivery in round 1, stage ``stage``
    changed by ``edit`` after the client ran (what a malicious client could send)."""

    name = "inprocess"

    def __init__(self, eng, edit, stage="train"):
        self.inner = InProcessTransport(eng)
        self.edit, self.stage = edit, stage

    def deliver(self, method, rnd, stage, payloads, faults):
        got = self.inner.deliver(method, rnd, stage, payloads, faults)
        if rnd.index == 0 and stage == self.stage and "1" in got:
            self.edit(got["1"])
        return got


def _train(out: Path, cfg, edit=None, stage="train", key_of: Path | None = None):
    key = key_of / "private" / "noise.key" if key_of is not None else None
    eng = Engine(cfg, out, quiet=True, noise_key=key)
    if edit is not None:
        eng.make_transport = lambda: Tamper(eng, edit, stage)
    return eng.run(), eng


def _events(man: dict) -> list[dict]:
    return man["privacy"]["ledger"]["events"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _adapter(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """Honest FedAvg and FedASK runs, by method: (run dir, manifest)."""
    done = {}

    def get(method: str):
        if method not in done:
            out = tmp_path_factory.mktemp(f"honest-{method}") / "run"
            man, _ = _train(out, _cfg(method=method))
            done[method] = (out, man)
        return done[method]

    return get


def _drop(d: Delivery):
    d.events = []


def _fewer_steps(d: Delivery):
    d.events = [dataclasses.replace(e, count=e.count - 1) for e in d.events]


def _larger_sigma(d: Delivery):
    d.events = [dataclasses.replace(e, noise_multiplier=2 * e.noise_multiplier) for e in d.events]


@pytest.mark.parametrize(
    "edit", [_drop, _fewer_steps, _larger_sigma], ids=["dropped", "fewer-steps", "larger-sigma"]
)
@pytest.mark.parametrize("method,stage", [("fedavg", "train"), ("fedask", "train_sketch")])
def test_understated_events_are_rejected_and_the_plan_is_charged(
    tmp_path, honest, method, stage, edit
):
    ref_out, ref = honest(method)
    # the honest clients reported exactly the plan (nothing rejected, no mismatch)
    assert all(r["rejected_updates"] == 0 for r in _rows(ref_out))
    assert "differ from the server's plan" not in (ref_out / "run.log").read_text()
    out = tmp_path / "r"
    man, eng = _train(out, _cfg(method=method), edit, stage, key_of=ref_out)
    assert _events(man) == _events(ref)  # the ledger is the plan, not the report
    assert len(_events(man)) == 2
    ev1 = [e for e in _events(man) if e["unit"] == "client:1"]
    assert ev1 == [eng.planned_client_event(0, "1").to_dict()]
    assert man["privacy"]["epsilon"] == ref["privacy"]["epsilon"]
    assert _rows(out)[0]["rejected_updates"] == 1
    log = (out / "run.log").read_text()
    assert f"rejected the update of client 1 in stage '{stage}'" in log
    assert "DP events differ from the server's plan" in log
    # the rejected update is not aggregated: the release differs from the honest one
    a, b = _adapter(out), _adapter(ref_out)
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method,stage", [("fedavg", "train"), ("fedask", "train_sketch")])
def test_inflated_n_is_not_used_to_aggregate(tmp_path, honest, method, stage):
    ref_out, ref = honest(method)

    def inflate(d: Delivery):
        d.reply["n"] = 10_000 * d.reply["n"]

    out = tmp_path / "r"
    man, eng = _train(out, _cfg(method=method), inflate, stage, key_of=ref_out)
    # the server weighs by its own count: the release is the honest one, bit for bit
    a, b = _adapter(out), _adapter(ref_out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert _events(man) == _events(ref)
    log = (out / "run.log").read_text()
    assert f"client 1 reported n={10_000 * eng.public_size('1')}" in log
    assert f"the server's count n={eng.public_size('1')} is used" in log


# ---------------------------------------------------------------- the Dispatcher alone
class FakeTransport:
    """Replies ``{"n": public size}`` with the events ``events_of(cid)`` gives (default:
    the plan); ``deliveries`` overrides whole deliveries."""

    name = "fake"

    def __init__(self, eng, events_of=None, deliveries=None):
        self.eng, self.events_of, self.deliveries = eng, events_of, deliveries or {}

    def deliver(self, method, rnd, stage, payloads, faults):
        out = {}
        for cid, _ in payloads:
            if cid in self.deliveries:
                out[cid] = self.deliveries[cid]
                continue
            evs = [self.eng.planned_client_event(rnd, cid)]
            if self.events_of is not None:
                evs = self.events_of(cid, evs[0])
            out[cid] = Delivery({"n": self.eng.public_size(cid)}, evs)
        return out


class M:
    name = "m"
    train_stages = ("train",)

    def on_train(self, client, payload):  # pragma: no cover - never called here
        raise AssertionError

    def on_project(self, client, payload):  # pragma: no cover
        raise AssertionError


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    out = tmp_path_factory.mktemp("disp") / "run"
    e = Engine(_cfg(), out, quiet=True)
    e.prepare_out()
    e.setup()
    e.rejected_updates = 0
    return e


def _send(eng, transport, stage="train", clients=("0", "1")):
    before = len(eng.ledger.events)
    eng.rejected_updates = 0
    rnd = RoundInfo(0, 1, list(clients))
    replies = Dispatcher(eng, transport).send(M(), rnd, list(clients), stage, {})
    return replies, eng.ledger.events[before:]


def _plan(eng, cid):
    return eng.planned_client_event(0, cid)


def _tampered(eng, change):
    return FakeTransport(eng, lambda cid, p: change(p) if cid == "1" else [p])


@pytest.mark.parametrize(
    "change",
    [
        lambda p: [dataclasses.replace(p, sample_rate=p.sample_rate / 2)],
        lambda p: [dataclasses.replace(p, round=3)],
        lambda p: [dataclasses.replace(p, stage="train_sketch")],
        lambda p: [dataclasses.replace(p, unit="client:0")],
        lambda p: [dataclasses.replace(p, kind="gaussian", sample_rate=1.0)],
        lambda p: [p, p],
        lambda p: [dataclasses.replace(p, count=0)],
        lambda p: ["not an event"],
    ],
    ids=["smaller-q", "round", "stage", "unit", "kind", "twice", "no-steps", "garbage"],
)
def test_any_difference_from_the_plan_rejects_the_reply(eng, change):
    from fl.run.transport import charge_for, costs_at_least

    replies, charged = _send(eng, _tampered(eng, change))
    assert list(replies.ok) == ["0"]
    assert replies.failed["1"].startswith("rejected update: DP events differ from the server's")
    assert eng.rejected_updates == 1
    p0, p1 = _plan(eng, "0"), _plan(eng, "1")
    assert charged[0] == p0
    # never less than the plan: the plan is charged, or a report event that covers it
    assert any(e.unit == p1.unit and costs_at_least(e, p1) for e in charged[1:])
    got = [e for e in change(p1) if isinstance(e, Event)]
    want, _ = charge_for([p1], got)
    assert charged[1:] == want
    assert "its DP events differ from the server's plan" in "\n".join(eng._log_lines)


def test_a_report_larger_than_the_plan_is_charged_as_reported(eng):
    more = lambda p: [dataclasses.replace(p, count=p.count + 3)]  # noqa: E731
    replies, charged = _send(eng, _tampered(eng, more))
    assert "1" in replies.failed and list(replies.ok) == ["0"]
    assert charged == [_plan(eng, "0"), more(_plan(eng, "1"))[0]]
    # incomparable (more steps, more noise): both the plan and the report
    odd = lambda p: [dataclasses.replace(p, count=p.count + 3, noise_multiplier=9.0)]  # noqa: E731
    _, charged = _send(eng, _tampered(eng, odd))
    assert charged == [_plan(eng, "0"), _plan(eng, "1"), odd(_plan(eng, "1"))[0]]


def test_honest_replies_charge_exactly_the_plan(eng):
    replies, charged = _send(eng, FakeTransport(eng))
    assert list(replies.ok) == ["0", "1"] and not replies.failed
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]
    assert eng.rejected_updates == 0


def test_a_client_failing_before_training_is_charged_the_plan(eng):
    """A client that says it failed and reports no DP step is still charged: the server
    cannot tell whether it trained."""
    fake = FakeTransport(eng, deliveries={"1": Delivery(None, [], "ClientFailure: gone")})
    replies, charged = _send(eng, fake)
    assert replies.failed == {"1": "ClientFailure: gone"}
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]


def test_a_client_bug_is_raised_after_its_plan_is_charged(eng):
    fake = FakeTransport(eng, deliveries={"0": Delivery(None, [], error="Boom\ntraceback")})
    before = len(eng.ledger.events)
    with pytest.raises(RuntimeError, match="client 0 raised in stage 'train'"):
        Dispatcher(eng, fake).send(M(), RoundInfo(0, 1, ["0", "1"]), ["0", "1"], "train", {})
    assert eng.ledger.events[before:] == [_plan(eng, "0")]


def test_events_reported_where_nothing_is_planned_are_rejected_and_charged(eng):
    """A stage that does not train plans nothing; a client reporting an event there is
    rejected and what it reported is charged (as before: never less)."""
    p1 = _plan(eng, "1")
    fake = FakeTransport(eng, lambda cid, p: [p] if cid == "1" else [])
    replies, charged = _send(eng, fake, stage="project")
    assert list(replies.ok) == ["0"] and "1" in replies.failed
    assert charged == [p1]
    honest = FakeTransport(eng, lambda cid, p: [])
    replies, charged = _send(eng, honest, stage="project")
    assert list(replies.ok) == ["0", "1"] and charged == []


def test_client_level_clients_report_no_event(tmp_path):
    """Client level: the server records its own noise; clients report nothing (an
    honest run), and a client that reports an event is rejected (its event charged)."""
    e = Engine(_cfg(dp_level="client", clients=3, members=120), tmp_path / "c", quiet=True)
    e.prepare_out()
    e.setup()
    e.rejected_updates = 0
    assert e.planned_client_event(0, "1") is None
    _, honest = _send(e, FakeTransport(e, lambda cid, p: []))
    assert honest == []
    ev = Event("poisson_gaussian", 1.0, 0.1, 2, unit="client:1", round=0, stage="train")
    replies, charged = _send(e, FakeTransport(e, lambda cid, p: [ev] if cid == "1" else []))
    assert list(replies.ok) == ["0"] and charged == [ev]
    # an honest client-level run: no client event in the ledger, nothing rejected
    man, _ = _train(tmp_path / "run", _cfg(dp_level="client", clients=3))
    assert all(x["unit"] == "federation" for x in _events(man))
    assert all(r["rejected_updates"] == 0 for r in _rows(tmp_path / "run"))


def test_the_server_count_replaces_a_reported_n(eng):
    fake = FakeTransport(eng)
    fake.deliveries["1"] = Delivery({"n": 10**6}, [_plan(eng, "1")])
    replies, charged = _send(eng, fake)
    assert list(replies.ok) == ["0", "1"]
    assert replies.ok["1"]["n"] == eng.public_size("1")
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]


def test_canary_runs_are_not_rejected(tmp_path, tiny_cfg):
    """Canaries enlarge a client's data, not its public size (which honest clients
    report and the plan uses): an honest canary run rejects nothing."""
    out = tmp_path / "can"
    eng = Engine(_cfg(canaries=12, nonmembers=40), out, quiet=True)
    man = eng.run()
    assert any(len(eng.client_positions[c]) > eng.public_size(c) for c in eng.client_ids())
    assert all(r["rejected_updates"] == 0 for r in _rows(out))
    text = (out / "run.log").read_text()
    assert "differ from the server's plan" not in text and "reported n=" not in text
    assert sorted(x["unit"] for x in _events(man)) == ["client:0", "client:1"]


# ---------------------------------------------------------------- over Flower
def test_flower_replies_go_through_the_same_checks(eng, monkeypatch):
    """The Flower transport hands the node's reported events and n to the Dispatcher:
    a node that drops its events is rejected and charged the plan; an inflated n is
    replaced; unparsable events make a failure that is charged the plan."""
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    import fl.flower.transport as T
    from fl.flower import records as R
    from fl.flower.clientapp import META

    monkeypatch.setattr(T, "Message", lambda **kw: SimpleNamespace(**kw))
    nodes = {"0": 10, "1": 11}

    def reply(node, meta, payload):
        content = R.encode(payload, RecordDict(), "payload")
        R.encode(meta, content, META)
        return SimpleNamespace(
            metadata=SimpleNamespace(src_node_id=node),
            content=content,
            has_error=lambda: False,
        )

    def run(meta_of, payload_of):
        class Grid:
            def send_and_receive(self, msgs, timeout):
                return [reply(nodes[c], meta_of(c), payload_of(c)) for c in ("0", "1")]

        tr = T.FlowerTransport(eng, grid=Grid(), timeout=1.0)
        tr.nodes = dict(nodes)
        return _send(eng, tr)

    honest = lambda c: {"cid": c, "events": [_plan(eng, c).to_dict()]}  # noqa: E731
    n_of = lambda c: {"n": eng.public_size(c)}  # noqa: E731
    replies, charged = run(honest, n_of)
    assert list(replies.ok) == ["0", "1"]
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]

    dropped = lambda c: honest(c) if c == "0" else {"cid": c, "events": []}  # noqa: E731
    inflated = lambda c: {"n": 10**6} if c == "0" else n_of(c)  # noqa: E731
    replies, charged = run(dropped, inflated)
    assert list(replies.ok) == ["0"] and replies.ok["0"]["n"] == eng.public_size("0")
    assert replies.failed["1"].startswith("rejected update: DP events differ")
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]

    bad = {**_plan(eng, "1").to_dict(), "count": -1}
    malformed = lambda c: honest(c) if c == "0" else {"cid": c, "events": [bad]}  # noqa: E731
    replies, charged = run(malformed, n_of)
    assert replies.failed["1"].startswith("rejected update: malformed DP event")
    assert charged == [_plan(eng, "0"), _plan(eng, "1")]

    err = lambda c: {**honest(c), "error": "ValueError: x"} if c == "1" else honest(c)  # noqa: E731
    before = len(eng.ledger.events)
    with pytest.raises(RuntimeError, match="client 1 raised in stage 'train'"):
        run(err, n_of)
    assert eng.ledger.events[before:] == [_plan(eng, "0"), _plan(eng, "1")]
