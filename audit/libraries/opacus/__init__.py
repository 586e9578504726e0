"""Opacus audited end to end: sampler canaries that take Opacus's own path.

Supported: opacus 1.4.0 … 1.6.x (:data:`audit.libraries.opacus.versions.SUPPORTED`:
1.4.0 May 2023 … 1.6.0 2025; ghost clipping from 1.5, where it exists). Another release is
one clear error naming the installed version and the range, when the audit is attached.

**What travels.** M canary records are appended to the user's dataset
(:class:`CanaryDataset`), so Opacus's own sampler draws them: the Poisson ``DPDataLoader``
of ``make_private(poisson_sampling=True)``, the user's shuffled ``DataLoader`` when
``poisson_sampling=False``, and ``BatchMemoryManager``'s physical batches. A canary record's
gradient lives on coordinates of its own: :class:`CanaryModel` wraps the user's model with
a canary block, a bias-free ``nn.Linear(M, 1)`` over the one-hot of the record's canary id
(all zeros for a real record), whose output adds exactly 0 to the model's output. Canary
j's per-sample gradient on the block is ``gain·e_j`` (gain = 100·C, C the clip in force at
that step) times Opacus's batch factor, a real record's is 0, and a canary's gradient on
the user's parameters is 0 (its rows are detached). Two routes
(:mod:`audit.libraries.opacus.canaries`): through the model's *output* (flat, per-layer
and adaptive clipping: the backward puts in the constant gain), or through the *loss*
(ghost clipping: the block's output enters each record's loss as a term of value 0 and
gradient gain·e_j, :meth:`SamplerCanaries.criterion`, so that Opacus's second, reweighted
backward pass clips it like a record). Opacus clips the canary to exactly C·e_j, adds its
noise to the block like to every parameter, and the block's privatized sum is read right
after ``add_noise`` (:class:`OpacusAudit`), one row per noised optimizer step, with the
coins (the canary ids each training forward read).

**Inclusion bits and the ε lower bound.** Each canary's record enters the dataset with
probability ``p_include`` = 1/2 (bits from the OS's entropy, drawn before training and kept
by the auditor); the excluded canaries' coordinates are observed all the same (noise only).
Canary j's score is the sum of its coordinate over the steps; the one-run bounds
(:mod:`audit.bounds.one_run`, :mod:`audit.bounds.fdp`) turn the guesses into an ε lower
bound, valid because each canary is one record added or not. Above the claimed ε: a finding.

**The real examples' privacy is unchanged.** (1) Sampling: every record keeps its own coin
(Poisson) or its place in the permutation (shuffle); the canaries only add records, and the
q Opacus computes from the grown loader (1/len(loader)) is the q it accounts and the audit
recomputes ε with (choose M so that ceil((N+M)/B) = ceil(N/B) to keep q). (2) Clipping: a
real record's per-sample gradient is 0 on the canary block, so its norm, clip factor and
clipped gradient on the user's parameters are those without canaries (ghost clipping: the
term's value is 0, so a real record's loss and its reweighting are unchanged). (3) Noise:
every user coordinate gets the same N(0, σ²C²); the block only adds coordinates (per-layer
clipping: the block's norm C_c enters Opacus's noise std σ·sqrt(ΣC_l² + C_c²), more noise,
never less). (4) A canary adds a function of its own coin only (C·e_j or 0). (5) The block's
forward output is identically zero, so the model's outputs, losses and gradients for real
records are those of the user's model. What changes is the learning rate by N/(N+M) and,
under adaptive clipping, the clip count (a canary is one more clipped record), not the
privacy.

**What each mode tests** (:data:`MODES`). Every mode that clips each example — flat,
per-layer, adaptive, ghost — carries the canaries all the way: sampling (the permutation
tests of the release and of the coins, the draw count against q), clipping (one-sided: a
canary adds at most C, the conformance clip test; two-sided: a drawn canary adds EXACTLY
C, :func:`audit.bounds.contribution.contribution_test`, which sees a clip of the batch sum
or a record counted twice), noise (scale, freshness, each step in units of its own C, so
adaptive clipping's C_t is tested at its own C), accounting (ε recomputed for what ran),
and the one-run lower bound. Ghost clipping carries them only through
:meth:`SamplerCanaries.criterion`; without it (or with a per-token loss) the noise and the
claim are tested and the verdict is ``incomplete`` (sampling and clipping untested).

**The verdict** (:mod:`audit.libraries.opacus.verdict`): ``pass`` only when sampling,
clipping, noise and accounting were each tested (:class:`audit.coverage.Coverage` in the
result's ``coverage``), ``incomplete`` (exit 4) naming what was not, ``fail`` (exit 1) on
any error finding. A release that is not finite is ``release_nonfinite`` (ε = ∞), no noise
is ``noise_absent`` (ε = ∞), a forward that re-read the step's batch (a closure run after a
forward and backward) is ``forward_run_twice``; none of them an exception.

**The claim check.** The mechanism the run really used — σ (``optimizer.noise_multiplier``;
adaptive clipping: the σ passed to ``make_private``, see below), C (``max_grad_norm``;
per-layer: the norm of the per-layer norms, which Opacus's noise uses; adaptive: the first
step's, every step's in ``run.clip_per_step``), q (the accountant's history,
1/len(loader)), the noised steps, the sampling (Poisson when the loader is a
``DPDataLoader``, shuffled otherwise — Opacus accounts both as Poisson) — is compared with
the claim field by field (a mismatch is a finding, exit 1), and ε is recomputed for it with
:func:`audit.claims.check.check_claim` (PLD, add/remove); Opacus's accountant's ε beside it.

**Adaptive clipping** (``clipping="adaptive"``, ``AdaClipDPOptimizer``): the gradient noise
is σ_eff·C_t with σ_eff = (σ⁻² − (2σ_u)⁻²)^(−1/2) > σ and the clip count is noised at σ_u;
the pair is as private as σ alone (Andrew et al. 2021, Theorem 1), so ε is recomputed at
the σ the user passed. opacus ≤ 1.5 keeps σ_eff in ``noise_multiplier``, which its
accountant reads: ``accountant_sigma_adjusted`` names the σ the accountant used, an error
where its ε understates the ε at the user's σ (an ``info`` otherwise). The run's
``noise_noise_multiplier`` is the σ the noise used, ``accountant_noise_multiplier`` the
accountant's.
"""

