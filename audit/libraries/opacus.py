"""Over 500 lines on purpose: one library's integration, whose canary dataset, canary block, model wrapper, optimizer hook and audit share the records the hook keeps; the statistics it calls live in audit.bounds.

Opacus audited end to end: sampler canaries that take Opacus's own path.

**What travels.** M canary records are appended to the user's dataset
(:class:`CanaryDataset`), so Opacus's own sampler draws them: the Poisson ``DPDataLoader``
of ``make_private(poisson_sampling=True)``, the user's shuffled ``DataLoader`` when
``poisson_sampling=False``, and ``BatchMemoryManager``'s physical batches. A canary
record's gradient lives on a coordinate of its own: :class:`CanaryModel` wraps the
user's model with a canary block, a bias-free ``nn.Linear(M, 1)`` whose input is the
one-hot of the record's canary id (all zeros for a real record) and whose output is forced
to zero in the forward pass while its backward puts in a constant ``gain`` (≫ C). So,
per sample, the canary block's gradient is ``gain·n·e_j`` for canary j (Opacus multiplies
the backprops by the batch size n under ``loss_reduction="mean"``) and exactly 0 for every
real record; the canary's model rows are detached, so a canary's gradient on the user's
parameters is exactly 0. Opacus's clipping (flat: the norm over every parameter;
per-layer: the canary block's own norm) scales the canary to exactly ``C·e_j``, Opacus's
noise is added to the block like to every parameter, and the block's privatized sum is
read right after Opacus's ``add_noise`` (before ``scale_grad`` divides by the expected
batch size), one row per optimizer step that adds noise (a ``BatchMemoryManager`` virtual
step or a skipped step adds none). The batches a canary entered are read in the model's
forward (the sampler's own decisions: the coins).

**Inclusion bits and the ε lower bound.** Each canary's record enters the dataset with
probability ``p_include`` = 1/2 (bits from the OS's entropy, drawn before training and
kept by the auditor); the excluded canaries' coordinates are observed all the same (noise
only). Canary j's score is the sum of its coordinate over the steps; the one-run bounds
(:mod:`audit.bounds.one_run`, :mod:`audit.bounds.fdp`) turn the guesses into an ε lower
bound, valid because each canary is one record added or not (the add/remove relation
the claim is about). A bound above the claimed ε is a finding.

**The real examples' privacy is unchanged.** (1) Sampling: every record keeps its own
coin (Poisson) or its place in the permutation (shuffle); the canaries only add records,
and the q Opacus computes from the grown loader (1/len(loader)) is the q it accounts and
that the audit recomputes ε with (choose M so that ceil((N+M)/B) = ceil(N/B) to keep q).
(2) Clipping: a real record's per-sample gradient is 0 on the canary block, so its norm,
clip factor and clipped gradient on the user's parameters are those without canaries.
(3) Noise: every user coordinate gets the same N(0, σ²C²); the canary block only adds
coordinates (per-layer clipping: the canary block's norm C_c enters Opacus's noise std
σ·sqrt(ΣC_l² + C_c²), more noise, never less). (4) A canary adds to the sum a function of
its own coin only (C·e_j or 0), nothing that depends on the data. (5) The canary block's
forward output is identically zero, so the model's outputs, losses and gradients for
real records are those of the user's model; the canary rows' losses are constants.
What changes is the learning rate by N/(N+M) (Opacus divides by the expected batch size,
which now counts canaries), not the privacy.

**What each mode carries** (:data:`MODES`): flat and per-layer clipping, Poisson and
shuffled batches, ``BatchMemoryManager`` and ``make_private_with_epsilon`` carry the
canaries all the way (sampling test, conformance with the coins: scale, freshness,
clipping). Ghost ("fast gradient") clipping does not: it clips by reweighting the loss
in a second backward pass, and a gradient put in independently of the loss is not
reweighted, so the canary block is run with ``gain = 0`` — it receives Opacus's noise only
— and the audit tests the noise (scale, freshness) and the claim, not the sampling nor the
clipping (named in the result's ``untested``).

**The claim check.** The mechanism the run really used — σ (``optimizer.noise_multiplier``),
C (``optimizer.max_grad_norm``; per-layer: the norm of the per-layer norms, which Opacus's
noise uses), q (the accountant's history, 1/len(loader)), the steps that added noise, and
the sampling (Poisson when the loader is a ``DPDataLoader``, shuffled otherwise — Opacus
accounts both as Poisson) — is compared with the claim field by field (a mismatch is a
finding, exit 1), and ε is recomputed for it with :func:`audit.claims.check.check_claim`
(PLD, add/remove); Opacus's own accountant's ε is reported beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from audit.bounds.conformance import Block, GroupTest, conformance, implied_noise_factor
from audit.claims.check import check_claim
from audit.claims.implied import SIGMA_FLOOR, epsilon_of_scaled_claim
from audit.claims.mistakes import reference
from audit.claims.schema import Claim, validate_claim
from audit.libraries.common import one_run_lower_bound, sampling_group_tests
from audit.libraries.results import conformance_warnings

__all__ = [
    "MODES",
    "CanaryDataset",
    "CanaryModel",
    "OpacusAudit",
    "SamplerCanaries",
    "attach",
]

#: what each Opacus mode lets the canaries test
MODES = {
    "flat": "sampling, clipping, noise (scale, freshness)",
    "per_layer": "sampling, clipping (the canary block's own norm), noise in units of that norm",
    "ghost": (
        "noise only (scale, freshness): ghost clipping reweights the loss in a second backward "
        "pass, which a gradient put in apart from the loss does not follow, so the canaries "
        "carry no contribution (gain 0) and neither the sampling nor the clipping is tested"
    ),
}

#: relative tolerance for "the claim's field equals the run's"
REL_TOL = 1e-6


class CanaryDataset(torch.utils.data.Dataset):
    """The user's dataset and the included canary records after it: item i < N is
    ``(*base[i], -1)``, item N + k is ``(*base[template], ids[k])`` (a real record's
    features, which the model reads but whose gradient the canary rows do not carry). The
    last field is the canary id; ``ids`` defaults to every canary 0 … m − 1."""

    def __init__(self, base, m: int, template: int = 0, ids=None) -> None:
        if m < 1:
            raise ValueError(f"need at least one canary, got m = {m}")
        self.base, self.m, self.n = base, int(m), len(base)
        self.template = template
        self.ids = list(range(self.m)) if ids is None else [int(j) for j in ids]

    def __len__(self) -> int:
        return self.n + len(self.ids)

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        real = i < self.n
        item = self.base[i if real else self.template]
        item = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        return (*item, torch.tensor(-1 if real else self.ids[i - self.n], dtype=torch.long))


class _Inject(torch.autograd.Function):
    """Zero in the forward pass; a constant gradient ``gain`` in the backward pass."""

    @staticmethod
    def forward(ctx, z, gain):
        ctx.gain = gain
        return torch.zeros_like(z)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, ctx.gain), None


class CanaryBlock(nn.Module):
    """The canaries' coordinates: ``weight`` (1, M); canary j's per-sample gradient is
    ``gain·e_j`` times Opacus's batch factor, a real record's (id −1) is 0."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.m = m
        self.linear = nn.Linear(m, 1, bias=False)
        nn.init.zeros_(self.linear.weight)
        self.gain = 0.0

    def forward(self, cid: torch.Tensor) -> torch.Tensor:
        hot = nn.functional.one_hot(cid.clamp(min=0), self.m).to(self.linear.weight.dtype)
        hot = hot * (cid >= 0).unsqueeze(-1).to(hot.dtype)
        return _Inject.apply(self.linear(hot), self.gain)


