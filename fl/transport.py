"""One send path for every transport.

A transport only moves payloads: it delivers one payload per client to the method's
``on_<stage>`` handler wherever the client runs (in this process, on a Flower
SuperNode) and hands back, per client, a :class:`Delivery`: the reply (or why there is
none) and the DP events the client reported. Everything else happens once, here, for
every transport:

- byte counts (down and up);
- reply validation (non-finite values, wrong shapes, bad example counts): a rejected
  reply is not used, its events still count;
- failure handling: a client that failed, was rejected, or whose reply was lost goes
  to ``Replies.failed`` and the run log says why;
- ledger events: the events a client reported are recorded whether or not its reply
  is used (its data was touched). When a reply is *lost* (timeout, crashed node) the
  client's report never arrives, so a training stage is charged the DP-SGD event the
  server planned for that client (σ, its q and steps): a lost reply can never make a
  release disappear from the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fl.privacy.accounting import Event
from fl.rounds import Replies, RoundInfo, payload_bytes


@dataclass
class Delivery:
    """What a transport got back from one client for one stage.

    reply: the handler's reply (None when it failed or was lost).
    events: DP events the client reported (empty when lost).
    failed: why the client failed (ClientFailure text, Flower error, timeout), or None.
    lost: True when nothing came back from the client (no events either).
    """

    reply: dict | None = None
    events: list[Event] = field(default_factory=list)
    failed: str | None = None
    lost: bool = False


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


class Dispatcher:
    """The engine's ``send``: per-client payloads out through a transport, replies
    validated, failures handled and DP events recorded (see the module docstring).

    ``engine`` offers: ``ledger``, ``log(msg)``, ``add_bytes(rnd, cid, dir, n)``,
    ``fault_injector`` (tests), ``planned_client_event(rnd, cid, stage)`` and a
    ``rejected_updates`` counter.
    """

    def __init__(self, engine, transport: Transport):
        self.engine = engine
        self.transport = transport

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
        # Clients in the order sent, so every transport composes the ledger alike.
        for cid in clients:
            d = got.get(cid) or Delivery(failed="no reply", lost=True)
            if d.lost:
                ev = eng.planned_client_event(rnd, cid, stage) if trains else None
                if ev is not None:
                    eng.ledger.record(ev)
                replies.failed[cid] = d.failed or "no reply"
                eng.log(
                    f"round {rnd.index + 1}: client {cid} failed in stage {stage!r}: "
                    f"{replies.failed[cid]}"
                    + ("; its planned DP-SGD event is charged" if ev is not None else "")
                )
                continue
            for ev in d.events:
                eng.ledger.record(ev)
            if d.failed is not None:
                replies.failed[cid] = d.failed
                eng.log(
                    f"round {rnd.index + 1}: client {cid} failed in stage {stage!r}: {d.failed}"
                )
                continue
            reply = dict(d.reply or {})
            problem = validate_reply(reply, method)
            if problem:
                replies.failed[cid] = f"rejected update: {problem}"
                eng.rejected_updates += 1
                eng.log(
                    f"round {rnd.index + 1}: rejected the update of client {cid} in stage "
                    f"{stage!r}: {problem}"
                )
                continue
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
    "transport_class",
    "validate_reply",
    "payload_bytes",
]
