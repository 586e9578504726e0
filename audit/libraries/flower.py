"""Over 500 lines on purpose: one library's driver, whose grid, client shims, canary clients, recording hooks and two loops (legacy, Message API) share the records of one run; the audit is in audit.libraries.flower_audit.

Flower's DP paths audited end to end (#43): canary clients that take Flower's own path.

One call, :func:`audit_flower`, runs a Flower DP training in this process (no Ray, no
SuperLink) with M canary clients among the user's K clients and audits it against a claim
(:mod:`audit.libraries.flower_audit` holds the audit)::

    result = audit_flower(
        dp_strategy,                 # a Flower DP wrapper (legacy or Message API) around FedAvg
        client_fn=client_fn,         # legacy: client_fn(context) -> Client
        # or train=train,            # Message API: train(msg, context) -> Message
        mods=[...],                  # the ClientApp's mods (fixedclipping_mod, LocalDpMod, …)
        num_clients=10, initial_arrays=[w, b], rounds=20, claim={...},
    )
    result["verdict"], result["exit_code"], result["findings"]

**What travels.** The model's arrays get one more array, the *canary block* (M zeros,
key :data:`BLOCK_KEY`). The K real clients run the user's code behind a shim that hands them
the model without the block and puts the block back unchanged in their reply, so a real
client's update on the block is exactly 0 (and its update norm is the one without canaries).
The M canary clients are nodes of the same grid: Flower's own sampler (``configure_fit`` /
``configure_train``: ``random.sample`` of the cohort among every node) draws them like the
real ones. Canary j's inclusion bit (probability ``p_include``, drawn before the run) says
whether its reply carries ``gain·C·e_j`` on the block (gain 100, C the clip in force) or an
update of 0; either way it is a node, takes part when drawn and reports ``num_examples``
like a real client, so the pool, the cohort size and the weights do not depend on the bits.
The reply then takes Flower's path: the user's mods (client-side clipping, ``LocalDpMod``),
the wrapper's clipping (server side), the inner strategy's weighted average (FedAvg weighs
by the reported ``num_examples``), the wrapper's noise. The released global model's block is
read after every round (``after − before``), and, for ``LocalDpMod``, each canary reply as
the server receives it.

**What a canary reports.** ``canary_examples``: an int, or None (default) = the largest
``num_examples`` a real client has reported so far (canaries reply after the real clients of
their round), so an aggregation that weighs by size gives the canary the weight of the
largest client and an unequal weighting shows on the block (contribution m·w_j ≠ 1).

**In-process driving.** Message API: ``strategy.start(grid=...)`` over :class:`LocalGrid`,
a :class:`flwr.serverapp.Grid` that calls the ClientApps directly. Legacy API: the loop of
``flwr.server.Server.fit_round`` (``configure_fit``, each client's ``fit``, ``aggregate_fit``)
over the same grid through Flower's grid client proxies. Two Flower internals are needed and
wrapped in one place each (:func:`_task_identity`, :func:`_grid_proxy`).

flwr is imported only inside functions (this module imports on a machine without it).
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BLOCK_KEY",
    "MODES",
    "FlowerCanaries",
    "FlowerRun",
    "LocalGrid",
    "audit_flower",
]

#: the inner strategies whose aggregation the audit's ε covers: a stateless mean of the
#: clipped updates weighted by the reported num_examples (FedProx only adds a client-side
#: proximal term); anything else is refused before training
COVERED_INNER = ("FedAvg", "FedProx")

#: the canary block's key in the model's ArrayRecord (Message API); last array in legacy
BLOCK_KEY = "fedlora_canary_block"
#: node ids: real clients from here, canaries after them (1 is Flower's SuperLink id)
FIRST_NODE = 1001
#: an excluded canary's update on its coordinate, in units of C (see _canary_block)
EXCLUDED_GAIN = 1e-9

#: what each mode carries (see docs/audit_flower.md)
MODES = {
    "server_fixed": "sampling, the wrapper's clipping, FedAvg's weighting, the noise (scale, freshness)",
    "client_fixed": "sampling, the client mod's clipping, FedAvg's weighting, the noise",
    "server_adaptive": (
        "sampling, clipping at C_t, weighting, the noise at σ·C_noise/m (C_t per round); "
        "not the clipped-count release (its noise is not observed)"
    ),
    "client_adaptive": "as server_adaptive, the clipping done by adaptiveclipping_mod",
    "local_dp": (
        "LocalDpMod's clipping and noise on each canary reply as the server receives it, "
        "against the (ε, δ) the mod is given; the central aggregate carries no DP claim"
    ),
}


@dataclass
class FlowerCanaries:
    """M canary clients. ``p_include``: each canary's probability of carrying its update
    (bits from the OS's entropy unless ``seed``); ``canary_examples``: what a canary
    reports as ``num_examples`` (None: the largest real client's report so far)."""

    m: int = 16
    p_include: float = 0.5
    gain_factor: float = 100.0
    canary_examples: int | None = None
    seed: int | None = None
    included: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 2:
            raise ValueError(f"FlowerCanaries.m must be an integer >= 2, got {self.m!r}")
        if not 0 < self.p_include <= 1:
            raise ValueError(f"p_include must be in (0, 1], got {self.p_include}")
        if not self.gain_factor > 1:
            raise ValueError(
                f"gain_factor must be > 1 (the canary is clipped), got {self.gain_factor}"
            )
        if self.canary_examples is not None and (
            isinstance(self.canary_examples, bool)
            or not isinstance(self.canary_examples, int)
            or self.canary_examples < 1
        ):
            raise ValueError(
                f"canary_examples must be a positive int or None, got {self.canary_examples!r}"
            )
        rng = np.random.default_rng(self.seed)
        self.included = (
            np.ones(self.m, dtype=bool)
            if self.p_include == 1
            else rng.random(self.m) < self.p_include
        )


# ---------------------------------------------------------------- Flower internals, in one place


@contextmanager
def _task_identity():
    """Flower's ``Message(...)`` reads the process's task identity (set by the SuperLink or
    ``start_grid`` in a deployment); an in-process run sets it as ``flwr.server.compat.
    start_grid`` does, and restores it after. Internal API (flwr 1.42:
    flwr/supercore/task_identity.py)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def _grid_proxy(node_id: int, grid):
    """The legacy ClientProxy that sends FitIns over a Grid (what ``start_grid`` registers).
    Internal API (flwr 1.42: flwr/server/compat/grid_client_proxy.py)."""
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    return GridClientProxy(node_id, grid, 1)


class LocalGrid:
    """An in-process :class:`flwr.serverapp.Grid`: ``send_and_receive`` calls each
    destination's ClientApp directly (real clients first, then canaries) and lets
    ``on_reply`` see every reply as the server receives it. Built by :func:`_make_grid`
    (the class derives from flwr's Grid there, so that this module imports without flwr)."""


def _make_grid(apps: dict, on_reply):
    from flwr.serverapp import Grid

    class _Grid(Grid, LocalGrid):
        def __init__(self):
            self.apps, self._run = apps, None

        def set_run(self, run) -> None:
            self._run = run

        @property
        def run(self):
            return self._run

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
            from flwr.app import Message

            return Message(
                content=content,
                dst_node_id=dst_node_id,
                message_type=message_type,
                group_id=group_id,
                ttl=ttl,
            )

        def get_node_ids(self):
            return list(self.apps)

        def push_messages(self, messages):
            raise NotImplementedError("LocalGrid answers through send_and_receive only")

        def pull_messages(self, message_ids):
            raise NotImplementedError("LocalGrid answers through send_and_receive only")

        def send_and_receive(self, messages, *, timeout=None):
            msgs = sorted(messages, key=lambda m: apps[m.metadata.dst_node_id][2])
            out = []
            for msg in msgs:
                app, ctx, is_canary = apps[msg.metadata.dst_node_id]
                reply = app(msg, ctx)
                on_reply(msg, reply, is_canary)
                out.append(reply)
            return out

    return _Grid()


# ---------------------------------------------------------------- the run


@dataclass
class RoundRecord:
    """What one round released and used (numpy; the audit reads these)."""

    round: int
    before: np.ndarray
    after: np.ndarray | None = None
    cohort: list = field(default_factory=list)
    clip: float = float("nan")
    noise_clip: float = float("nan")
    sigma: float = float("nan")
    weights: list = field(default_factory=list)  # (node id, weight) the aggregation read
    canary_replies: dict = field(default_factory=dict)  # canary index -> block as received


def _classify(strategy, mods) -> tuple[str, str]:
    """(api, mode) of a strategy and the client mods; a clear error for anything else."""
    import flwr.client.mod as lmod
    import flwr.clientapp.mod as mmod
    import flwr.server.strategy as ls
    import flwr.serverapp.strategy as ms

    local = [m for m in mods if isinstance(m, (lmod.LocalDpMod, mmod.LocalDpMod))]
    if isinstance(strategy, ms.Strategy):
        api, lib = "message", ms
    elif isinstance(strategy, ls.Strategy):
        api, lib = "legacy", ls
    else:
        raise ValueError(
            f"audit_flower needs a Flower strategy (flwr.server.strategy or "
            f"flwr.serverapp.strategy), got {type(strategy).__name__}"
        )
    kinds = {
        "DifferentialPrivacyServerSideFixedClipping": "server_fixed",
        "DifferentialPrivacyClientSideFixedClipping": "client_fixed",
        "DifferentialPrivacyServerSideAdaptiveClipping": "server_adaptive",
        "DifferentialPrivacyClientSideAdaptiveClipping": "client_adaptive",
    }
    mode = next((k for n, k in kinds.items() if isinstance(strategy, getattr(lib, n))), None)
    if local:
        if mode is not None:
            raise ValueError(
                "LocalDpMod together with a central DP wrapper: audit one mechanism at a time"
            )
        if len(local) > 1:
            raise ValueError("more than one LocalDpMod among the mods")
        ok = lmod.LocalDpMod if api == "legacy" else mmod.LocalDpMod
        if not isinstance(local[0], ok):
            raise ValueError(
                f"a {type(local[0]).__module__}.LocalDpMod with a {api} strategy: use "
                f"{ok.__module__}.LocalDpMod"
            )
        return api, "local_dp"
    if mode is None:
        raise ValueError(
            f"{type(strategy).__name__} is not a Flower DP wrapper "
            f"({', '.join(kinds)} of {lib.__name__}) and no LocalDpMod is among the mods: "
            "nothing to audit"
        )
    return api, mode


class FlowerRun:
    """One in-process Flower training with canary clients (module doc): :meth:`run`, then
    :meth:`audit` (or :func:`audit_flower` for both)."""

    def __init__(
        self,
        strategy,
        *,
        num_clients: int,
        initial_arrays,
        rounds: int,
        client_fn=None,
        train=None,
        mods=(),
        canaries: FlowerCanaries | None = None,
        seed: int | None = None,
    ) -> None:
        mods = list(mods)
        self.api, self.mode = _classify(strategy, mods)
        if self.api == "legacy" and (client_fn is None or train is not None):
            raise ValueError("a legacy (flwr.server.strategy) strategy needs client_fn, not train")
        if self.api == "message" and (train is None or client_fn is not None):
            raise ValueError(
                "a Message API (flwr.serverapp.strategy) strategy needs train, not client_fn"
            )
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(f"num_clients must be a positive int, got {num_clients!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
            raise ValueError(f"rounds must be an int >= 2 (the audit needs 2), got {rounds!r}")
        self.strategy, self.mods = strategy, mods
        self.inner = getattr(strategy, "strategy", strategy)
        pool = num_clients + (canaries or FlowerCanaries()).m
        for name in ("min_available_nodes", "min_available_clients", "min_fit_clients",
                     "min_train_nodes"):  # fmt: skip
            need = getattr(self.inner, name, None)
            if isinstance(need, int) and need > pool:
                raise ValueError(
                    f"the inner strategy's {name} = {need} exceeds the {pool} nodes of the "
                    f"run ({num_clients} clients + canaries): Flower would wait for them forever"
                )
        frac_eval = getattr(self.inner, "fraction_evaluate", 0.0)
        if self.api == "message" and frac_eval:
            raise ValueError(
                f"fraction_evaluate = {frac_eval:g}: the audit runs training rounds only; build "
                "the inner strategy with fraction_evaluate=0.0"
            )
        if type(self.inner).__name__ not in COVERED_INNER:
            raise ValueError(
                f"the inner strategy {type(self.inner).__name__} is not covered: the audit "
                "recomputes ε for a stateless (weighted) mean of the clipped updates, which "
                f"only {', '.join(COVERED_INNER)} compute; a robust aggregator (Krum, "
                "FedMedian, FedTrimmedAvg, Bulyan) can release one client's whole update, and a "
                "server optimizer (FedAdam, FedYogi, FedAdagrad, FedAvgM) keeps an un-noised "
                "state each release exposes again"
            )
        self.k, self.rounds, self.seed = num_clients, rounds, seed
        self.client_fn, self.train = client_fn, train
        self.canaries = canaries or FlowerCanaries()
        if not self.canaries.included.any():
            raise ValueError(
                f"none of the {self.canaries.m} canary clients was drawn in (inclusion "
                f"probability {self.canaries.p_include:g}): nothing would carry a contribution; "
                "use more canaries or another seed"
            )
        self.local = next((m for m in mods if type(m).__name__ == "LocalDpMod"), None)
        self.names, self.arrays = self._initial(initial_arrays)
        self.records: list[RoundRecord] = []
        self.real_sizes: dict[int, float] = {}
        self.canary_nodes = [FIRST_NODE + num_clients + j for j in range(self.canaries.m)]
        self._done = False

    @staticmethod
    def _initial(initial_arrays) -> tuple[list[str], list[np.ndarray]]:
        if hasattr(initial_arrays, "to_numpy_ndarrays") and hasattr(initial_arrays, "keys"):
            names = list(initial_arrays.keys())
            arrays = initial_arrays.to_numpy_ndarrays()
        elif isinstance(initial_arrays, (list, tuple)) and initial_arrays:
            arrays = [np.asarray(a) for a in initial_arrays]
            names = [str(i) for i in range(len(arrays))]
        else:
            raise ValueError(
                "initial_arrays must be a non-empty list of numpy arrays or an ArrayRecord"
            )
        if BLOCK_KEY in names:
            raise ValueError(f"initial_arrays already hold {BLOCK_KEY!r}")
        for a in arrays:
            if not np.issubdtype(np.asarray(a).dtype, np.floating):
                raise ValueError(
                    f"initial arrays must be floating point, got {np.asarray(a).dtype}"
                )
        return names, [np.asarray(a, dtype=np.float64) for a in arrays]

    # --- what the canary and the shims do

    def clip_now(self) -> float:
        """The clip in force (the wrapper's, or LocalDpMod's)."""
        if self.local is not None:
            return float(self.local.clipping_norm)
        return float(self.strategy.clipping_norm)

    def _canary_examples(self) -> float:
        if self.canaries.canary_examples is not None:
            return self.canaries.canary_examples
        return max(self.real_sizes.values(), default=1)

    def _canary_block(self, block: np.ndarray, j: int) -> np.ndarray:
        out = np.array(block, dtype=np.float64, copy=True)
        # an excluded canary's update is 1e-9·C, not 0: Flower's clip divides C by the
        # update's norm (flwr 1.42 supercore/differential_privacy.py:56), a zero update
        # raises ZeroDivisionError in the wrapper
        gain = self.canaries.gain_factor if self.canaries.included[j] else EXCLUDED_GAIN
        out[j] += gain * self.clip_now()
        return out

    def _apps(self) -> dict:
        from flwr.app import Context, RecordDict
        from flwr.clientapp import ClientApp

        run = self
        apps: dict = {}
        if self.api == "legacy":
            from flwr.client import Client
            from flwr.common import FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
            from flwr.common.typing import Code, EvaluateRes, FitIns

            class Shim(Client):
                def __init__(self, inner, node):
                    self.inner, self.node = inner, node

                def fit(self, ins):
                    nd = parameters_to_ndarrays(ins.parameters)
                    res = self.inner.fit(FitIns(ndarrays_to_parameters(nd[:-1]), ins.config))
                    out = parameters_to_ndarrays(res.parameters)
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
                    nd[-1] = run._canary_block(nd[-1], self.j)
                    return FitRes(
                        Status(Code.OK, ""),
                        ndarrays_to_parameters(nd),
                        int(run._canary_examples()),
                        {},
                    )

                def evaluate(self, ins):
                    return EvaluateRes(Status(Code.OK, ""), 0.0, 0, {})

            def real_fn(ctx):
                return Shim(run.client_fn(ctx), ctx.node_id)

            real_app = ClientApp(client_fn=real_fn, mods=self.mods)

            def canary_fn(j):
                def client_fn(context):
                    return Canary(j)

                return client_fn

            canary_apps = [
                ClientApp(client_fn=canary_fn(j), mods=self.mods) for j in range(self.canaries.m)
            ]
        else:
            from flwr.app import Array, ArrayRecord, Message, MetricRecord

            real_app = ClientApp(mods=self.mods)
            last: dict = {}

            @real_app.train()
            def _real(msg, ctx):
                (akey,) = list(msg.content.array_records)
                rec = msg.content[akey]
                block = rec[BLOCK_KEY].numpy()
                msg.content[akey] = ArrayRecord({k: rec[k] for k in rec.keys() if k != BLOCK_KEY})
                try:  # the content may be shared by the round's messages: restore it
                    reply = run.train(msg, ctx)
                finally:
                    msg.content[akey] = rec
                if reply.has_error():
                    return reply
                (rkey,) = list(reply.content.array_records)
                out = reply.content[rkey]
                reply.content[rkey] = ArrayRecord(
                    {**{k: out[k] for k in out.keys()}, BLOCK_KEY: Array(block)}
                )
                (mkey,) = list(reply.content.metric_records)
                wkey = getattr(run.inner, "weighted_by_key", "num-examples")
                metrics = reply.content[mkey]
                if wkey in metrics:
                    run.real_sizes[ctx.node_id] = float(metrics[wkey])
                last["keys"] = (rkey, mkey, dict(metrics))
                return reply

            canary_apps = []
            for j in range(self.canaries.m):
                app = ClientApp(mods=self.mods)

                @app.train()
                def _canary(msg, ctx, j=j):
                    (akey,) = list(msg.content.array_records)
                    rec = msg.content[akey]
                    arrays = {k: rec[k].numpy() for k in rec.keys()}
                    arrays[BLOCK_KEY] = run._canary_block(arrays[BLOCK_KEY], j)
                    rkey, mkey, metrics = last.get("keys", ("arrays", "metrics", {}))
                    wkey = getattr(run.inner, "weighted_by_key", "num-examples")
                    # the weight in the real replies' type (an int count stays an int)
                    n = run._canary_examples()
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
        for i in range(self.k):
            node = FIRST_NODE + i
            ctx = Context(1, node, {"partition-id": i, "num-partitions": self.k}, RecordDict(), {})
            apps[node] = (real_app, ctx, False)
        for j, node in enumerate(self.canary_nodes):
            ctx = Context(1, node, {"canary": j}, RecordDict(), {})
            apps[node] = (canary_apps[j], ctx, True)
        return apps

    # --- the recording hooks (instance attributes, removed after the run)

    def _on_reply(self, msg, reply, is_canary: bool) -> None:
        if not (is_canary and self.mode == "local_dp" and self.records):
            return
        j = self.canary_nodes.index(msg.metadata.dst_node_id)
        if reply.has_error():
            raise RuntimeError(f"canary {j}'s ClientApp failed: {reply.error.reason}")
        if self.api == "legacy":
            from flwr.common import parameters_to_ndarrays
            from flwr.compat.common import recorddict_compat as compat

            nd = parameters_to_ndarrays(
                compat.recorddict_to_fitres(reply.content, keep_input=True).parameters
            )
            block = nd[-1]
        else:
            (akey,) = list(reply.content.array_records)
            block = reply.content[akey][BLOCK_KEY].numpy()
        self.records[-1].canary_replies[j] = np.asarray(block, dtype=np.float64).copy()

    def _block_of(self, arrays) -> np.ndarray:
        if self.api == "legacy":
            from flwr.common import parameters_to_ndarrays

            return np.asarray(parameters_to_ndarrays(arrays)[-1], dtype=np.float64).copy()
        return np.asarray(arrays[BLOCK_KEY].numpy(), dtype=np.float64).copy()

    def _sigma_now(self) -> float:
        if self.local is not None:
            lm = self.local
            return float(lm.sensitivity * np.sqrt(2 * np.log(1.25 / lm.delta)) / lm.epsilon)
        return float(self.strategy.noise_multiplier)

    def _install(self) -> list:
        s, inner, run = self.strategy, self.inner, self
        legacy = self.api == "legacy"
        conf_name = "configure_fit" if legacy else "configure_train"
        agg_name = "aggregate_fit" if legacy else "aggregate_train"
        conf, agg, inner_agg = getattr(s, conf_name), getattr(s, agg_name), getattr(inner, agg_name)

        def configure(server_round, arrays, *rest):
            rec = RoundRecord(server_round, run._block_of(arrays), clip=run.clip_now())
            run.records.append(rec)
            out = list(conf(server_round, arrays, *rest))
            if legacy:
                rec.cohort = [int(p.node_id) for p, _ in out]
            else:
                rec.cohort = [int(m.metadata.dst_node_id) for m in out]
            return out

        def inner_aggregate(server_round, results, *rest):
            rec = run.records[-1]
            if legacy:
                rec.weights = [(int(p.node_id), float(r.num_examples)) for p, r in results]
            else:
                results = list(results)
                wkey = getattr(inner, "weighted_by_key", "num-examples")
                for msg in results:
                    mrec = next(iter(msg.content.metric_records.values()))
                    rec.weights.append((int(msg.metadata.src_node_id), float(mrec[wkey])))
            return inner_agg(server_round, results, *rest)

        def aggregate(server_round, results, *rest):
            out = agg(server_round, results, *rest)
            rec = run.records[-1]
            rec.noise_clip, rec.sigma = run.clip_now(), run._sigma_now()
            if out[0] is not None:
                rec.after = run._block_of(out[0])
            return out

        setattr(s, conf_name, configure)
        setattr(s, agg_name, aggregate)
        if inner is not s:
            setattr(inner, agg_name, inner_aggregate)
        return [(s, conf_name), (s, agg_name), (inner, agg_name)]

    def run(self) -> FlowerRun:
        """Train ``rounds`` rounds in this process with the canaries (module doc)."""
        if self._done:
            raise RuntimeError("this FlowerRun already ran; build a new one")
        self._done = True
        if self.seed is not None:  # Flower samples with `random` and noises with np.random
            random.seed(self.seed)
            np.random.seed(self.seed)
        grid = _make_grid(self._apps(), self._on_reply)
        installed = self._install()
        quiet = logging.getLogger("flwr")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        block0 = np.zeros(self.canaries.m)
        with _task_identity():
            self._train(grid, block0, installed, quiet, level)
        return self

    def _train(self, grid, block0, installed, quiet, level) -> None:
        try:
            if self.api == "legacy":
                self._legacy_loop(grid, [*self.arrays, block0])
            else:
                from flwr.app import Array, ArrayRecord, ConfigRecord

                init = ArrayRecord(
                    {
                        **{n: Array(a) for n, a in zip(self.names, self.arrays, strict=True)},
                        BLOCK_KEY: Array(block0),
                    }
                )
                self.strategy.start(
                    grid=grid,
                    initial_arrays=init,
                    num_rounds=self.rounds,
                    train_config=ConfigRecord(),
                )
        finally:
            quiet.setLevel(level)
            for obj, name in installed:
                obj.__dict__.pop(name, None)

    def _legacy_loop(self, grid, arrays) -> None:
        """``flwr.server.Server.fit_round``'s loop, sequential (flwr 1.42
        flwr/server/server.py: configure_fit, fit_clients, aggregate_fit)."""
        from flwr.common import ndarrays_to_parameters
        from flwr.server.client_manager import SimpleClientManager

        cm = SimpleClientManager()
        for node in grid.get_node_ids():
            cm.register(_grid_proxy(node, grid))
        params = ndarrays_to_parameters(arrays)
        for r in range(1, self.rounds + 1):
            ins = self.strategy.configure_fit(r, params, cm)
            # real clients first, as LocalGrid orders a round's messages (canaries report
            # the largest size the real clients reported)
            canary = set(self.canary_nodes)
            ins = sorted(ins, key=lambda pi: int(pi[0].node_id) in canary)
            results = [(p, p.fit(i, timeout=None, group_id=r)) for p, i in ins]
            new, _ = self.strategy.aggregate_fit(r, results, [])
            if new is not None:
                params = new

    def audit(self, claim, *, alpha: float = 0.05, permutations: int = 19_999, seed=None) -> dict:
        """The audit of this run against ``claim`` (:func:`audit.libraries.flower_audit.audit_run`)."""
        if not self._done:
            raise RuntimeError("call run() before audit()")
        from audit.libraries.flower_audit import audit_run

        return audit_run(self, claim, alpha=alpha, permutations=permutations, seed=seed)


def audit_flower(
    strategy,
    *,
    claim,
    num_clients: int,
    initial_arrays,
    rounds: int,
    client_fn=None,
    train=None,
    mods=(),
    canaries: FlowerCanaries | None = None,
    seed: int | None = None,
    alpha: float = 0.05,
    permutations: int = 19_999,
) -> dict:
    """Run a Flower DP training with canary clients and audit it against ``claim`` (the
    module doc; the result's keys are those of :meth:`audit.libraries.opacus.OpacusAudit.
    audit`). The claim is checked before the training starts.

    ``seed`` (tests and benchmarks; None in an audit) seeds Python's ``random`` and numpy's
    global generator, which Flower samples its cohorts and draws its noise from, for the
    whole process; the canaries' inclusion bits come from ``canaries.seed``."""
    from audit.libraries.flower_audit import check_claim_fields

    check_claim_fields(claim)
    run = FlowerRun(
        strategy,
        num_clients=num_clients,
        initial_arrays=initial_arrays,
        rounds=rounds,
        client_fn=client_fn,
        train=train,
        mods=mods,
        canaries=canaries,
        seed=seed,
    ).run()
    return run.audit(claim, alpha=alpha, permutations=permutations, seed=seed)
