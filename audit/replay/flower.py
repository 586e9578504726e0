"""Over 500 lines on purpose: one replay (Flower's noise calls), whose patches, caller-frame reading (scope and bound), client wrappers and driver share one recording state; pfl's replay reuses its driver.

Neighbour replay of a Flower training at client level, Flower patched at import (#47).

:func:`replay_flower` runs a Flower training (a callable that trains once, in this process)
on its clients' data D with every release recorded, then once per neighbour D′ in which one
client's reply is changed, with every random draw frozen, and compares what entered each
noise call (:class:`audit.replay.record.Recorder`).

**The noise primitive.** flwr's Gaussian noise is ``add_gaussian_noise_inplace(arrays, std)``
(flwr 1.42 ``flwr/supercore/differential_privacy.py``), imported by name into the Message
API wrappers (``flwr/serverapp/strategy/dp_fixed_clipping.py``, ``dp_adaptive_clipping.py``)
and its ``LocalDpMod`` (``flwr/clientapp/mod/localdp_mod.py``); the legacy wrappers
(``flwr/server/strategy/dp_*_clipping.py``) call ``add_gaussian_noise_to_params`` and the
legacy ``LocalDpMod`` ``add_localdp_gaussian_noise_to_params``, which both reach it through
the supercore module's own name. :func:`_patched` rebinds the name in every loaded flwr
module that holds it (older releases' ``flwr.common.differential_privacy`` too), so each noise
call is one release: the arrays before the call are q(D), what the call added is its noise;
the library's own draw still happens on D′ (numpy's global generator advances as on D) and
the arrays are then overwritten by D's recorded output, so both runs follow one trajectory.

**Where a release happened** (its scope) and **what it declares** are read from the caller
(the frames above the noise call), so no Flower class is subclassed:

* a central wrapper (``self`` with ``noise_multiplier``, ``clipping_norm``,
  ``num_sampled_clients``; ``server_round`` in a frame): the round. Flower's fixed cohort lets
  a client's data change (replace-one-client) move the mean of m clipped updates by up to
  2C/m; the noise ``std`` = σ·C/m is calibrated to that unit, so the bound is derived as
  **2·std/σ** with σ the larger of the claim's noise multiplier and the wrapper's own (σ_Δ
  for adaptive clipping): a wrapper built with a smaller σ than claimed, or noising at a
  smaller clip than it clipped at (adaptive clipping's next clip), is held to the bound its
  noise really protects;
* ``LocalDpMod`` (``self`` with ``sensitivity``): one release per client reply, scope the
  client's node and its reply's index; the bound is the mod's own ``sensitivity`` (its noise is
  calibrated to it; any two inputs of a client differ by up to 2C after its clip).

**Neighbours** (client level, :data:`FLOWER_KINDS`), applied to the replies of one client, the
real client the sampler drew most often on D (every round it is drawn): its update replaced
(the opposite update: a client whose update was clipped moves the mean by exactly 2C/m),
replaced by an update of norm 10³·C, no data (update 0, ``num_examples`` 0), a huge
``num_examples`` (×10³: FedAvg's weight n_k/Σn then moves the aggregate far beyond 2C/m), NaN.
The user's ``client_fn`` (legacy) or ``train`` (Message API) is wrapped
(:func:`wrap_client_fn`, :func:`wrap_train`); a driver passes the wrapped function to Flower
(``audit.libraries.replay_glue`` does it for :mod:`audit.libraries.flower`'s in-process runs).

**Frozen.** Before each run Python's ``random`` (Flower's cohorts: ``random.sample``), numpy's
and torch's global generators are reset to one snapshot. Not frozen: adaptive clipping's
noised clipped count (drawn inline by the strategy): a neighbour that changes the count
changes the next clip; said in the result.

:func:`replay_clients` is the driver shared with :mod:`audit.replay.pfl`.
flwr is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np

from audit.findings import Code

__all__ = [
    "FLOWER_KINDS",
    "DEFAULT_FLOWER",
    "parse_client_kinds",
    "replay_flower",
    "replay_clients",
    "wrap_client_fn",
    "wrap_train",
    "claim_value",
    "summary",
]

#: kind -> what the neighbour client does (its update is reply − the global model it got)
FLOWER_KINDS = {
    "replace": "one client's data changed: its update replaced by the opposite update",
    "huge": "one client's update replaced by one of norm 10³·C (the opposite direction)",
    "empty": "one client with no data: update 0 and num_examples 0",
    "examples": "one client reporting num_examples × 1000 (its update unchanged)",
    "nan": "one client's update NaN",
}
#: tried unless told otherwise: the neighbours a correct clipping must meet (the others are
#: adversarial and break Flower's own assumptions; ``all`` tries them)
DEFAULT_FLOWER = ("replace", "huge")
#: the huge update's norm, in units of the clip
HUGE = 1e3


def parse_client_kinds(spec, kinds: dict, default: tuple) -> tuple[str, ...]:
    """``auto``/None (``default``), ``all`` (every kind), a comma string or a sequence."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "auto")):
        return tuple(default)
    if isinstance(spec, str) and spec.strip() == "all":
        return tuple(kinds)
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    bad = [k for k in items if k not in kinds]
    if bad:
        raise ValueError(f"neighbours {bad} unknown; known: {', '.join(kinds)}")
    return tuple(k for k in items if k)