from __future__ import annotations

from fl.lazy import lazy_exports

#: public name -> the module that defines it, imported on first use (the package itself
#: imports neither torch nor opacus)
_EXPORTS = {
    "CanaryBlock": "audit.libraries.opacus.canaries",
    "CanaryDataset": "audit.libraries.opacus.canaries",
    "CanaryLoss": "audit.libraries.opacus.canaries",
    "CanaryModel": "audit.libraries.opacus.canaries",
    "SamplerCanaries": "audit.libraries.opacus.canaries",
    "OpacusAudit": "audit.libraries.opacus.recorder",
    "REL_TOL": "audit.libraries.opacus.verdict",
    "SUPPORTED": "audit.libraries.opacus.versions",
    "check_version": "audit.libraries.opacus.versions",
}

__all__ = [
    "MODES",
    "REL_TOL",
    "SUPPORTED",
    "CanaryBlock",
    "CanaryDataset",
    "CanaryLoss",
    "CanaryModel",
    "OpacusAudit",
    "SamplerCanaries",
    "attach",
    "check_version",
]

#: what each Opacus mode lets the canaries test
MODES = {
    "flat": "sampling, clipping (at most and exactly C), noise (scale, freshness), accounting",
    "per_layer": (
        "sampling, clipping (the canary block's own norm, at most and exactly), noise in "
        "units of that norm, accounting"
    ),
    "adaptive": (
        "sampling, clipping at each step's own C_t (at most and exactly), noise σ·C_t per "
        "step, accounting at the σ passed to make_private (and which σ Opacus's accountant used)"
    ),
    "ghost": (
        "sampling, clipping (at most and exactly C), noise, accounting: the canary's gradient "
        "is a term of the loss (SamplerCanaries.criterion), which Opacus's second, reweighted "
        "backward clips like a record; without that criterion, noise and accounting only "
        "(verdict incomplete)"
    ),
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


def attach(canaries, privacy_engine, optimizer, data_loader):
    """Instrument what ``make_private`` (or ``make_private_with_epsilon``) returned."""
    return canaries.attach(privacy_engine, optimizer, data_loader)