class CanaryModel(nn.Module):
    """The user's model with the canary block: ``forward(x, cid, **kwargs)`` calls
    ``model(x, **kwargs)`` (a Hugging Face / PEFT model's output: its ``.logits``). Rows with ``cid >= 0``
    are canaries: their outputs are detached (no gradient reaches the user's parameters)
    and the block adds exactly 0 to every output. Records the canary ids of every training
    forward (the sampler's decisions)."""

    def __init__(self, model: nn.Module, m: int) -> None:
        super().__init__()
        self.model = model
        self.canary = CanaryBlock(m)
        self._seen: list[torch.Tensor] = []

    def forward(self, x, cid: torch.Tensor, **kwargs):
        out = self.model(x, **kwargs)
        if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
            out = out.logits  # a Hugging Face / PEFT model's output
        is_c = (cid >= 0).view(-1, *([1] * (out.dim() - 1)))
        out = torch.where(is_c, out.detach(), out)
        if self.training and torch.is_grad_enabled():
            self._seen.append(cid[cid >= 0].detach().cpu())
        return out + self.canary(cid).view(-1, *([1] * (out.dim() - 1)))


@dataclass
class SamplerCanaries:
    """M sampler canaries for one Opacus training. Use :meth:`dataset` and :meth:`model`
    before ``make_private``, :meth:`max_grad_norms` for per-layer clipping, then
    :func:`attach` (or :meth:`attach`) on what ``make_private`` returned."""

    m: int = 64
    gain_factor: float = 100.0
    #: each canary's record enters the dataset with this probability (its inclusion bit,
    #: drawn from the OS's entropy unless ``seed`` is given; the excluded canaries'
    #: coordinates are observed too: the one-run ε lower bound compares the two); 1: all in
    p_include: float = 0.5
    seed: int | None = None
    _model: CanaryModel | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.p_include <= 1:
            raise ValueError(f"p_include must be in (0, 1], got {self.p_include}")
        rng = np.random.default_rng(self.seed)
        self.included = (
            np.ones(self.m, dtype=bool)
            if self.p_include == 1
            else rng.random(self.m) < self.p_include
        )

    def dataset(self, base, template: int = 0) -> CanaryDataset:
        return CanaryDataset(base, self.m, template, ids=np.flatnonzero(self.included))

    def model(self, model: nn.Module) -> CanaryModel:
        self._model = CanaryModel(model, self.m)
        return self._model

    def max_grad_norms(self, norms: list[float], canary_norm: float | None = None) -> list:
        """Per-layer clipping: the user's norms (one per user parameter, in
        ``model.parameters()`` order) and the canary block's (default: the largest)."""
        return [*map(float, norms), float(canary_norm if canary_norm else max(norms))]

    def attach(self, privacy_engine, optimizer, data_loader) -> OpacusAudit:
        if self._model is None:
            raise ValueError("call SamplerCanaries.model(model) before make_private")
        return OpacusAudit(self, privacy_engine, optimizer, data_loader)