def claim_value(claim, name: str):
    """A claim's field (a dict or an object with attributes), or None."""
    if claim is None:
        return None
    v = claim.get(name) if isinstance(claim, dict) else getattr(claim, name, None)
    return None if v is None else float(v)


class ClientReplayState:
    """What the patches and the client wrappers share during one replay."""

    def __init__(self):
        self.active = False
        self.kind: str | None = None  # the neighbour of this run (None: the run on D)
        self.target = None
        self.drawn: Counter = Counter()
        self.clip = 1.0
        self.sigma: float | None = None
        self.calls: Counter = Counter()  # releases so far per (client) scope

    def reset_run(self, kind):
        self.kind = kind
        self.calls = Counter()

    def neighbour_of(self, cid) -> str | None:
        """The kind to apply to client ``cid``'s reply now (None: leave it)."""
        if not self.active:
            return None
        if self.kind is None:
            self.drawn[cid] += 1
            return None
        return self.kind if cid == self.target else None


_C = ClientReplayState()


def change_update(kind: str, update: list[np.ndarray], clip: float) -> list[np.ndarray]:
    """A client's update (arrays) as the neighbour ``kind`` changes it."""
    norm = math.sqrt(sum(float(np.sum(np.square(u, dtype=np.float64))) for u in update))
    if kind == "nan":
        return [np.full(np.shape(u), np.nan, dtype=np.asarray(u).dtype) for u in update]
    if kind == "empty":
        return [np.zeros_like(u) for u in update]
    if kind not in ("replace", "huge"):
        return [np.array(u, copy=True) for u in update]
    if norm == 0 or not math.isfinite(norm):  # no direction: the first coordinate's
        out = [np.zeros_like(u, dtype=np.float64) for u in update]
        out[0].flat[0] = 1.0
        update, norm = out, 1.0
    scale = -1.0 if kind == "replace" else -HUGE * clip / norm
    return [(np.asarray(u, dtype=np.float64) * scale).astype(np.asarray(u).dtype) for u in update]


def change_examples(kind: str, n):
    if kind == "empty":
        return type(n)(0)
    if kind == "examples":
        return type(n)(n * 1000)
    return n


def _changed_model(kind, global_arrays, reply_arrays, clip):
    upd = [np.asarray(r, dtype=np.float64) - np.asarray(g, dtype=np.float64)
           for g, r in zip(global_arrays, reply_arrays, strict=True)]  # fmt: skip
    new = change_update(kind, upd, clip)
    return [
        (np.asarray(g, dtype=np.float64) + u).astype(np.asarray(r).dtype)
        for g, u, r in zip(global_arrays, new, reply_arrays, strict=True)
    ]


def _pid(context):
    cfg = getattr(context, "node_config", None) or {}
    return cfg.get("partition-id", getattr(context, "node_id", None))


