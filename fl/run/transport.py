"""One send path for every transport.

A transport only moves payloads: it delivers one payload per client to the method's
``on_<stage>`` handler wherever the client runs (in this process, on a Flower
SuperNode) and hands back, per client, a :class:`Delivery`: the reply (or why there is
none) and the DP events the client reported. Everything else happens once, here, for
every transport:

- byte counts (down and up);
- reply validation (non-finite values, wrong shapes, bad example counts): a rejected
  reply is not used, its DP cost still counts;
- failure handling: a client that failed, was rejected, or whose reply was lost goes
  to ``Replies.failed`` and the run log says why;
- ledger events: the server charges what it *planned*, not what a client says. For
  every client sent a training stage (``method.train_stages``) under sample-level DP
  the ledger is charged the DP-SGD event the server planned for it
  (:meth:`fl.run.plan.PrivacyPlan.planned_client_event`: σ, the client's q and steps, with
  the stage ``train`` that ``ClientContext.train`` records) — whether the reply came
  back, failed, was rejected or was lost. An honest client reports exactly that event
  (kind, σ, q, steps, unit, round and stage are compared), so honest ledgers are the
  clients' reports. A reply whose reported events differ from the plan (dropped,
  fewer steps, larger σ, smaller q, extra events, ...) is rejected, and the charge is
  the plan; or the report when one of its events has the plan's unit, round and stage
  and costs at least as much; or, when the two do not compare, the plan *and* the
  report (never less than either, see :func:`charge_for`). Where nothing is planned
  (stages that do not train, client-level DP, where the server records its own noise)
  clients report no event; one that does is rejected and what it reported is charged.
- example counts: a reply's ``n`` (the aggregation weight) is replaced with the
  server's own count of the client's examples, :meth:`~fl.run.plan.PrivacyPlan.public_size`
  (before secret canaries, as honest clients report it); a differing report is logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fl.methods.rounds import Replies, RoundInfo, payload_bytes
from fl.privacy.accounting import Event


@dataclass
class Delivery:
    """What a transport got back from one client for one stage.

    reply: the handler's reply (None when it failed or was lost).
    events: DP events the client reported (empty when lost).
    failed: why the client failed (ClientFailure text, Flower error, timeout), or None.
    lost: True when nothing came back from the client (no events either).
    error: a bug in the client's handler (with its traceback), re-raised by the
      Dispatcher once the client's DP cost is charged; None otherwise.
    """

    reply: dict | None = None
    events: list[Event] = field(default_factory=list)
    failed: str | None = None
    lost: bool = False
    error: str | None = None


class Transport(Protocol):
    name: str

    def deliver(
        self,
        method,
        rnd: RoundInfo,
        stage: str,
        payloads: list[tuple[str, dict]],
        faults: dict[str, str | None],
    ) -> dict[str, Delivery]:
        """Run ``method.on_<stage>`` for every (client, payload); one Delivery per
        client (a missing one counts as lost)."""
        ...


def _walk_tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_tensors(v, f"{path}/{k}" if path else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _walk_tensors(v, f"{path}/{i}")


def validate_reply(reply: dict, method) -> str | None:
    """Why a client's reply must be rejected (None = acceptable): any NaN/Inf tensor,
    or — for methods whose clients send full states of the global shapes — a factor or
    head tensor whose shape differs from the global one, or missing/extra modules."""
    for path, t in _walk_tensors(reply):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"non-finite values in {path}"
    n = reply.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return f"invalid example count n={n!r}"
    state = reply.get("state")
    if state is not None and getattr(method, "state_shapes_match_global", True):
        glob = getattr(method, "global_state", None) or {}
        if not isinstance(state, dict) or "factors" not in state:
            return "state is not a LoRA state"
        gf, sf = glob.get("factors", {}), state["factors"]
        if set(gf) != set(sf):
            return f"modules differ from the global model: {sorted(set(gf) ^ set(sf))[:3]}"
        for k, ab in gf.items():
            for which, t in ab.items():
                got = sf[k].get(which) if isinstance(sf[k], dict) else None
                if got is None or tuple(got.shape) != tuple(t.shape):
                    shape = None if got is None else tuple(got.shape)
                    return f"{which} of {k} has shape {shape}, expected {tuple(t.shape)}"
        for k, t in glob.get("head", {}).items():
            got = state.get("head", {}).get(k)
            if got is None or tuple(got.shape) != tuple(t.shape):
                return f"head parameter {k} has a wrong or missing shape"
    return None


#: the fields of a reported DP event that must equal the server's plan
_COMPARED = ("kind", "noise_multiplier", "sample_rate", "count", "unit", "round", "stage")


def events_mismatch(planned: list[Event], reported: list) -> str | None:
    """Why the events a client reported are not the server's plan (None = they are):
    another count of events, a non-event, or any field of :data:`_COMPARED` differing."""
    if len(reported) != len(planned):
        return f"{len(reported)} DP event(s) reported, {len(planned)} planned"
    for i, (p, r) in enumerate(zip(planned, reported)):
        if not isinstance(r, Event):
            return f"reported DP event {i} is a {type(r).__name__}, not an event"
        for f in _COMPARED:
            if getattr(r, f) != getattr(p, f):
                return f"reported DP event {i} has {f}={getattr(r, f)!r}, planned {getattr(p, f)!r}"
    return None


def costs_at_least(a: Event, b: Event) -> bool:
    """Does ``a`` cost at least the privacy ``b`` costs? True when ``b`` releases nothing
    (count 0), or when both charge the same unit and ``a`` samples at least as often,
    runs at least as many steps and adds at most as much noise (the subsampled Gaussian's
    ε grows with q and steps and falls with σ)."""
    if b.count == 0:
        return True
    return (
        a.unit == b.unit
        and a.sample_rate >= b.sample_rate
        and a.count >= b.count
        and a.noise_multiplier <= b.noise_multiplier
    )


def charge_for(planned: list[Event], reported: list) -> tuple[list[Event], str]:
    """What the ledger is charged for one client's stage, and how (for the log).

    The plan, when the report matches it (an honest client: the ledger is unchanged);
    with no plan, whatever events were reported; otherwise never less than the plan
    nor the report: the plan when the report is (at most) one event it dominates; the
    report when one of its events has the plan's unit, round and stage and dominates
    the plan; else both."""
    got = [r for r in reported if isinstance(r, Event)]
    if not planned:
        return got, "the reported events"
    if events_mismatch(planned, reported) is None:
        return list(planned), "the planned events"
    (p,) = planned
    if len(got) <= 1 and all(costs_at_least(p, r) for r in got):
        return [p], "the planned DP-SGD event"
    frame = (p.unit, p.round, p.stage)
    if any((r.unit, r.round, r.stage) == frame and costs_at_least(r, p) for r in got):
        return got, "the reported events (they cost more than the plan)"
    return [p, *got], "the planned DP-SGD event and the reported ones"


class Dispatcher:
    """The engine's ``send``: per-client payloads out through a transport, replies
    validated, failures handled and DP events charged (see the module docstring).

    ``engine`` offers: ``ledger``, ``log(msg)``, ``add_bytes(rnd, cid, dir, n)``,
    ``fault_injector`` (tests), ``planned_client_event(rnd, cid)``,
    ``public_size(cid)`` and a ``rejected_updates`` counter.
    """

    def __init__(self, engine, transport: Transport):
        self.engine = engine
        self.transport = transport

    def planned(self, rnd: RoundInfo, cid: str, trains: bool) -> list[Event]:
        """The events the server plans for ``cid`` in a stage: its DP-SGD event in a
        training stage under sample-level DP, nothing otherwise."""
        ev = self.engine.planned_client_event(rnd, cid) if trains else None
        return [] if ev is None else [ev]

    def send(self, method, rnd: RoundInfo, clients, stage: str, payload, per_client=False):
        eng = self.engine
        clients = list(clients)
        if getattr(method, f"on_{stage}", None) is None:
            raise RuntimeError(f"method {method.name!r} has no handler for stage {stage!r}")
        payloads = []
        for cid in clients:
            p = payload[cid] if per_client else payload
            eng.add_bytes(rnd, cid, "down", payload_bytes(p))
            payloads.append((cid, p))
        inj = eng.fault_injector
        faults = {cid: (inj(rnd, cid, stage) if inj else None) for cid in clients}
        got = self.transport.deliver(method, rnd, stage, payloads, faults)
        trains = stage in getattr(method, "train_stages", ("train",))
        replies = Replies()
        where = f"round {rnd.index + 1}: client"
        # Clients in the order sent, so every transport composes the ledger alike.
        for cid in clients:
            d = got.get(cid) or Delivery(failed="no reply", lost=True)
            planned = self.planned(rnd, cid, trains)
            if d.lost:
                for ev in planned:
                    eng.ledger.record(ev)
                replies.failed[cid] = d.failed or "no reply"
                eng.log(
                    f"{where} {cid} failed in stage {stage!r}: {replies.failed[cid]}"
                    + ("; its planned DP-SGD event is charged" if planned else "")
                )
                continue
            mismatch = events_mismatch(planned, d.events)
            charged, how = charge_for(planned, d.events)
            for ev in charged:
                eng.ledger.record(ev)
            if mismatch is not None:
                eng.log(
                    f"{where} {cid} in stage {stage!r}: its DP events differ from the "
                    f"server's plan ({mismatch}); charged: {how}"
                )
            if d.error is not None:
                raise RuntimeError(f"client {cid} raised in stage {stage!r}:\n{d.error}")
            if d.failed is not None:
                replies.failed[cid] = d.failed
                eng.log(f"{where} {cid} failed in stage {stage!r}: {d.failed}")
                continue
            reply = dict(d.reply or {})
            problem = validate_reply(reply, method)
            if problem is None and mismatch is not None:
                problem = f"DP events differ from the server's plan: {mismatch}"
            if problem:
                replies.failed[cid] = f"rejected update: {problem}"
                eng.rejected_updates += 1
                eng.log(
                    f"round {rnd.index + 1}: rejected the update of client {cid} in stage "
                    f"{stage!r}: {problem}"
                )
                continue
            # Aggregation weights are the server's own count of the client's examples.
            n = eng.public_size(cid)
            if reply["n"] != n:
                eng.log(
                    f"{where} {cid} reported n={reply['n']} in stage {stage!r}; the server's "
                    f"count n={n} is used"
                )
                reply["n"] = n
            eng.add_bytes(rnd, cid, "up", payload_bytes(reply))
            replies.ok[cid] = reply
        return replies


#: transports that live above the engine, by config name → "module:class"
TRANSPORTS = {"flower": "fl.flower.transport:FlowerTransport"}


def transport_class(name: str):
    """The class of a registered transport (imported on first use)."""
    import importlib

    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: inprocess, {', '.join(TRANSPORTS)}")
    mod, cls = TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


__all__ = [
    "Delivery",
    "Dispatcher",
    "Transport",
    "TRANSPORTS",
    "charge_for",
    "costs_at_least",
    "events_mismatch",
    "transport_class",
    "validate_reply",
    "payload_bytes",
]
