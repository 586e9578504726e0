"""Over 500 lines on purpose: the gradient canary hook, whose Opacus, plain-PyTorch and clipped-sum entry points share the canary rows, the coins and the observations file.

Hooks that add a canary set (:mod:`audit.canaries.outside`, ``fedlora canaries new``) to a
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
    # Opacus: after model, optimizer, data_loader = PrivacyEngine.make_private(...)
    hook.attach_opacus(optimizer, model, data_loader=data_loader)
    ... train as usual (optimizer.step()) ...
    hook.write_observations("obs.npz")

(``data_loader``: what ``make_private`` returned; q = 1/len(data_loader), Opacus's. With
``poisson_sampling=False`` it is the user's shuffled ``DataLoader``, without ``.sample_rate``,
whose batches Opacus still accounts as Poisson: a Poisson claim is then ``sampling_differs``.)

    # a plain PyTorch loop (you compute per-sample gradients, clip, sum and add noise)
    hook = GradientCanaryHook.load("canaries/", sample_rate=q, sigma=sigma)
    hook.bind(trainable_named_parameters)
    for step ...:
        rows = hook.canary_rows()                 # per parameter: (n, *shape), K·C·e_j rows
        per_sample = [torch.cat([g, r]) for g, r in zip(per_sample, rows)]
        summed = clipped_sum(per_sample)          # your clip, your sum
        noisy = [s + noise for s in summed]       # your noise
        hook.observe(noisy)                       # the privatized SUM (before / batch size)
        # or, if you only have the mean: hook.observe(mean, scale=batch_size)
        ...
    hook.write_observations("obs.npz")

Slips are named from the data: observations of the wrong shape are refused (expected and
given shape); observations divided by the batch size (the mean without ``scale=``) carry
about 1/B of the claim's noise AND of the canaries' C: ``write_observations`` warns, the
audit names it (``observations_look_averaged``) and fails the run.

Each step draws one Bernoulli(q) coin per canary from the set's key (stream
``("outside-gradient-coins", step)``), included or not; an included canary whose coin is
1 enters the step as one more per-sample gradient K·C·e_j (K = 100) that the training's own
clip must reduce to C·e_j. Where per-sample gradients are out of reach,
:meth:`GradientCanaryHook.add_clipped` adds the clipped C·e_j to the clipped sum instead
(the clip is then not tested: the file records ``canaries_entered = "clipped_sum"`` and the
audit reads the clipping untested).

Input canaries: :func:`input_canaries` gives the (text, label) records to add to the
training data; after training, :func:`write_input_observations` records each canary's loss
under the trained model (all canaries, included or not).

Canary clients, client-level DP (Flower): :class:`ClientCanaryHook`, in
:mod:`audit.canaries.client_hook` (importable from here too).

torch and opacus are imported only by the functions that use them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.canaries import canary_set as CS
from audit.canaries import observations as OB
from audit.canaries.client_hook import ClientCanaryHook
from audit.canaries.draw import clean_name, group_of_name
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
            {"name": clean_name(n), "shape": list(p.shape), "group": group_of_name(n)}
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
    step (Poisson; Opacus: read by :meth:`attach_opacus`, 1/len(data_loader)); 1 when
    every step uses every record or batches are fixed. ``sigma``: the noise multiplier
    (Opacus: read from the optimizer). ``expected_batch_size`` (optional, q·N): lets the
    audit name the batch size when the observations look divided by it."""

    def __init__(
        self,
        cset: CS.CanarySet,
        sample_rate: float | None = None,
        sigma=None,
        expected_batch_size: float | None = None,
    ):
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
        self.scales: list[float] = []
        self.entered: list[np.ndarray] = []  # per step: the canaries placed (bit and coin)
        self.source = "plain"
        self.entered_as: str | None = None  # "per_example" (canary_rows) / "clipped_sum"
        self.sampling: str | None = None  # "poisson" / "shuffle" when the hook knows it
        self.run_clip: float | None = None  # the run's C when the hook reads it (Opacus)
        self._bound = None
        self._coins = None
        self._entered_now = None
        self.expected_batch_size = None
        if expected_batch_size is not None:
            e = float(expected_batch_size)
            if not (math.isfinite(e) and e > 0):
                raise UsageError(f"expected_batch_size must be > 0, got {expected_batch_size}")
            self.expected_batch_size = e

    @classmethod
    def load(
        cls, folder, *, sample_rate=None, sigma=None, key_file=None, expected_batch_size=None
    ) -> GradientCanaryHook:
        return cls(
            CS.load_canary_set(folder, key_file=key_file), sample_rate, sigma, expected_batch_size
        )

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

        named = [(clean_name(n), p) for n, p in named_params]
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

    def _entered(self, how: str) -> None:
        """Record how the canaries enter (a training that mixes both reads as
        ``clipped_sum``: its clip was not exercised at every step)."""
        if self.entered_as != "clipped_sum":
            self.entered_as = how

    def _placed(self, sel: np.ndarray) -> None:
        row = np.zeros(self.m, dtype=bool)
        row[sel] = True
        self._entered_now = row

    # ---------------------------------------------------------------- the step
    def canary_rows(self) -> list:
        """This step's canary per-sample gradients, one tensor per bound parameter of shape
        (n, *shape) (n sampled included canaries; row r is K·C at canary r's coordinate
        and 0 elsewhere, in every parameter): to append to the per-sample gradients
        before the clip."""
        import torch

        b = self._need_bound()
        self._mark()
        self._entered("per_example")
        sel = self._sampled()
        self._placed(sel)
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
        ts = self._tensors(summed, "add_clipped()")
        self._mark()
        self._entered("clipped_sum")
        sel = self._sampled()
        self._placed(sel)
        for j in sel.tolist():
            t = ts[int(b["which"][j])]
            t.view(-1)[int(b["flat"][j])] += self.clip

    def _tensors(self, xs, what: str = "observe()") -> list:
        """``xs`` checked against the bound parameters (:func:`OB.step_tensors`)."""
        return OB.step_tensors(xs, self._bound["names"], self._bound["params"], what)

    def observe(self, noisy_sum, scale: float = 1.0) -> None:
        """Record this step's privatized sum Σ clip(g_i) + N(0, σ²C²) (before any division
        by the batch size; else give ``scale`` to multiply it back: the mean over a batch
        of B, ``scale=B``) at every canary's coordinate, and end the step. ``noisy_sum``: one
        tensor per bound parameter, each of the parameter's shape (a list in ``bind()``
        order or a dict by name)."""
        b = self._need_bound()
        if not self.inserted:
            raise RuntimeError("observe(): no canaries were placed in this step (canary_rows)")
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise UsageError(f"observe(): scale must be a finite number > 0, got {scale}")
        ts = self._tensors(noisy_sum)
        row = np.empty(self.m, dtype=np.float64)
        for i, t in enumerate(ts):
            mine = np.flatnonzero(b["which"] == i)
            if mine.size:
                flat = t.detach().reshape(-1)
                vals = flat.index_select(0, b["flat"][mine].to(flat.device)).double().cpu()
                row[mine] = vals.numpy() * scale
        if not np.isfinite(row).all():
            raise UsageError(
                f"observe(): step {self.step}'s observations hold NaN or Inf at "
                f"{int((~np.isfinite(row)).sum())} canary coordinate(s)"
            )
        self.observed.append(row)
        self.scales.append(scale)
        self.entered.append(self._entered_now)
        self.step += 1
        self.inserted = False
        self._coins = None

    # ---------------------------------------------------------------- Opacus
    def attach_opacus(self, optimizer, model, sample_rate=None, data_loader=None) -> None:
        """Hook an Opacus 1.6 ``DPOptimizer`` (after ``PrivacyEngine.make_private``):

        - ``clip_and_accumulate``: before Opacus clips, the step's canary rows are
          appended to every parameter's ``p.grad_sample`` (once per logical step: not
          in the physical batches ``BatchMemoryManager`` marks as skipped), so Opacus's
          own clip and noise act on them;
        - ``add_noise``: right after Opacus adds the noise, ``p.grad`` is the privatized
          sum (not yet divided by the expected batch size): it is observed there.

        ``model``: the module whose ``named_parameters`` name the optimizer's parameters
        (the ``GradSampleModule`` or what it wraps). The canaries' rate q, first that is
        given: ``data_loader`` (what ``make_private`` returned): 1/len(data_loader), the q
        Opacus accounts whether its batches are Poisson (a ``DPDataLoader``) or, with
        ``poisson_sampling=False``, the user's shuffled ``DataLoader`` (which has no
        ``sample_rate``; the hook records ``sampling = "shuffle"``, and a claim of Poisson
        sampling is then the audit's finding ``sampling_differs``); ``sample_rate``; else
        the rate ``make_private`` gave the optimizer's accountant hook (Opacus 1.6:
        ``accountant.get_optimizer_hook_fn(sample_rate)``). None of them: a clear error.
        (``optimizer.expected_batch_size`` is ``int(N·q)``, truncated: not a way back to q.)

        The run's C (``optimizer.max_grad_norm``) and σ are recorded as the run's; a C other
        than the canary set's is the audit's finding ``clip_differs`` (a warning here)."""
        import warnings

        from opacus.data_loader import DPDataLoader
        from opacus.optimizers.optimizer import DPOptimizer

        if type(optimizer) is not DPOptimizer:
            raise UsageError(
                f"attach_opacus supports Opacus's DPOptimizer (flat clipping); got "
                f"{type(optimizer).__name__} (distributed, per-layer, adaptive or ghost clipping "
                "are not supported: use the plain-loop hook, or audit.libraries.opacus)"
            )
        q, sampling = _opacus_rate(optimizer, sample_rate, data_loader, DPDataLoader)
        self._set_rate(q)
        self.sampling = sampling
        run_clip = float(optimizer.max_grad_norm)
        if not math.isclose(run_clip, self.clip, rel_tol=1e-9):
            warnings.warn(
                f"the optimizer clips at max_grad_norm = {run_clip:g}, the canary set at "
                f"C = {self.clip:g}: recorded as the run's C (the audit's finding clip_differs)",
                UserWarning,
                stacklevel=2,
            )
        self.run_clip = run_clip
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
        """The observation record (:func:`audit.canaries.outside.write_observations`): the
        observed rows, σ, the run's C, q, the steps, the scales ``observe()`` was given,
        and where known the sampling (Opacus) and the expected batch size."""
        if self.sigma is None:
            raise RuntimeError("sigma is unknown: give sigma= to load() (plain loops)")
        obs = np.stack(self.observed) if self.observed else np.zeros((0, self.m))
        out = {
            "kind": "gradient",
            "set_sha256": self.cset.sha256,
            "obs": obs,
            "sigma": float(self.sigma),
            "clip": self.clip if self.run_clip is None else self.run_clip,
            "q": float(self.q),
            "steps": int(obs.shape[0]),
            "source": self.source,
            "scale": np.asarray(self.scales, dtype=np.float64),
        }
        if self.sampling is not None:
            out["sampling"] = self.sampling
        if self.entered_as is not None:
            out["canaries_entered"] = self.entered_as
        if self.expected_batch_size is not None:
            out["expected_batch_size"] = float(self.expected_batch_size)
        return out

    def averaged_hint(self) -> dict | None:
        """The audit's check (:func:`audit.canaries.outside_conformance.averaged_hint`) run
        on what this hook recorded, with its own σ and coins: a finding-like dict when the
        observations look divided by a batch size, else None."""
        from audit.canaries.outside_conformance import averaged_hint

        if self.sigma is None or not self.sigma > 0 or len(self.observed) < 2:
            return None
        clip = self.clip if self.run_clip is None else self.run_clip
        return averaged_hint(
            np.stack(self.observed) / clip,
            np.stack(self.entered),
            float(self.sigma),
            expected_batch=self.expected_batch_size,
            scale=np.asarray(self.scales),
            where="GradientCanaryHook",
        )

    def write_observations(self, path) -> Path:
        """Write :meth:`observations`; warn (``UserWarning``) when they look divided by a
        batch size (:meth:`averaged_hint`): the file is written all the same, and the audit
        fails such a run."""
        import warnings

        hint = self.averaged_hint()
        if hint is not None:
            warnings.warn(hint["message"], UserWarning, stacklevel=2)
        return OB.write_observations(path, self.observations())