def wrap_client_fn(client_fn: Callable):
    """A legacy ``client_fn(context) -> Client`` whose client's ``fit`` reply is changed as
    the replay's neighbour says (only for the neighbour's client, only on D′); outside a
    replay it returns the user's client's replies unchanged."""
    from flwr.client import Client, NumPyClient
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

    class NeighbourClient(Client):
        def __init__(self, inner, cid):
            self.inner, self.cid = inner, cid

        def get_parameters(self, ins):
            return self.inner.get_parameters(ins)

        def get_properties(self, ins):
            return self.inner.get_properties(ins)

        def evaluate(self, ins):
            return self.inner.evaluate(ins)

        def fit(self, ins):
            res = self.inner.fit(ins)
            kind = _C.neighbour_of(self.cid)
            if kind is None:
                return res
            g = parameters_to_ndarrays(ins.parameters)
            out = parameters_to_ndarrays(res.parameters)
            res.parameters = ndarrays_to_parameters(_changed_model(kind, g, out, _C.clip))
            res.num_examples = change_examples(kind, res.num_examples)
            return res

    def fn(context):
        client = client_fn(context)
        if isinstance(client, NumPyClient):
            client = client.to_client()
        return NeighbourClient(client, _pid(context))

    return fn


def wrap_train(train: Callable, weight_keys=("num-examples", "num_examples")):
    """A Message API ``train(msg, context) -> Message`` whose reply is changed as the
    replay's neighbour says (the arrays, and the weight ``weight_keys`` in its metrics)."""
    from flwr.common import Array, ArrayRecord, MetricRecord

    def fn(msg, context):
        reply = train(msg, context)
        kind = _C.neighbour_of(_pid(context))
        if kind is None or reply.has_error():
            return reply
        (akey,) = list(msg.content.array_records)
        g = msg.content[akey].to_numpy_ndarrays()
        (rkey,) = list(reply.content.array_records)
        keys = list(reply.content[rkey].keys())
        out = reply.content[rkey].to_numpy_ndarrays()
        new = _changed_model(kind, g, out, _C.clip)
        reply.content[rkey] = ArrayRecord({k: Array(v) for k, v in zip(keys, new, strict=True)})
        for mkey in list(reply.content.metric_records):
            metrics = dict(reply.content[mkey])
            for w in weight_keys:
                if w in metrics:
                    metrics[w] = change_examples(kind, metrics[w])
            reply.content[mkey] = MetricRecord(metrics)
        return reply

    return fn


# --- the noise primitive


def _caller():
    """(the object that called the noise, ``server_round`` or None, the client's context or
    None), read from the frames above the noise call."""
    f = sys._getframe(2)
    owner, rnd, ctx = None, None, None
    for _ in range(16):
        if f is None:
            break
        loc = f.f_locals
        s = loc.get("self")
        if (
            owner is None
            and s is not None
            and (hasattr(s, "sensitivity") or hasattr(s, "num_sampled_clients"))
        ):
            owner = s
        if rnd is None and isinstance(loc.get("server_round"), int):
            rnd = loc["server_round"]
        if ctx is None:
            c = loc.get("context", loc.get("ctx"))
            if c is not None and hasattr(c, "node_id"):
                ctx = c
        f = f.f_back
    return owner, rnd, ctx


def _declared(std: float, owner) -> tuple[float, dict, str]:
    """(the bound on ‖q(D) − q(D′)‖, the release's scope labels, its kind)."""
    if owner is not None and hasattr(owner, "sensitivity") and hasattr(owner, "epsilon"):
        return float(owner.sensitivity), {}, "flower:local_dp"
    sigma = _C.sigma
    if owner is not None and hasattr(owner, "num_sampled_clients"):
        own = float(getattr(owner, "noise_multiplier", 0) or 0)
        # the larger of the claim's σ and the wrapper's (adaptive clipping noises the
        # aggregate at its σ_Δ > σ, the rest of the budget going to the clipped count)
        s = max(sigma or 0.0, own)
        if s and std > 0:
            return 2.0 * float(std) / s, {}, "flower:central"
        return (
            2.0 * float(owner.clipping_norm) / int(owner.num_sampled_clients),
            {},
            ("flower:central"),
        )
    return math.nan, {}, "flower:unknown"


