"""The ClientApps of the Flower audit (:mod:`audit.libraries.flower`): the real clients
behind a shim that hands them the model without the canary block and puts it back unchanged,
and the canary clients (legacy ``Client`` and Message API ``@app.train``), each with the
user's mods; and the reply hook that records a canary's reply as the server receives it.

flwr is imported only inside functions.
"""

from __future__ import annotations

import numpy as np

from audit.libraries.flower.canaries import BLOCK_KEY, FIRST_NODE
from audit.libraries.flower.compat import client_app_class, fitres_of, new_context, records_class

__all__ = ["build_apps", "record_reply"]


def build_apps(run) -> dict:
    """node id -> (ClientApp, Context, is_canary) of every node of the run: the real clients
    behind a shim that hides and restores the canary block, and the canary clients."""

    ClientApp, RecordDict = client_app_class(), records_class()

    apps: dict = {}
    if run.api == "legacy":
        from flwr.client import Client
        from flwr.common import FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
        from flwr.common.typing import Code, EvaluateRes, FitIns

        class Shim(Client):
            def __init__(self, inner, node):
                self.inner, self.node = inner, node

            def fit(self, ins):
                kind = run.fate(self.node)
                nd = parameters_to_ndarrays(ins.parameters)
                res = self.inner.fit(FitIns(ndarrays_to_parameters(nd[:-1]), ins.config))
                out = parameters_to_ndarrays(res.parameters)
                out = injected(kind, self.node, out)
                if len(out) != len(nd) - 1:
                    raise ValueError(
                        f"client {self.node} returned {len(out)} arrays, the model has "
                        f"{len(nd) - 1}"
                    )
                res.parameters = ndarrays_to_parameters([*out, nd[-1]])
                run.real_sizes[self.node] = float(res.num_examples)
                return res

            def evaluate(self, ins):
                return EvaluateRes(Status(Code.OK, ""), 0.0, 0, {})

        class Canary(Client):
            def __init__(self, j):
                self.j = j

            def fit(self, ins):
                nd = parameters_to_ndarrays(ins.parameters)
                nd[-1] = run.canary_update(nd[-1], self.j)
                return FitRes(
                    Status(Code.OK, ""),
                    ndarrays_to_parameters(nd),
                    int(run.canary_examples()),
                    {},
                )

            def evaluate(self, ins):
                return EvaluateRes(Status(Code.OK, ""), 0.0, 0, {})

        def real_fn(ctx):
            if isinstance(ctx, str):  # flwr 1.8, 1.9: client_fn(cid), cid = the node here
                node = int(ctx)
                return Shim(run.client_fn(str(node - FIRST_NODE)), node)
            return Shim(run.client_fn(ctx), ctx.node_id)

        real_app = ClientApp(client_fn=real_fn, mods=run.mods)

        def canary_fn(j):
            def client_fn(context):
                return Canary(j)

            return client_fn

        canary_apps = [
            ClientApp(client_fn=canary_fn(j), mods=run.mods) for j in range(run.canaries.m)
        ]
    else:
        from flwr.common import Array, ArrayRecord, Message, MetricRecord

        real_app = ClientApp(mods=run.mods)
        last: dict = {}

        @real_app.train()
        def _real(msg, ctx):
            (akey,) = list(msg.content.array_records)
            rec = msg.content[akey]
            block = rec[BLOCK_KEY].numpy()
            msg.content[akey] = ArrayRecord({k: rec[k] for k in rec.keys() if k != BLOCK_KEY})
            kind = run.fate(ctx.node_id)
            try:  # the content may be shared by the round's messages: restore it
                reply = run.train(msg, ctx)
            finally:
                msg.content[akey] = rec
            if reply.has_error():
                return reply
            (rkey,) = list(reply.content.array_records)
            out = reply.content[rkey]
            arrays = {k: out[k] for k in out.keys()}
            if kind is not None:
                new = injected(kind, ctx.node_id, [a.numpy() for a in arrays.values()])
                arrays = {k: Array(v) for k, v in zip(arrays, new, strict=True)}
            reply.content[rkey] = ArrayRecord({**arrays, BLOCK_KEY: Array(block)})
            (mkey,) = list(reply.content.metric_records)
            wkey = getattr(run.inner, "weighted_by_key", "num-examples")
            metrics = reply.content[mkey]
            if wkey in metrics:
                run.real_sizes[ctx.node_id] = float(metrics[wkey])
            last["keys"] = (rkey, mkey, dict(metrics))
            return reply

        canary_apps = []
        for j in range(run.canaries.m):
            app = ClientApp(mods=run.mods)

            @app.train()
            def _canary(msg, ctx, j=j):
                (akey,) = list(msg.content.array_records)
                rec = msg.content[akey]
                arrays = {k: rec[k].numpy() for k in rec.keys()}
                arrays[BLOCK_KEY] = run.canary_update(arrays[BLOCK_KEY], j)
                rkey, mkey, metrics = last.get("keys", ("arrays", "metrics", {}))
                wkey = getattr(run.inner, "weighted_by_key", "num-examples")
                # the weight in the real replies' type (an int count stays an int)
                n = run.canary_examples()
                metrics = {
                    **metrics,
                    wkey: int(n) if isinstance(metrics.get(wkey), int) else float(n),
                }
                content = RecordDict(
                    {
                        rkey: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                        mkey: MetricRecord(metrics),
                    }
                )
                return Message(content, reply_to=msg)

            canary_apps.append(app)
    for i in range(run.k):
        node = FIRST_NODE + i
        ctx = new_context(node, {"partition-id": i, "num-partitions": run.k})
        apps[node] = (real_app, ctx, False)
    for j, node in enumerate(run.canary_nodes):
        ctx = new_context(node, {"canary": j})
        apps[node] = (canary_apps[j], ctx, True)
    return apps


def injected(kind: str | None, node: int, arrays: list) -> list:
    """A real client's reply arrays after an injected failure (:class:`~audit.libraries.
    flower.canaries.ClientFailure`): ``raise`` raises here, inside the ClientApp (after the
    user's code ran, before the mods see the reply); ``nan`` replaces every value by NaN."""
    if kind == "raise":
        raise RuntimeError(f"injected failure: client node {node} raised")
    if kind == "nan":
        return [np.full(np.shape(a), np.nan) for a in arrays]
    return arrays


# --- the recording hook


def record_reply(run, msg, reply, is_canary: bool) -> None:
    """The grid's ``on_reply``: every failed reply (None: timed out; an error reply) in the
    round's record, and with ``LocalDpMod`` each canary reply as the server receives it (the
    block of its update)."""
    if not run.records:
        return
    node = msg.metadata.dst_node_id
    if reply is None:
        run.records[-1].failed[node] = "timeout"
        return
    if reply.has_error():
        run.records[-1].failed[node] = f"error: {reply.error.reason}"
        return
    if not (is_canary and run.mode == "local_dp"):
        return
    j = run.canary_nodes.index(node)
    if run.api == "legacy":
        from flwr.common import parameters_to_ndarrays

        nd = parameters_to_ndarrays(fitres_of(reply.content).parameters)
        block = nd[-1]
    else:
        (akey,) = list(reply.content.array_records)
        block = reply.content[akey][BLOCK_KEY].numpy()
    run.records[-1].canary_replies[j] = np.asarray(block, dtype=np.float64).copy()