def _opacus_rate(optimizer, sample_rate, data_loader, dp_loader_type) -> tuple[float, str | None]:
    """(q, sampling) for :meth:`GradientCanaryHook.attach_opacus` (its doc)."""
    if data_loader is not None:
        try:
            n = len(data_loader)
        except TypeError:
            raise UsageError(
                f"attach_opacus: data_loader {type(data_loader).__name__} has no length"
            ) from None
        if n < 1:
            raise UsageError("attach_opacus: the data loader is empty")
        q = 1.0 / n  # opacus/privacy_engine.py: sample_rate = 1 / len(data_loader)
        sampling = "poisson" if isinstance(data_loader, dp_loader_type) else "shuffle"
        if sample_rate is not None and not math.isclose(float(sample_rate), q, rel_tol=1e-9):
            raise UsageError(
                f"attach_opacus: sample_rate = {float(sample_rate):g} but the data loader's "
                f"rate, the one Opacus accounts, is 1/len(data_loader) = {q:g}: give one of them"
            )
        return q, sampling
    if sample_rate is not None:
        return float(sample_rate), None
    hook = getattr(optimizer, "step_hook", None)
    code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if code is not None and cells and "sample_rate" in code.co_freevars:
        q = cells[code.co_freevars.index("sample_rate")].cell_contents
        if isinstance(q, int | float) and 0 < q <= 1:
            return float(q), None
    raise UsageError(
        "attach_opacus: the sampling rate is unknown: pass data_loader= (the loader "
        "make_private returned; Opacus accounts q = 1/len(data_loader), also for the "
        "shuffled DataLoader of poisson_sampling=False, which has no .sample_rate) or "
        "sample_rate="
    )


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
    return OB.write_observations(path, {"kind": "input", "set_sha256": cs.sha256, name: v})
