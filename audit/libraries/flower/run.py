"""One in-process Flower training with canary clients (:class:`FlowerRun`) and the one call
that runs and audits it (:func:`audit_flower`); :mod:`audit.libraries.flower` says what
travels. The recording hooks wrap the strategy's ``configure``/``aggregate`` methods for
the run (instance attributes, removed after it).

flwr is imported only inside functions.
"""

from __future__ import annotations

import logging
import random

import numpy as np

from audit.libraries.flower.canaries import (
    BLOCK_KEY,
    COVERED_INNER,
    EXCLUDED_GAIN,
    FIRST_NODE,
    FlowerCanaries,
    RoundRecord,
    failures_of,
)
from audit.libraries.flower.clients import build_apps, record_reply
from audit.libraries.flower.compat import classify, grid_proxy, task_identity
from audit.libraries.flower.grid import make_grid
from audit.libraries.flower.verdict import check_claim_fields

__all__ = ["FlowerRun", "audit_flower"]


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
        inject_failures=(),
    ) -> None:
        mods = list(mods)
        self.api, self.mode = classify(strategy, mods)
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
        self.failures = failures_of(inject_failures, num_clients)
        self.fates: dict[int, str] = {}  # this round's injected failures: node id -> kind
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

    def canary_examples(self) -> float:
        if self.canaries.canary_examples is not None:
            return self.canaries.canary_examples
        return max(self.real_sizes.values(), default=1)

    def canary_update(self, block: np.ndarray, j: int) -> np.ndarray:
        """Canary j's reply on the block: gain·C on its coordinate when included, else
        10⁻⁹·C."""
        out = np.array(block, dtype=np.float64, copy=True)
        # an excluded canary's update is 1e-9·C, not 0: Flower's clip divides C by the
        # update's norm (flwr 1.42 supercore/differential_privacy.py:56), a zero update
        # raises ZeroDivisionError in the wrapper
        gain = self.canaries.gain_factor if self.canaries.included[j] else EXCLUDED_GAIN
        out[j] += gain * self.clip_now()
        return out

    def _block_of(self, arrays) -> np.ndarray:
        if self.api == "legacy":
            from flwr.common import parameters_to_ndarrays

            return np.asarray(parameters_to_ndarrays(arrays)[-1], dtype=np.float64).copy()
        return np.asarray(arrays[BLOCK_KEY].numpy(), dtype=np.float64).copy()

    def fate(self, node: int) -> str | None:
        """The failure injected into ``node``'s reply this round (None: none)."""
        return self.fates.get(int(node))

    def _set_fates(self, server_round: int, cohort: list[int]) -> None:
        real = sorted(n for n in cohort if n not in set(self.canary_nodes))
        self.fates = {}
        for f in self.failures:
            if f.round != server_round or not real:
                continue
            node = real[0] if f.client is None else FIRST_NODE + f.client
            if node in real:
                self.fates[node] = f.kind

    @staticmethod
    def _nonfinite(arrays, legacy: bool) -> int:
        if legacy:
            from flwr.common import parameters_to_ndarrays

            nd = parameters_to_ndarrays(arrays)
        else:
            nd = arrays.to_numpy_ndarrays()
        return int(sum(np.size(a) - np.count_nonzero(np.isfinite(a)) for a in nd))

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
            run._set_fates(server_round, rec.cohort)
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
                rec.nonfinite = run._nonfinite(out[0], legacy)
            return out

        setattr(s, conf_name, configure)
        setattr(s, agg_name, aggregate)
        if inner is not s:
            setattr(inner, agg_name, inner_aggregate)
        installed = [(s, conf_name), (s, agg_name), (inner, agg_name)]
        if not legacy:
            # training rounds only (fraction_evaluate = 0 is required): flwr 1.21–1.3x still
            # samples min_evaluate_nodes for evaluation at fraction 0, whose replies then
            # fail FedAvg's reply validation (IndexError) without a ClientApp evaluate
            s.configure_evaluate = lambda *a, **k: []
            installed.append((s, "configure_evaluate"))
        return installed

    def run(self) -> FlowerRun:
        """Train ``rounds`` rounds in this process with the canaries (module doc)."""
        if self._done:
            raise RuntimeError("this FlowerRun already ran; build a new one")
        self._done = True
        if self.seed is not None:  # Flower samples with `random` and noises with np.random
            random.seed(self.seed)
            np.random.seed(self.seed)
        grid = make_grid(
            build_apps(self),
            lambda *a: record_reply(self, *a),
            timed_out=lambda msg: self.fate(msg.metadata.dst_node_id) == "timeout",
        )
        installed = self._install()
        quiet = logging.getLogger("flwr")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        block0 = np.zeros(self.canaries.m)
        with task_identity():
            self._train(grid, block0, installed, quiet, level)
        return self

    def _train(self, grid, block0, installed, quiet, level) -> None:
        try:
            if self.api == "legacy":
                self._legacy_loop(grid, [*self.arrays, block0])
            else:
                from flwr.common import Array, ArrayRecord, ConfigRecord

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
        flwr/server/server.py: configure_fit, fit_clients, aggregate_fit): a client whose
        ``fit`` raises (its ClientApp raised, or its reply timed out: the grid proxy raises)
        or replies with a status other than OK is a failure, passed to ``aggregate_fit`` as
        ``fit_clients`` collects it (Flower's DP wrappers then skip the round)."""
        from flwr.common import Code, ndarrays_to_parameters
        from flwr.server.client_manager import SimpleClientManager

        cm = SimpleClientManager()
        for node in grid.get_node_ids():
            cm.register(grid_proxy(node, grid))
        params = ndarrays_to_parameters(arrays)
        for r in range(1, self.rounds + 1):
            ins = self.strategy.configure_fit(r, params, cm)
            # real clients first, as LocalGrid orders a round's messages (canaries report
            # the largest size the real clients reported)
            canary = set(self.canary_nodes)
            ins = sorted(ins, key=lambda pi: int(pi[0].node_id) in canary)
            results, failures = [], []
            for p, i in ins:
                try:
                    res = p.fit(i, timeout=None, group_id=r)
                except Exception as ex:  # fit_clients: the future's exception is a failure
                    failures.append(ex)
                    self.records[-1].failed.setdefault(int(p.node_id), f"raised: {ex}")
                    continue
                if res.status.code == Code.OK:
                    results.append((p, res))
                else:
                    failures.append((p, res))
                    self.records[-1].failed[int(p.node_id)] = f"status {res.status.code}"
            new, _ = self.strategy.aggregate_fit(r, results, failures)
            if new is not None:
                params = new

    def audit(self, claim, *, alpha: float = 0.05, permutations: int = 19_999, seed=None) -> dict:
        """The audit of this run against ``claim`` (:func:`audit.libraries.flower.checks.audit_run`)."""
        if not self._done:
            raise RuntimeError("call run() before audit()")
        from audit.libraries.flower.checks import audit_run

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
    inject_failures=(),
    alpha: float = 0.05,
    permutations: int = 19_999,
) -> dict:
    """Run a Flower DP training with canary clients and audit it against ``claim`` (the
    module doc; the result's keys are those of :meth:`audit.libraries.opacus.OpacusAudit.
    audit`). The claim is checked before the training starts.

    ``seed`` (tests and benchmarks; None in an audit) seeds Python's ``random`` and numpy's
    global generator, which Flower samples its cohorts and draws its noise from, for the
    whole process; the canaries' inclusion bits come from ``canaries.seed``.

    ``inject_failures``: :class:`~audit.libraries.flower.canaries.ClientFailure`s (or
    ``(round, client, kind)`` tuples) that make a real client raise, time out or reply NaN
    in a round; the run handles them as Flower does and the audit names what they did."""
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
        inject_failures=inject_failures,
    ).run()
    return run.audit(claim, alpha=alpha, permutations=permutations, seed=seed)