def attach(canaries: SamplerCanaries, privacy_engine, optimizer, data_loader) -> OpacusAudit:
    """Instrument what ``make_private`` (or ``make_private_with_epsilon``) returned."""
    return canaries.attach(privacy_engine, optimizer, data_loader)


class OpacusAudit:
    """Records the canary block's privatized sums after every ``add_noise`` and audits them
    (:meth:`audit`)."""

    def __init__(self, canaries: SamplerCanaries, privacy_engine, optimizer, data_loader):
        from opacus.data_loader import DPDataLoader
        from opacus.optimizers.optimizer import DPOptimizer
        from opacus.optimizers.optimizer_fast_gradient_clipping import (
            DPOptimizerFastGradientClipping,
        )
        from opacus.optimizers.perlayeroptimizer import DPPerLayerOptimizer

        if not isinstance(optimizer, (DPOptimizer, DPOptimizerFastGradientClipping)):
            raise ValueError(
                f"attach the optimizer make_private returned (a DPOptimizer), got "
                f"{type(optimizer).__name__}"
            )

        self.canaries, self.engine, self.optimizer = canaries, privacy_engine, optimizer
        self.model = canaries._model
        block = self.model.canary.linear.weight
        idx = [i for i, p in enumerate(optimizer.params) if p is block]
        if not idx:
            raise ValueError(
                "the canary block is not among the optimizer's parameters: build the "
                "optimizer on SamplerCanaries.model(...)'s parameters before make_private"
            )
        self._block = block
        if isinstance(optimizer, DPOptimizerFastGradientClipping):
            self.mode = "ghost"
            self.clip_c = float(optimizer.max_grad_norm)
        elif isinstance(optimizer, DPPerLayerOptimizer):
            self.mode = "per_layer"
            self.clip_c = float(optimizer.max_grad_norms[idx[0]])
        else:
            self.mode = "flat"
            self.clip_c = float(optimizer.max_grad_norm)
        self.poisson = isinstance(data_loader, DPDataLoader)
        self.dataset_size = len(data_loader.dataset)
        self.loader_len = len(data_loader)
        self.model.canary.gain = 0.0 if self.mode == "ghost" else canaries.gain_factor * self.clip_c
        self.obs: list[np.ndarray] = []
        self.sums: list[np.ndarray] = []
        self.coins: list[np.ndarray] = []
        self.sigmas: list[float] = []
        self.noise_c: list[float] = []
        self.model._seen.clear()
        orig = optimizer.add_noise

        def add_noise():
            summed = block.summed_grad.detach().reshape(-1).double().cpu().numpy().copy()
            orig()
            self.obs.append(block.grad.detach().reshape(-1).double().cpu().numpy().copy())
            self.sums.append(summed)
            row = np.zeros(self.canaries.m, dtype=bool)
            for c in self.model._seen:
                row[c.numpy()] = True
            self.model._seen.clear()
            self.coins.append(row)
            self.sigmas.append(float(optimizer.noise_multiplier))
            self.noise_c.append(float(optimizer.max_grad_norm))

        optimizer.add_noise = add_noise

    # --- what the run used

    def run_mechanism(self) -> dict:
        """σ, C, q, steps and sampling as the run used them (module doc)."""
        hist = list(getattr(self.engine.accountant, "history", []))
        rates = sorted({float(h[1]) for h in hist}) or [1.0 / self.loader_len]
        sigmas = sorted(set(self.sigmas)) or [float(self.optimizer.noise_multiplier)]
        return {
            "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
            "clipping_norm": float(self.optimizer.max_grad_norm),
            "sample_rate": rates[0] if len(rates) == 1 else rates,
            "steps": len(self.obs),
            "sampling": "poisson" if self.poisson else "shuffle",
            "dataset_size": self.dataset_size,
            "mode": self.mode,
            "canaries": self.canaries.m,
            "canary_clip": self.clip_c,
        }

    def observations(self) -> dict:
        """(T, M) arrays: the block's privatized sums (``obs``), its clipped sums before the
        noise (``sums``), and the coins (``coins``, from the forwards)."""
        return {
            "obs": np.array(self.obs).reshape(-1, self.canaries.m),
            "sums": np.array(self.sums).reshape(-1, self.canaries.m),
            "coins": np.array(self.coins).reshape(-1, self.canaries.m),
        }

    # --- the audit

    def _lower_bound(self, u: np.ndarray, c: Claim, alpha: float) -> dict | None:
        """The one-run ε lower bound (:func:`audit.libraries.common.one_run_lower_bound`):
        canary j's score is the sum of its block coordinate over the steps (an included
        canary adds C each time the sampler draws it, an excluded one never)."""
        can = self.canaries
        return one_run_lower_bound(u.sum(axis=0), can.included, can.p_include, c.delta, alpha)

    def audit(
        self,
        claim: dict | Claim,
        *,
        alpha: float = 0.05,
        permutations: int = 19_999,
        seed: int | None = None,
    ) -> dict:
        """The claim check, the conformance tests, the sampling tests and the implied ε of
        this run against ``claim`` (sample-level claim fields, :mod:`audit.claims.schema`).
        ``verdict`` is ``"pass"`` or ``"fail"`` (``exit_code`` 0 or 1)."""
        t0 = time.time()
        c = validate_claim(claim)
        run = self.run_mechanism()
        findings: list[dict] = []
        untested: list[str] = []
        if isinstance(run["noise_multiplier"], list) or isinstance(run["sample_rate"], list):
            findings.append(
                {
                    "code": "run_not_constant",
                    "message": f"σ or q changed during the run: σ {run['noise_multiplier']}, "
                    f"q {run['sample_rate']}",
                }
            )
            sigma = float(np.min(run["noise_multiplier"]))  # the least noise: the largest ε
            q = float(np.max(run["sample_rate"]))
        else:
            sigma, q = float(run["noise_multiplier"]), float(run["sample_rate"])
        T = run["steps"]
        if T < 2:
            raise ValueError(f"the run took {T} noised step(s); the audit needs at least 2")
        # field by field: the claim against the run
        checks = [
            ("noise_multiplier", c.noise_multiplier, sigma),
            ("sample_rate", c.record_rate, q),
            ("steps", c.steps_per_round * c.rounds, T),
        ]
        if c.clipping_norm is not None:
            checks.append(("clipping_norm", c.clipping_norm, run["clipping_norm"]))
        for name, claimed, ran in checks:
            if abs(claimed - ran) > REL_TOL * max(abs(ran), 1e-300):
                findings.append(
                    {
                        "code": f"{name}_mismatch",
                        "message": f"the claim's {name} = {claimed:.6g} but the run used {ran:.6g}",
                    }
                )
        if c.sampling != run["sampling"]:
            findings.append(
                {
                    "code": "sampling_mismatch",
                    "message": f"the claim's sampling is {c.sampling!r} but the run drew "
                    f"{run['sampling']!r} batches (the loader it trained on "
                    + ("is" if self.poisson else "is not")
                    + " Opacus's Poisson DPDataLoader); Opacus's accountant accounts both as "
                    "Poisson at q = 1/len(loader)",
                }
            )
        # below SIGMA_FLOOR a subsampled Gaussian's PLD grid grows past memory: recompute at
        # the floor, a LOWER bound on the run's ε (ε falls as σ grows), marked "at least"
        floored = 0 < sigma < SIGMA_FLOOR and q < 1
        run_claim = Claim(
            level="sample",
            noise_multiplier=max(sigma, SIGMA_FLOOR) if floored else sigma,
            sampling=run["sampling"],
            rounds=1,
            steps_per_round=T,
            sample_rate=q,
            clipping_norm=run["clipping_norm"],
            claimed_epsilon=c.claimed_epsilon,
            delta=c.delta,
            accounting="composed",
        )
        recomputed = check_claim(run_claim)
        if recomputed["understated"]:
            findings.append(
                {
                    "code": "epsilon_understated",
                    "message": f"the claimed ε = {c.claimed_epsilon:.4g} is below the ε = "
                    f"{recomputed['epsilon_pld']:.4g} of the mechanism the run used "
                    f"({recomputed['mechanism']})",
                }
            )
        if floored:
            eps_acc = None
            untested.append(
                f"Opacus's accountant not asked: σ = {sigma:.3g} < {SIGMA_FLOOR} (its PRV/RDP "
                "grids grow past memory); the recomputed ε is at σ = "
                f"{SIGMA_FLOOR}, a lower bound"
            )
        else:
            try:
                eps_acc = float(self.engine.get_epsilon(c.delta))
            except Exception as exc:  # the accountant's own limits (e.g. no steps)
                eps_acc = None
                untested.append(f"Opacus's accountant gave no ε ({exc})")
        # the canary block in units of the canary's clip (noise std σ·C_noise)
        ob = self.observations()
        u = ob["obs"] / self.clip_c
        # the noise is tested against the CLAIMED σ (what the data show, not what the
        # optimizer's attribute says), in units of the canary's clip
        sig_u = c.noise_multiplier * max(self.noise_c) / self.clip_c
        if sig_u <= 0:
            raise ValueError("the claim's noise_multiplier is 0: nothing to test the noise against")
        m = self.canaries.m
        carried = self.mode != "ghost"
        extra: list[GroupTest] = []
        samp = None
        if carried:
            inc = self.canaries.included
            samp, tests, draws = sampling_group_tests(
                u,
                ob["coins"],
                inc,
                sig_u,
                q,
                permutations=permutations,
                seed=seed,
                note="Poisson coins are exchangeable over steps",
            )
            extra += tests
            n_draw, k_draw = draws["possible"], draws["drawn"]
            if k_draw == 0 and n_draw * q > 5:
                findings.append(
                    {
                        "code": "canaries_never_drawn",
                        "message": f"no included canary entered a training forward in {T} "
                        f"steps (expected {n_draw * q:.0f} draws): train on the loader "
                        "make_private returned, built over SamplerCanaries.dataset(...), "
                        "and call model(x, cid) in train mode",
                    }
                )
            coins = ob["coins"]
        else:
            coins = None
            untested += [
                "sampling (ghost clipping: the canaries carry no contribution)",
                "clipping (ghost clipping reweights the loss, not a gradient put in by the block)",
            ]
        block = Block(
            u=u,
            tracks=np.arange(m),
            groups=np.array(["canary"] * m),
            sigma=sig_u,
            included=self.canaries.included.copy(),
            coins=coins,
            q=q,
            p_include=self.canaries.p_include,
        )
        # the verdict's family-wise level is the conformance module's (0.001; a test
        # rejected only at 0.05 is a warning); ``alpha`` is the lower bound's confidence
        conf = conformance([block], extra=tuple(extra))
        f, group = implied_noise_factor(conf)
        eps_implied, at_least = epsilon_of_scaled_claim(
            reference(run_claim), c.noise_multiplier, f, c.delta
        )
        rejected = [f"{t.group}:{t.test}" for t in conf.rejected]
        for t in conf.rejected:
            findings.append(
                {
                    "code": "conformance_rejected",
                    "message": f"{t.group}:{t.test} rejected at family-wise α = {conf.alpha:g} "
                    f"(Holm; {t.evidence()})",
                }
            )
        lb = self._lower_bound(u, c, alpha) if carried else None
        if lb is None:
            untested.append("ε lower bound (needs included and excluded canaries that carry)")
        elif lb["epsilon_lb"] > c.claimed_epsilon:
            findings.append(
                {
                    "code": "empirical_exceeds_claim",
                    "message": f"the one-run ε lower bound {lb['epsilon_lb']:.4g} exceeds the "
                    f"claimed ε = {c.claimed_epsilon:g}",
                }
            )
        # a white-box diagnostic beside the tests (not in the verdict): the block's clipped
        # sum before the noise against C_c times the coins read from the forwards
        clip_error = (
            float(np.max(np.abs(ob["sums"] / self.clip_c - ob["coins"]))) if carried else None
        )
        verdict = "fail" if findings else "pass"
        findings += conformance_warnings(conf)  # reported, not counted in the verdict
        return {
            "library": "opacus",
            "mode": self.mode,
            "run": run,
            "claim": c.to_dict(),
            "claimed_epsilon": c.claimed_epsilon,
            "delta": c.delta,
            "recomputed_epsilon": recomputed["epsilon_pld"],
            "recomputed_epsilon_at_least": floored,
            "recomputed": recomputed,
            "accountant_epsilon": eps_acc,
            "epsilon_lower_bound": lb["epsilon_lb"] if lb else None,
            "lower_bound": lb,
            "implied_epsilon": eps_implied,
            "implied_epsilon_at_least": at_least,
            "noise_factor": f,
            "noise_factor_group": group,
            "conformance": conf.to_dict(),
            "conformance_rejected": rejected,
            "sampling": samp.to_dict() if samp else None,
            "canary_clip_error": clip_error,
            "untested": untested,
            "findings": findings,
            "verdict": verdict,
            "exit_code": 0 if verdict == "pass" else 1,
            "audit_seconds": time.time() - t0,
        }