def _wrap_noise(orig):
    import torch

    from fl.privacy import tap as taps

    def add_gaussian_noise_inplace(input_arrays, std_dev):
        tap = taps.active()
        if tap is None or not _C.active:
            return orig(input_arrays, std_dev)
        before = [np.array(a, dtype=np.float64, copy=True) for a in input_arrays]
        orig(input_arrays, std_dev)  # the library's own draw, on D′ as on D
        owner, rnd, ctx = _caller()
        sens, labels, kind = _declared(float(std_dev), owner)
        if kind == "flower:local_dp":
            node = getattr(ctx, "node_id", None)
            _C.calls[node] += 1
            labels = {"client": node, "reply": _C.calls[node]}
        elif rnd is not None:
            labels = {"round": rnd}
        with taps.scope(**labels):
            for i, (a, b) in enumerate(zip(input_arrays, before, strict=True)):
                v = torch.from_numpy(b)
                noise = torch.from_numpy(np.asarray(a, dtype=np.float64) - b)
                out = taps.release(kind, v, noise, sens, part=str(i))
                a[...] = out.numpy().reshape(np.shape(a)).astype(np.asarray(a).dtype)
        return None

    add_gaussian_noise_inplace.__wrapped__ = orig
    return add_gaussian_noise_inplace


#: the flwr modules that hold the noise primitive by name (imported if the release has them)
FLOWER_MODULES = (
    "flwr.supercore.differential_privacy",
    "flwr.common.differential_privacy",
    "flwr.serverapp.strategy.dp_fixed_clipping",
    "flwr.serverapp.strategy.dp_adaptive_clipping",
    "flwr.clientapp.mod.localdp_mod",
    "flwr.server.strategy.dp_fixed_clipping",
    "flwr.server.strategy.dp_adaptive_clipping",
    "flwr.client.mod.localdp_mod",
)


@contextlib.contextmanager
def _patched_flower():
    """Rebind ``add_gaussian_noise_inplace`` in every loaded flwr module holding it."""
    import importlib

    for name in FLOWER_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    origs = set()
    for name in FLOWER_MODULES:
        mod = sys.modules.get(name)
        fn = getattr(mod, "add_gaussian_noise_inplace", None) if mod else None
        if fn is not None:
            origs.add(getattr(fn, "__wrapped__", fn))
    undo = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("flwr") or mod is None:
            continue
        fn = mod.__dict__.get("add_gaussian_noise_inplace")
        if fn is not None and fn in origs:
            mod.add_gaussian_noise_inplace = _wrap_noise(fn)
            undo.append((mod, fn))
    try:
        yield len(undo)
    finally:
        for mod, fn in undo:
            mod.add_gaussian_noise_inplace = fn


# --- the driver


def _snapshot():
    import random

    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore(snap) -> None:
    import random

    import torch

    random.setstate(snap[0])
    np.random.set_state(snap[1])
    torch.set_rng_state(snap[2])


def _run(train) -> str | None:
    try:
        train()
    except Exception as exc:  # a run that raises on D′ released that it raised
        return f"{type(exc).__name__}: {exc}"
    return None


