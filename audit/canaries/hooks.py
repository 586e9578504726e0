"""Hooks that add a canary set (:mod:`audit.canaries.outside`, ``fedlora canaries new``) to a
training the toolkit does not run, and record what the audit needs.

They run on the OPERATOR's side: they read the set's secret inclusion bits
(``DIR/private/``) and its key, because the training has to add exactly the included
canaries. The observation file they write holds only DP outputs (privatized step sums,
released aggregates) or the trained model's losses, and public σ, C, q; it carries no
inclusion bit. Then ``fedlora audit --canaries DIR --observations FILE --claim CLAIM``.

Gradient canaries, DP-SGD (sample level)::

    from audit.canaries.hooks import GradientCanaryHook, write_params
    write_params(model, "params.json")           # before `fedlora canaries new --params`
    hook = GradientCanaryHook.load("canaries/")
    # Opacus: after PrivacyEngine.make_private(...)
    hook.attach_opacus(optimizer, model, sample_rate=data_loader.sample_rate)
    ... train as usual (optimizer.step()) ...
    hook.write_observations("obs.npz")

    # a plain PyTorch loop (you compute per-sample gradients, clip, sum and add noise)
    hook = GradientCanaryHook.load("canaries/", sample_rate=q, sigma=sigma)
    hook.bind(trainable_named_parameters)
    for step ...:
        rows = hook.canary_rows()                 # per parameter: (n, *shape), K·C·e_j rows
        per_sample = [torch.cat([g, r]) for g, r in zip(per_sample, rows)]
        summed = clipped_sum(per_sample)          # your clip, your sum
        noisy = [s + noise for s in summed]       # your noise
        hook.observe(noisy)                       # the privatized SUM (before / batch size)
        ...
    hook.write_observations("obs.npz")

Each step draws one Bernoulli(q) coin per canary from the set's key (stream
``("outside-gradient-coins", step)``), included or not; an included canary whose coin is
1 enters the step as one more per-sample gradient K·C·e_j (K = 100) that the training's own
clip must reduce to C·e_j. Where per-sample gradients are out of reach,
:meth:`GradientCanaryHook.add_clipped` adds the clipped C·e_j to the clipped sum instead
(the clip is then not tested).

Input canaries: :func:`input_canaries` gives the (text, label) records to add to the
training data; after training, :func:`write_input_observations` records each canary's loss
under the trained model (all canaries, included or not).

Canary clients, client-level DP (Flower)::

    hook = ClientCanaryHook.load("canaries/")
    strategy = DifferentialPrivacyServerSideFixedClipping(FedAvg(...), sigma, C, m)
    hook.attach_flower(strategy)                  # before the ServerApp runs it
    ... run ...
    hook.write_observations("obs.npz")

or, for any server loop on flat numpy vectors: add ``hook.contribution(r)`` to the clipped
sum of round r before the noise (and the division by m), and pass the released update
(new global − old global) to ``hook.observe(r, update, sigma=, clip=, clients_per_round=)``.

torch, opacus and flwr are imported only by the functions that use them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.canaries import canary_set as CS
from audit.canaries import outside as O
from fl.errors import UsageError

__all__ = [
    "ClientCanaryHook",
    "GradientCanaryHook",
    "describe",
    "input_canaries",
    "write_input_observations",
    "write_params",
]


# --------------------------------------------------------------------------- parameters


def describe(model) -> dict:
    """The trainable parameters of ``model`` as ``fedlora canaries new --params`` reads
    them: ``{"params": [{"name", "shape", "group"}]}``, in ``named_parameters()`` order
    (Opacus's ``_module.`` prefix removed; group ``lora_A`` / ``lora_B`` / ``other``)."""
    return {
        "params": [
            {"name": CS.clean_name(n), "shape": list(p.shape), "group": CS.group_of_name(n)}
            for n, p in model.named_parameters()
            if p.requires_grad
        ]
    }


def write_params(model, path) -> Path:
    """Write :func:`describe` of ``model`` to ``path`` (JSON)."""
    import json

    p = Path(path)
    p.write_text(json.dumps(describe(model), indent=1) + "\n", encoding="utf-8")
    return p


# --------------------------------------------------------------------------- gradient


class GradientCanaryHook:
    """Gradient (Dirac) canaries in an outside DP-SGD loop (module doc).

    ``sample_rate`` q: the probability with which the training samples a record into a
    step (Poisson; Opacus: ``data_loader.sample_rate``, 1/len(data_loader)); 1 when
    every step uses every record or batches are fixed. ``sigma``: the noise multiplier
    (Opacus: read from the optimizer)."""

    def __init__(self, cset: CS.CanarySet, sample_rate: float | None = None, sigma=None):
        if cset.kind != "gradient":
            raise UsageError(f"{cset.folder} holds {cset.kind} canaries, not gradient canaries")
        if cset.key is None:
            raise UsageError(
                f"{cset.folder}: the set's key is needed for the canaries' Poisson coins "
                "(private/noise.key, or key_file=)"
            )
        self.cset = cset
        sp = cset.spec
        self.clip = float(sp["clip"])
        self.pre_clip = float(sp["pre_clip"])
        self.m = cset.count
        self.included = cset.included
        self.q = None
        self.sigma = None
        if sample_rate is not None:
            self._set_rate(sample_rate)
        if sigma is not None:
            self._set_sigma(sigma)
        self.step = 0
        self.inserted = False  # canaries placed in the current step
        self.observed: list[np.ndarray] = []
        self.source = "plain"
        self._bound = None
        self._coins = None
        self.expected_batch_size = None

    @classmethod
    def load(cls, folder, *, sample_rate=None, sigma=None, key_file=None) -> GradientCanaryHook:
        return cls(CS.load_canary_set(folder, key_file=key_file), sample_rate, sigma)

    def _set_rate(self, q) -> None:
        q = float(q)
        if not (math.isfinite(q) and 0 < q <= 1):
            raise UsageError(f"sample_rate must be in (0, 1], got {q}")
        if self.q is not None and q != self.q:
            raise UsageError(f"sample_rate {q} differs from the {self.q} given before")
        self.q = q

    def _set_sigma(self, s) -> None:
        s = float(s)
        if not (math.isfinite(s) and s >= 0):
            raise UsageError(f"sigma must be finite and >= 0, got {s}")
        self.sigma = s

    # ---------------------------------------------------------------- binding
    def bind(self, named_params) -> None:
        """The training's trainable parameters, ``(name, tensor)`` in the order the loop
        passes per-sample gradients, sums and noisy sums. Every parameter of the set must
        be there with its shape (more parameters are fine: their canary rows are 0)."""
        import torch

        named = [(CS.clean_name(n), p) for n, p in named_params]
        index = {n: i for i, (n, _) in enumerate(named)}
        for sp in self.cset.spec["params"]:
            if sp["name"] not in index:
                raise UsageError(f"parameter {sp['name']!r} of the canary set is not trained here")
            shape = list(named[index[sp["name"]]][1].shape)
            if shape != sp["shape"]:
                raise UsageError(
                    f"parameter {sp['name']!r}: shape {shape} here, {sp['shape']} in the set"
                )
        coords = self.cset.spec["coordinates"]
        self._bound = {
            "params": [p for _, p in named],
            "names": [n for n, _ in named],
            "which": np.asarray([index[c["param"]] for c in coords], dtype=np.int64),
            "flat": torch.as_tensor([int(c["index"]) for c in coords], dtype=torch.long),
        }

    def _need_bound(self) -> dict:
        if self._bound is None:
            raise RuntimeError("bind() (or attach_opacus()) the trained parameters first")
        if self.q is None:
            raise RuntimeError("the sampling rate is unknown: give sample_rate")
        return self._bound

    def _sampled(self) -> np.ndarray:
        """The canaries in this step: included and their coin (drawn for all M) is 1."""
        from fl.privacy import rng as R

        if self._coins is None:
            src = self.cset.key.stream(CS.COIN_STREAM, self.step)
            self._coins = R.bernoulli_mask(src, self.m, self.q).numpy().astype(bool)
        return np.flatnonzero(self._coins & self.included)

    def _mark(self) -> None:
        if self.inserted:
            raise RuntimeError(
                "canaries were already placed in this step: observe() the step's noisy sum first"
            )
        self.inserted = True

    # ---------------------------------------------------------------- the step
    def canary_rows(self) -> list:
        """This step's canary per-sample gradients, one tensor per bound parameter of shape
        (n, *shape) (n sampled included canaries; row r is K·C at canary r's coordinate
        and 0 elsewhere, in every parameter): to append to the per-sample gradients
        before the clip."""
        import torch

        b = self._need_bound()
        self._mark()
        sel = self._sampled()
        rows = []
        for i, p in enumerate(b["params"]):
            r = torch.zeros((sel.size, p.numel()), dtype=p.dtype, device=p.device)
            mine = np.flatnonzero(b["which"][sel] == i)
            if mine.size:
                at = b["flat"][sel[mine]].to(p.device)
                r[torch.as_tensor(mine, device=p.device), at] = self.pre_clip * self.clip
            rows.append(r.reshape((sel.size, *p.shape)))
        return rows

    def add_clipped(self, summed) -> None:
        """Add the clipped gradients C·e_j of this step's sampled included canaries to the
        clipped sum (a list of tensors in bound order, or a dict by name), in place, when
        per-sample gradients cannot be reached (the clip is then not tested)."""
        b = self._need_bound()
        self._mark()
        sel = self._sampled()
        ts = self._tensors(summed)
        for j in sel.tolist():
            t = ts[int(b["which"][j])]
            t.view(-1)[int(b["flat"][j])] += self.clip

    def _tensors(self, xs) -> list:
        b = self._bound
        if isinstance(xs, dict):
            return [xs[n] for n in b["names"]]
        xs = list(xs)
        if len(xs) != len(b["params"]):
            raise ValueError(f"expected {len(b['params'])} tensors, got {len(xs)}")
        return xs

    def observe(self, noisy_sum, scale: float = 1.0) -> None:
        """Record this step's privatized sum Σ clip(g_i) + N(0, σ²C²) (before any division
        by the batch size; else give ``scale`` to multiply it back) at every canary's
        coordinate, and end the step."""
        b = self._need_bound()
        if not self.inserted:
            raise RuntimeError("observe(): no canaries were placed in this step (canary_rows)")
        ts = self._tensors(noisy_sum)
        row = np.empty(self.m, dtype=np.float64)
        for i, t in enumerate(ts):
            mine = np.flatnonzero(b["which"] == i)
            if mine.size:
                flat = t.detach().reshape(-1)
                vals = flat.index_select(0, b["flat"][mine].to(flat.device)).double().cpu()
                row[mine] = vals.numpy() * scale
        self.observed.append(row)
        self.step += 1
        self.inserted = False
        self._coins = None

    # ---------------------------------------------------------------- Opacus
    def attach_opacus(self, optimizer, model, sample_rate=None) -> None:
        """Hook an Opacus 1.6 ``DPOptimizer`` (after ``PrivacyEngine.make_private``):

        - ``clip_and_accumulate``: before Opacus clips, the step's canary rows are
          appended to every parameter's ``p.grad_sample`` (once per logical step: not
          in the physical batches ``BatchMemoryManager`` marks as skipped), so Opacus's
          own clip and noise act on them;
        - ``add_noise``: right after Opacus adds the noise, ``p.grad`` is the privatized
          sum (not yet divided by the expected batch size): it is observed there.

        ``model``: the module whose ``named_parameters`` name the optimizer's parameters
        (the ``GradSampleModule`` or what it wraps); ``sample_rate``: Opacus's
        ``data_loader.sample_rate``."""
        from opacus.optimizers.optimizer import DPOptimizer

        if type(optimizer) is not DPOptimizer:
            raise UsageError(
                f"attach_opacus supports Opacus's DPOptimizer (flat clipping); got "
                f"{type(optimizer).__name__} (distributed, per-layer, adaptive or ghost clipping "
                "are not supported: use the plain-loop hook)"
            )
        if sample_rate is not None:
            self._set_rate(sample_rate)
        if not math.isclose(float(optimizer.max_grad_norm), self.clip, rel_tol=1e-9):
            raise UsageError(
                f"the optimizer clips at max_grad_norm = {optimizer.max_grad_norm}, the canary "
                f"set at C = {self.clip}"
            )
        self._set_sigma(optimizer.noise_multiplier)
        names = {id(p): n for n, p in model.named_parameters()}
        params = list(optimizer.params)
        missing = [i for i, p in enumerate(params) if id(p) not in names]
        if missing:
            raise UsageError("attach_opacus: the optimizer's parameters are not the model's")
        self.bind([(names[id(p)], p) for p in params])
        self.source = "opacus"
        self.expected_batch_size = optimizer.expected_batch_size
        clip_and_accumulate, add_noise = optimizer.clip_and_accumulate, optimizer.add_noise
        hook = self

        def clip_with_canaries():
            if not optimizer._check_skip_next_step(pop_next=False):
                import torch

                for p, r in zip(optimizer.params, hook.canary_rows()):
                    gs = p.grad_sample
                    if isinstance(gs, list):
                        gs[-1] = torch.cat([gs[-1], r.to(gs[-1].dtype)])
                    else:
                        p.grad_sample = torch.cat([gs, r.to(gs.dtype)])
            clip_and_accumulate()

        def noise_then_observe():
            add_noise()
            hook.observe([p.grad for p in optimizer.params])

        optimizer.clip_and_accumulate = clip_with_canaries
        optimizer.add_noise = noise_then_observe

    # ---------------------------------------------------------------- output
    def observations(self) -> dict:
        """The observation record (:func:`audit.canaries.outside.write_observations`)."""
        if self.sigma is None:
            raise RuntimeError("sigma is unknown: give sigma= to load() (plain loops)")
        obs = np.stack(self.observed) if self.observed else np.zeros((0, self.m))
        out = {
            "kind": "gradient",
            "set_sha256": self.cset.sha256,
            "obs": obs,
            "sigma": float(self.sigma),
            "clip": self.clip,
            "q": float(self.q),
            "steps": int(obs.shape[0]),
            "source": self.source,
        }
        if self.expected_batch_size is not None:
            out["expected_batch_size"] = float(self.expected_batch_size)
        return out

    def write_observations(self, path) -> Path:
        return O.write_observations(path, self.observations())


# --------------------------------------------------------------------------- input


def input_canaries(folder, key_file=None) -> list[tuple[str, int]]:
    """The (text, label) records of the INCLUDED input canaries: add each to the training
    data (one more record each, replacing nothing)."""
    cs = CS.load_canary_set(folder, key_file=key_file)
    if cs.kind != "input":
        raise UsageError(f"{folder} holds {cs.kind} canaries, not input canaries")
    recs = cs.spec["records"]
    return [(recs[j]["text"], int(recs[j]["label"])) for j in np.flatnonzero(cs.included)]


def write_input_observations(path, folder, *, losses=None, scores=None) -> Path:
    """Write every canary's loss (or score, higher = more likely trained on) under the
    trained model, in the set's order (included or not)."""
    cs = CS.load_canary_set(folder, private=False, verify=False)
    if (losses is None) == (scores is None):
        raise ValueError("give losses or scores")
    name, v = ("loss", losses) if losses is not None else ("score", scores)
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    if v.shape != (cs.count,):
        raise ValueError(f"expected {cs.count} values, got {v.shape}")
    return O.write_observations(path, {"kind": "input", "set_sha256": cs.sha256, name: v})


# --------------------------------------------------------------------------- client


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
            cc, bits, _ = CS.client_canaries(
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
        return O.write_observations(path, self.observations())

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
