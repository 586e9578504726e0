"""Canary clients at the server of a client-level DP training the toolkit does not run: the
operator's side of a ``client`` canary set (:mod:`audit.canaries.outside`; the sample-level
hooks are :mod:`audit.canaries.hooks`).

Flower (Message API)::

    hook = ClientCanaryHook.load("canaries/")
    strategy = DifferentialPrivacyServerSideFixedClipping(FedAvg(...), sigma, C, m)
    hook.attach_flower(strategy)                  # before the ServerApp runs it
    ... run ...
    hook.write_observations("obs.npz")

or, for any server loop on flat numpy vectors: add ``hook.contribution(r)`` to the clipped
sum of round r before the noise (and the division by m), and pass the released update
(new global − old global) to ``hook.observe(r, update, sigma=, clip=, clients_per_round=)``.

flwr is imported only by :meth:`ClientCanaryHook.attach_flower`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.canaries import canary_set as CS
from audit.canaries import observations as OB
from audit.canaries.draw import client_canaries
from fl.errors import UsageError

__all__ = ["ClientCanaryHook"]


class ClientCanaryHook:
    """Canary clients at the server of a client-level DP training (module doc). Numpy
    core: :meth:`contribution` and :meth:`observe`; :meth:`attach_flower` wires them into
    a Flower ``DifferentialPrivacy*FixedClipping`` strategy (Message API)."""

    def __init__(self, cset: CS.CanarySet):
        if cset.kind != "client":
            raise UsageError(f"{cset.folder} holds {cset.kind} canaries, not canary clients")
        self.cset = cset
        sp = cset.spec
        self.m, self.dim, self.clip = cset.count, int(sp["dim"]), float(sp["clip"])
        self.poisson = sp["participation"] == "poisson"
        if self.poisson and cset.key is None:
            raise UsageError(
                f"{cset.folder}: the set's key is needed for the Poisson participation coins"
            )
        self.included = cset.included
        self._cc = None
        if self.poisson:
            cc, bits, _ = client_canaries(
                cset.key, self.m, self.clip, self.dim, "poisson", float(sp["rate"])
            )
            if not np.array_equal(bits, self.included):
                raise UsageError(f"{cset.folder}: the inclusion bits do not derive from the key")
            self._cc = cc
        d = cset.directions
        self.disjoint = d["mode"] == "disjoint"
        if self.disjoint:
            self.support, self.signs = d["support"], d["signs"]
        else:
            self.dirs = d["dirs"].astype(np.float64)
        self.rounds: list[int] = []
        self.inner: list[np.ndarray] = []
        self.norms: list[float] = []
        self.total = np.zeros(self.dim, dtype=np.float64)
        self.meta: dict = {}

    @classmethod
    def load(cls, folder, key_file=None) -> ClientCanaryHook:
        return cls(CS.load_canary_set(folder, key_file=key_file))

    def taking_part(self, r: int) -> np.ndarray:
        """Canaries that contribute in round ``r``: included and (Poisson participation)
        their coin for the round is 1 (stream ``("canary-client-coins", r)``, all M drawn)."""
        if self.poisson:
            return self._cc.taking_part(int(r))
        return np.flatnonzero(self.included)

    def direction(self, j: int) -> np.ndarray:
        """Canary j's unit direction (d,)."""
        if not self.disjoint:
            return self.dirs[j].copy()
        v = np.zeros(self.dim, dtype=np.float64)
        v[self.support[j]] = self.signs[j]
        return v

    def contribution(self, r: int) -> np.ndarray:
        """Σ C·ĉ_j over the canaries taking part in round ``r`` (d,): add it to the
        round's clipped SUM before the server's noise (divide by m with the sum)."""
        out = np.zeros(self.dim, dtype=np.float64)
        ids = self.taking_part(r)
        if self.disjoint:
            for j in ids.tolist():
                out[self.support[j]] += self.clip * self.signs[j]
        elif ids.size:
            out += self.clip * self.dirs[ids].sum(axis=0)
        return out

    def inner_products(self, v: np.ndarray) -> np.ndarray:
        """⟨ĉ_j, v⟩ for every canary (M,)."""
        v = np.asarray(v, dtype=np.float64).reshape(-1)
        if v.shape != (self.dim,):
            raise ValueError(
                f"an update of {v.size} coordinates; the canary set has d = {self.dim}"
            )
        if self.disjoint:
            return (v[self.support] * self.signs).sum(axis=1)
        return self.dirs @ v

    def observe(self, r: int, update, *, sigma=None, clip=None, clients_per_round=None) -> None:
        """Record round ``r``'s released update Δ_r = new global − previous global (d,):
        its inner product with every canary direction and its norm."""
        v = np.asarray(update, dtype=np.float64).reshape(-1)
        self.inner.append(self.inner_products(v))
        self.norms.append(float(np.linalg.norm(v)))
        self.total += v
        self.rounds.append(int(r))
        for k, x in (("sigma", sigma), ("clip", clip), ("clients_per_round", clients_per_round)):
            if x is not None:
                if k in self.meta and self.meta[k] != x:
                    raise RuntimeError(f"{k} changed between rounds ({self.meta[k]} → {x})")
                self.meta[k] = x

    def observations(self) -> dict:
        for k in ("sigma", "clip", "clients_per_round"):
            if k not in self.meta:
                raise RuntimeError(f"{k} was never given to observe()")
        return {
            "kind": "client",
            "set_sha256": self.cset.sha256,
            "rounds": np.asarray(self.rounds, dtype=np.int64),
            "inner": np.stack(self.inner) if self.inner else np.zeros((0, self.m)),
            "norms": np.asarray(self.norms, dtype=np.float64),
            "final_inner": self.inner_products(self.total),
            "final_norm": float(np.linalg.norm(self.total)),
            "sigma": float(self.meta["sigma"]),
            "clip": float(self.meta["clip"]),
            "clients_per_round": int(self.meta["clients_per_round"]),
        }

    def write_observations(self, path) -> Path:
        return OB.write_observations(path, self.observations())

    # ---------------------------------------------------------------- Flower
    def attach_flower(self, dp_strategy):
        """Wire the canaries into a Flower (Message API) ``DifferentialPrivacyServerSide
        FixedClipping`` or ``...ClientSideFixedClipping`` strategy, in place (returned):

        - its inner strategy's ``aggregate_train`` (the average of the clipped updates,
          before the DP wrapper's noise) gets Σ C·ĉ_j / m added, m = ``num_sampled_clients``
          (the wrapper's noise σC/m is calibrated for m clients of weight 1/m each, so the
          inner strategy must weigh clients equally);
        - ``configure_train`` records the round's global arrays, ``aggregate_train``
          observes the released arrays minus them.
        """
        if not hasattr(dp_strategy, "configure_train") and hasattr(dp_strategy, "configure_fit"):
            raise UsageError(
                f"attach_flower wires a Message API strategy (flwr.serverapp.strategy); "
                f"{type(dp_strategy).__name__} is a legacy flwr.server.strategy one (configure_fit"
                "/aggregate_fit): audit a legacy Flower DP training with "
                "audit.libraries.flower.audit_flower, which drives its rounds with canary clients"
            )
        for a in ("strategy", "noise_multiplier", "clipping_norm", "num_sampled_clients"):
            if not hasattr(dp_strategy, a):
                raise UsageError(
                    f"attach_flower needs a Flower DP fixed-clipping strategy (no {a!r})"
                )
        if not math.isclose(float(dp_strategy.clipping_norm), self.clip, rel_tol=1e-9):
            raise UsageError(
                f"the strategy clips at {dp_strategy.clipping_norm}, the canary set at C = "
                f"{self.clip}"
            )
        inner = dp_strategy.strategy
        inner_aggregate = inner.aggregate_train
        configure, aggregate = dp_strategy.configure_train, dp_strategy.aggregate_train
        hook = self
        state: dict = {}

        def _flat(arrays) -> tuple[np.ndarray, list]:
            nd = arrays.to_numpy_ndarrays()
            return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in nd]), nd

        def inner_with_canaries(server_round, replies):
            from flwr.app import Array, ArrayRecord

            arrays, metrics = inner_aggregate(server_round, replies)
            if arrays is None:
                return arrays, metrics
            flat, nd = _flat(arrays)
            if flat.size != hook.dim:
                raise UsageError(
                    f"the aggregate has {flat.size} coordinates; the canary set has d = {hook.dim}"
                )
            add = hook.contribution(server_round) / dp_strategy.num_sampled_clients
            out, at = [], 0
            for a in nd:
                a = np.asarray(a)
                out.append((a + add[at : at + a.size].reshape(a.shape)).astype(a.dtype))
                at += a.size
            return ArrayRecord(
                {k: Array(v) for k, v in zip(arrays.keys(), out, strict=True)}
            ), metrics

        def configure_recording(server_round, arrays, config, grid):
            state[server_round] = _flat(arrays)[0]
            return configure(server_round, arrays, config, grid)

        def aggregate_observing(server_round, replies):
            arrays, metrics = aggregate(server_round, replies)
            if arrays is not None:
                before = state.pop(server_round, None)
                if before is None:
                    raise RuntimeError(f"round {server_round}: configure_train was not seen")
                hook.observe(
                    server_round,
                    _flat(arrays)[0] - before,
                    sigma=float(dp_strategy.noise_multiplier),
                    clip=float(dp_strategy.clipping_norm),
                    clients_per_round=int(dp_strategy.num_sampled_clients),
                )
            return arrays, metrics

        inner.aggregate_train = inner_with_canaries  # instance attribute: class unchanged
        dp_strategy.configure_train = configure_recording
        dp_strategy.aggregate_train = aggregate_observing
        return dp_strategy