def replay_clients(
    train: Callable[[], object],
    *,
    library: str,
    state: ClientReplayState,
    patches,
    kinds: dict,
    neighbours: Iterable[str],
    eligible: Callable[[object], bool] | None = None,
    relation: str,
    held_fixed: dict,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Record ``train()`` on D, replay it once per neighbour kind (module doc); the shared
    driver of :func:`replay_flower` and :func:`audit.replay.pfl.replay_pfl`."""
    from audit.replay.record import Recorder
    from fl.privacy.tap import tapped

    say = log or (lambda s: None)
    rec = Recorder()
    snap = _snapshot()
    results, findings = [], []
    seconds = {}
    state.active = True
    try:
        with patches, tapped(rec):
            t0 = time.time()
            state.reset_run(None)
            _restore(snap)
            err = _run(train)
            if err:
                raise ValueError(f"the {library} training failed on its own data: {err}")
            seconds["D"] = round(time.time() - t0, 3)
            drawn = {c: n for c, n in state.drawn.items() if eligible is None or eligible(c)}
            state.target = sorted(drawn, key=lambda c: (-drawn[c], str(c)))[0] if drawn else None
            say(f"{library} replay: {len(rec.releases)} releases on D; neighbour client "
                f"{state.target!r} (drawn {drawn.get(state.target, 0)} times)")  # fmt: skip
            for kind in neighbours if state.target is not None else ():
                t1 = time.time()
                state.reset_run(kind)
                rec.start_replay()
                _restore(snap)
                err = _run(train)
                cmp = rec.compare()
                results.append(
                    {
                        "neighbour": kind,
                        "what": kinds[kind],
                        "client": state.target,
                        "comparison": cmp,
                        "exception": err,
                    }
                )
                findings += _findings(kinds[kind], state.target, cmp, err, relation)
                seconds[kind] = round(time.time() - t1, 3)
                say(f"{library} replay: {kind}: passed {cmp['passed'] and not err}, max "
                    f"‖Δq‖/bound {cmp['max_ratio']}")  # fmt: skip
    finally:
        state.active = False
        state.kind = None
    if not rec.releases:
        findings.append(
            {
                "code": str(Code.REPLAY_EMPTY),
                "severity": "warning",
                "message": f"the {library} training made no release the replay could intercept "
                "(no noise call of the library ran): nothing compared",
            }
        )
    failed = any((not r["comparison"]["passed"]) or r["exception"] for r in results)
    verdict = "fail" if failed else ("pass" if rec.releases and results else "not run")
    ratios = [r["comparison"]["max_ratio"] for r in results if r["comparison"]["max_ratio"]]
    return {
        "library": library,
        "verdict": verdict,
        "releases": len(rec.releases),
        "client": state.target,
        "relation": relation,
        "neighbours": results,
        "max_ratio": max(ratios) if ratios else None,
        "findings": findings,
        "seconds": seconds,
        "held_fixed": held_fixed,
    }


def _findings(what, client, cmp, err, relation) -> list[dict]:
    from audit.replay.record import comparison_findings

    err_text = None if err is None else f"the training raised {err} on D′ (not on D)"
    return comparison_findings(cmp, f"'{what}' (client {client!r})", relation, [err_text])


def summary(result: dict) -> dict:
    """The replay column's format (:mod:`audit.libraries.results`): ``{"verdict",
    "neighbours", "releases", "findings"}``."""
    return {
        "verdict": result["verdict"],
        "neighbours": len(result["neighbours"]),
        "releases": int(result["releases"]),
        "findings": list(dict.fromkeys(f["code"] for f in result["findings"])),
    }


def replay_flower(
    train: Callable[[], object],
    *,
    claim=None,
    neighbours=None,
    clip: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Replay a Flower training on client-level neighbours (module doc). ``train()`` trains
    once in this process, its clients built from :func:`wrap_client_fn` /
    :func:`wrap_train`; it is called once on D and once per neighbour. ``claim``: a dict or
    :class:`audit.claims.schema.Claim` (its σ derives the bound, its C sizes the huge
    update), or None (the wrapper's own σ). ``clip``: C when the claim has none (default 1).
    Returns ``{"verdict": "pass" | "fail" | "not run", "releases", "client",
    "neighbours": [...], "max_ratio", "findings", "seconds", "held_fixed"}``."""
    kinds = parse_client_kinds(neighbours, FLOWER_KINDS, DEFAULT_FLOWER)
    global _C
    _C = ClientReplayState()
    _C.sigma = claim_value(claim, "noise_multiplier")
    _C.clip = claim_value(claim, "clipping_norm") or (clip if clip else 1.0)
    return replay_clients(
        train,
        library="flower",
        state=_C,
        patches=_patched_flower(),
        kinds=FLOWER_KINDS,
        neighbours=kinds,
        relation="replace-one-client: 2·std/σ = 2C/m for a central wrapper, LocalDpMod's "
        "sensitivity for a local reply",
        held_fixed={
            "generators": "random (Flower's cohorts), numpy (its noise) and torch reset to one "
            "snapshot before every run; every release's output is D's on D′",
            "adaptive clipping": "the noised clipped count is drawn inline by the strategy and "
            "not frozen: a neighbour that changes it changes the next clip",
            "neighbour": "the real client the sampler drew most often on D, changed in every "
            "round it is drawn",
        },
        log=log,
    )
