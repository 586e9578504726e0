"""Over 500 lines on purpose: one library's integration, whose records, model wrapper, Trainer subclass and callback share the canaries' state; a third of it is the documentation of the Trainer and Opacus behaviours the audit relies on.

Opacus inside the Hugging Face ``Trainer``, audited end to end: :class:`OpacusAuditCallback`.

The recipe for DP fine-tuning of a PEFT adapter with the ``Trainer``: Opacus's
``PrivacyEngine.make_private`` turns the model, the optimizer and the train ``DataLoader``
into a ``GradSampleModule``, a ``DPOptimizer`` and a Poisson ``DPDataLoader``; the
``Trainer`` is handed the DP optimizer (``optimizers=(dp_optimizer, None)``) and the Poisson
loader (:class:`OpacusTrainer`: ``get_train_dataloader`` returns it, and :class:`DPZeroGrad`
clears the DP optimizer after each step). The callback puts the sampler canaries of
:mod:`audit.libraries.opacus` on that path and audits the run at the end of training (or
on demand, :meth:`OpacusAuditCallback.run_audit`); docs/audit_hf_trainer.md.

* **the records.** :class:`CanaryRecords` appends the included canary records to the
  user's dataset of dict records (``input_ids``, ``attention_mask``, ``labels``); each
  record carries a ``canary_id`` column (-1 for a real record), which the collator stacks
  and the ``Trainer`` passes to the model's forward as a keyword. Opacus's sampler (the
  ``DPDataLoader``) draws them, the ``Trainer``'s loop (its micro-batches, its
  ``optimizer.step``) carries them, Opacus clips and noises them.
* **the model.** :class:`CanaryClassifier` is what ``make_private`` wraps: the user's
  sequence classifier inside :class:`audit.libraries.opacus.CanaryModel` (the canary
  block: forward output 0, a constant per-sample gradient), returning a
  ``SequenceClassifierOutput`` with the batch's mean cross-entropy (Opacus's
  ``loss_reduction="mean"``), which the ``Trainer``'s ``compute_loss`` reads. An empty
  Poisson batch (Opacus still takes a noised step) skips the user's model (a BERT forward
  cannot reshape a batch of 0) and gives Opacus the empty per-sample gradients.
* **the observation.** :class:`audit.libraries.opacus.OpacusAudit` reads the canary
  block's privatized sum right after Opacus's ``add_noise`` (one row per noised optimizer
  step) and the coins from the forwards; the callback reads in addition how many
  micro-batches each noised step summed and the most times one canary entered a step.

**Three things the ``Trainer`` does that the recipe must undo** (transformers 5.24,
opacus 1.6): (1) it calls ``model.zero_grad()`` after ``optimizer.step()``, never
``optimizer.zero_grad()``, so the DPOptimizer's ``summed_grad`` stays and Opacus refuses
the next step (:class:`DPZeroGrad`); (2) it keeps only the columns its model's ``forward``
names (``remove_unused_columns``), and the model it holds is Opacus's ``GradSampleModule``,
whose ``forward(*args, **kwargs)`` names none: every column, the canary id included, is
dropped from a loader the ``Trainer`` builds (``remove_unused_columns=False``; a loader the
``Trainer`` builds with it ``True`` is refused at ``on_train_begin``); (3) it finds no
label name in that signature either, so evaluation computes no loss unless
``label_names=["labels"]``.

**What the ``Trainer`` adds to the mechanism** (each a finding, exit 1):

* *its own loader* (``trainer_loader_not_poisson``): without the ``get_train_dataloader``
  override the ``Trainer`` builds a shuffled ``DataLoader`` over the train dataset and
  never iterates Opacus's Poisson loader, while Opacus's accountant accounts Poisson at
  q = 1/len(Poisson loader); the run's sampling is ``shuffle`` (the claim check names
  ``sampling_mismatch``, the permutation tests see it in the data);
* *gradient accumulation* (``gradient_accumulation``): with
  ``gradient_accumulation_steps = k > 1`` one ``optimizer.step()`` follows k
  forward/backward passes. Opacus forbids it with Poisson sampling (``make_private`` calls
  ``forbid_grad_accumulation``; the ``GradSampleModule`` raises at the second backward) and
  the callback refuses it at ``on_train_begin`` with the reason. If the user lifts Opacus's
  ban (``model.allow_grad_accumulation()``), Opacus sums the k micro-batches' clipped
  per-sample gradients, adds the noise once and accounts one Poisson draw at rate k·q
  (``sample_rate * optim.accumulated_iterations``). The k micro-batches are k independent
  Poisson draws: a record enters a step Binomial(k, q) times and adds up to k·C, which a
  Poisson(k·q) draw of sensitivity C does not cover. The finding gives the ε of what ran
  (:func:`accumulation_epsilon`: a mixture of Gaussians over the Binomial(k, q) counts per
  step, composed, dp-accounting PLD, add/remove); ``canary_drawn_twice_in_a_step`` is the
  same seen in the sampler's coins;
* *the logged gradient norm* (``nonprivate_grad_norm_logged``): the ``Trainer`` computes
  ``grad_norm`` from ``p.grad`` before ``optimizer.step()`` — the accumulated NON-private
  gradient, which Opacus replaces with the noised one only inside the step — and logs it
  at every logging step. The canary block's non-private gradient is ``gain`` per canary
  drawn, so the logged values tell the steps where a canary was drawn: a one-sided
  Mann–Whitney test of the logged ``grad_norm`` against the coins; a finding at the
  verdict's level (p ≤ ``audit.bounds.conformance.ALPHA``), a warning at p ≤ ``ALPHA_WARN``;
* *the noise seeded by the ``Trainer``* (``noise_seeded_by_trainer``): the ``Trainer``
  seeds torch's global generator with ``args.seed`` (default 42) in its ``__init__``, and
  Opacus without ``secure_mode`` draws its noise and its Poisson coins from that generator;
  when it is still in exactly that state at ``on_train_begin``, the whole noise sequence
  is a function of a public seed (measured: two runs on different data with the same seed
  add the identical noise to the canary block). The recipe reseeds from the OS's entropy
  after building the ``Trainer``. Random draws between the ``Trainer``'s construction and
  ``train()`` move the state and hide it from this check (the noise stays seeded);
* *an optimizer that is not Opacus's*, *several devices or processes*: refused at
  ``on_train_begin`` (a ``ValueError``): no noise would be added, or Opacus's per-sample
  gradients are not this path.

**What it does not cover** (``untested``, ``outside_releases``): the training loss the
``Trainer`` logs (and ``train_loss`` at the end) is a statistic of the private batches
outside Opacus's mechanism; a canary row's loss is a constant of its template record, so
the canaries do not mark it, and the audit names it without testing it. Mixed precision
and ``torch.compile`` are not exercised.

The audit dict is :meth:`audit.libraries.opacus.OpacusAudit.audit`'s (same keys; the claim
by default is the one the ``PrivacyEngine`` makes: σ and C as ``make_private`` set them, q
= the Poisson loader's sample rate, the ``Trainer``'s optimizer steps, Poisson sampling,
its accountant's ε at δ), plus ``trainer`` (what the ``Trainer`` ran) and
``outside_releases``; it is written to ``<output_dir>/library_audit.json``.

**The verdict** (#47): ``pass`` only when sampling, clipping, noise and accounting were
each tested (the result's ``coverage``, :func:`audit.coverage.decide`); a part no canary
reached (e.g. no canary included, none drawn) makes it ``incomplete`` (exit 4, logged as
"incomplete: clipping untested"), any error finding ``fail`` (exit 1); warnings and infos
are reported, not counted. The ``Trainer``'s logs are named in ``untested`` (outside the
mechanism), not a part of it. Supported: opacus 1.4.0 … 1.6.x
(:mod:`audit.libraries.opacus.versions`); the recipe is tried with transformers 5.24.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.modeling_outputs import SequenceClassifierOutput

from audit.bounds.conformance import ALPHA, ALPHA_WARN
from audit.claims.implied import SIGMA_FLOOR
from audit.coverage import Coverage, decide
from audit.libraries.opacus import OpacusAudit, SamplerCanaries
from audit.libraries.results import save_result

__all__ = [
    "COLUMN",
    "FILENAME",
    "CanaryClassifier",
    "CanaryRecords",
    "DPZeroGrad",
    "OpacusAuditCallback",
    "OpacusTrainer",
    "accumulation_epsilon",
]

#: the column (and forward keyword) that carries the canary id
COLUMN = "canary_id"
#: the audit's file in the Trainer's output_dir
FILENAME = "library_audit.json"

logger = logging.getLogger(__name__)


class CanaryRecords(torch.utils.data.Dataset):
    """The user's dataset of dict records and the included canary records after it, each
    with a ``canary_id`` column (-1 for a real record): the order and ids of
    :meth:`SamplerCanaries.dataset` (a canary record copies record ``template``'s inputs)."""

    def __init__(self, base, canaries: SamplerCanaries, template: int = 0) -> None:
        if len(base) == 0:
            raise ValueError("the train dataset is empty")
        first = base[0]
        if not isinstance(first, dict):
            raise ValueError(
                "CanaryRecords needs dict records (input_ids, attention_mask, labels, as the "
                f"Trainer's collators take them), got {type(first).__name__}"
            )
        if COLUMN in first:
            raise ValueError(f"the dataset already has a {COLUMN!r} column")
        self._inner = canaries.dataset(base, template)

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, i: int) -> dict:
        item, cid = self._inner[i]
        return {**item, COLUMN: cid}


class CanaryClassifier(nn.Module):
    """What ``make_private`` wraps: the user's sequence classifier (a Hugging Face / PEFT
    model) with the canary block (:class:`audit.libraries.opacus.CanaryModel`, made by
    ``canaries.model``). ``forward(input_ids, attention_mask, token_type_ids, labels,
    canary_id)`` returns a ``SequenceClassifierOutput`` whose loss is the batch's mean
    cross-entropy (Opacus's ``loss_reduction="mean"``; the Trainer's
    ``num_items_in_batch`` is ignored: Opacus needs each record's own gradient)."""

    def __init__(self, model: nn.Module, canaries: SamplerCanaries) -> None:
        super().__init__()
        self.canaried = canaries.model(model)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        canary_id=None,
        **kwargs,
    ):
        kwargs.pop("num_items_in_batch", None)
        if input_ids is None:
            raise ValueError(
                "no input_ids reached the model: with remove_unused_columns=True the Trainer "
                "keeps only the columns named in its model's forward signature, and Opacus's "
                "GradSampleModule names none (forward(*args, **kwargs)); set "
                "remove_unused_columns=False"
            )
        if canary_id is None:
            if self.training and torch.is_grad_enabled():
                raise ValueError(
                    f"a training batch without the {COLUMN!r} column: train on the loader "
                    "make_private returned over CanaryRecords (OpacusTrainer), and set "
                    "remove_unused_columns=False (the Trainer drops columns its model's "
                    "forward signature does not name, and Opacus's GradSampleModule names none)"
                )
            canary_id = torch.full((input_ids.shape[0],), -1, dtype=torch.long)
        canary_id = canary_id.to(input_ids.device).view(-1)
        if input_ids.shape[0] == 0 and self.training and torch.is_grad_enabled():
            return self._empty_batch(input_ids.device)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        logits = self.canaried(input_ids, canary_id, **kwargs)
        if labels is None:
            loss = None
        elif labels.numel() == 0:  # an empty Poisson batch: Opacus still takes a noised step
            loss = logits.sum() * 0.0
        else:
            loss = nn.functional.cross_entropy(logits, labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def _empty_batch(self, device) -> SequenceClassifierOutput:
        """An empty Poisson batch (Opacus still takes a noised step): the user's model is
        not run (a BERT forward cannot reshape a batch of 0), every trainable parameter gets
        the empty per-sample gradient Opacus's hooks would have written, and the loss is a
        zero tied to the canary block (so the Trainer's backward runs)."""
        cfg = getattr(self.canaried.model, "config", None)
        n = getattr(cfg, "num_labels", None)
        if n is None:
            raise ValueError("an empty batch and no model.config.num_labels to shape its logits")
        for p in self.parameters():
            if p.requires_grad:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        w = self.canaried.canary.linear.weight
        logits = torch.zeros((0, int(n)), device=device, dtype=w.dtype) + w.sum() * 0.0
        return SequenceClassifierOutput(loss=w.sum() * 0.0, logits=logits)


class DPZeroGrad(TrainerCallback):
    """Clears the DP optimizer after each optimizer step. The Trainer calls only
    ``model.zero_grad()`` after ``optimizer.step()``, which clears Opacus's ``grad_sample``
    but not the DPOptimizer's ``summed_grad``; Opacus then refuses the next step ("Gradients
    haven't been cleared since the last optimizer step")."""

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        return control


class OpacusTrainer(Trainer):
    """A ``Trainer`` that trains on Opacus's ``DPDataLoader`` (``train_dataloader``: what
    ``make_private`` returned) instead of building a shuffled loader of its own, and clears
    the DP optimizer after each step (:class:`DPZeroGrad`)."""

    def __init__(self, *args, train_dataloader=None, **kwargs) -> None:
        if train_dataloader is None:
            raise ValueError(
                "OpacusTrainer needs train_dataloader= (the loader make_private returned)"
            )
        super().__init__(*args, **kwargs)
        self._dp_loader = train_dataloader
        self.add_callback(DPZeroGrad())

    def get_train_dataloader(self):
        return self._dp_loader


def _unwrap_optimizer(opt):
    """The chain of ``.optimizer`` wrappers (accelerate's AcceleratedOptimizer, …)."""
    seen = []
    while opt is not None and all(opt is not s for s in seen):
        seen.append(opt)
        opt = getattr(opt, "optimizer", None)
    return seen


def accumulation_epsilon(
    sigma: float, q: float, micro_batches, delta: float, discretization: float = 1e-2
) -> float:
    """ε (add/remove, dp-accounting PLD, pessimistic) of noised steps that each sum
    ``micro_batches[t]`` independent Poisson(q) batches: a record enters step t
    Binomial(k_t, q) times and adds that many C's, so the step is a mixture of Gaussians of
    std σ at sensitivities 0 … k_t (units of C) with Binomial(k_t, q) weights; the steps
    compose. One micro-batch per step is the Poisson subsampled Gaussian. Pessimistic
    discretization: a coarser ``discretization`` only raises ε (at 24 steps of 4
    micro-batches, σ = 1, q = 0.032: 6.1994 at 1e-2 against 6.1989 at 1e-3, 8× faster)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from scipy import stats

    ks = [int(k) for k in micro_batches]
    if not (sigma > 0 and 0 < q <= 1 and ks and min(ks) >= 1 and 0 < delta < 1):
        raise ValueError(
            f"need σ > 0, 0 < q ≤ 1, at least one step of ≥ 1 micro-batch, 0 < δ < 1; got "
            f"σ = {sigma}, q = {q}, micro-batches {sorted(set(ks))}, δ = {delta}"
        )
    total = None
    for k in sorted(set(ks)):
        sens = list(range(k + 1))
        probs = [float(p) for p in stats.binom.pmf(sens, k, q)]
        one = pld_lib.from_mixture_gaussian_mechanism(
            sigma,
            [float(x) for x in sens],
            probs,
            value_discretization_interval=discretization,
        ).self_compose(ks.count(k))
        total = one if total is None else total.compose(one)
    return float(total.get_epsilon_for_delta(delta))


class OpacusAuditCallback(TrainerCallback):
    """Audits an Opacus training run by the Hugging Face ``Trainer`` (module doc).

    Build it after ``make_private`` on what it returned (the ``PrivacyEngine``, the
    ``DPOptimizer``, the ``DPDataLoader``) and pass it in ``callbacks=[...]``. At the end of
    training it audits the run against ``claim`` (sample-level claim fields; default: the
    claim the ``PrivacyEngine`` makes — its σ, C, q = the loader's sample rate, the
    Trainer's optimizer steps, Poisson sampling and its accountant's ε at ``delta``), writes
    the audit dict to ``<output_dir>/library_audit.json`` and logs the verdict; ``result``
    holds the dict. ``alpha``: the one-run ε lower bound's confidence (the conformance
    family's levels are :mod:`audit.bounds.conformance`'s); ``permutations``: the sampling
    tests' cap (default: :meth:`OpacusAudit.audit`'s); ``seed``: theirs."""

    def __init__(
        self,
        canaries: SamplerCanaries,
        privacy_engine,
        optimizer,
        data_loader,
        *,
        claim: dict | None = None,
        delta: float = 1e-5,
        alpha: float = 0.05,
        permutations: int | None = None,
        seed: int | None = None,
        audit_on_train_end: bool = True,
    ) -> None:
        self.audit_state: OpacusAudit = canaries.attach(privacy_engine, optimizer, data_loader)
        self.canaries, self.engine, self.optimizer = canaries, privacy_engine, optimizer
        self.data_loader = data_loader
        self.claim, self.delta = claim, float(delta)
        self.alpha, self.permutations, self.seed = alpha, permutations, seed
        self.audit_on_train_end = audit_on_train_end
        self.sigma0 = float(optimizer.noise_multiplier)
        self.clip0 = float(optimizer.max_grad_norm)
        self.q0 = float(getattr(data_loader, "sample_rate", 1.0 / len(data_loader)))
        self.result: dict | None = None
        self.trainer: dict = {}
        self.micro_batches: list[int] = []
        self.multiplicity: list[int] = []
        self._begun = False
        self._state = None
        model = self.audit_state.model
        inner = optimizer.add_noise  # OpacusAudit's wrapper of Opacus's add_noise

        def add_noise():
            # before OpacusAudit reads (and clears) the forwards' canary ids: how many
            # micro-batches this noised step sums and the most times one canary entered it
            self.micro_batches.append(int(optimizer.accumulated_iterations))
            ids = [c for c in model._seen if len(c)]
            most = int(np.bincount(torch.cat(ids).numpy()).max()) if ids else 0
            self.multiplicity.append(most)
            inner()

        optimizer.add_noise = add_noise

    # --- the Trainer's events

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kw
    ):
        from opacus.data_loader import DPDataLoader

        chain = _unwrap_optimizer(optimizer)
        if optimizer is not None and all(o is not self.optimizer for o in chain):
            raise ValueError(
                "the Trainer steps an optimizer that is not the DPOptimizer make_private "
                f"returned ({type(chain[-1]).__name__}): it would add no noise. Pass "
                "optimizers=(dp_optimizer, None) to the Trainer"
            )
        if int(getattr(args, "n_gpu", 1) or 1) > 1 or int(args.world_size) > 1:
            raise ValueError(
                f"the Trainer would run on {max(args.n_gpu, args.world_size)} devices or "
                "processes (DataParallel / DDP): Opacus's per-sample gradients and this audit "
                "are for one process on one device here (Opacus's own DPDDP is not this path)"
            )
        k = int(args.gradient_accumulation_steps)
        if k > 1 and getattr(model, "grad_accumulation_allowed", True) is False:
            raise ValueError(
                f"gradient_accumulation_steps = {k} with Opacus's Poisson sampling: each "
                "micro-batch is its own Poisson draw, so one noised step would sum k draws (a "
                "record up to k times, up to k·C) that Opacus accounts as one draw at rate k·q; "
                "Opacus forbids it (its GradSampleModule raises at the second backward). Use "
                "gradient_accumulation_steps=1 with a larger Poisson batch, or Opacus's "
                "BatchMemoryManager for physical batches"
            )
        loader = train_dataloader
        if loader is not None and loader is not self.data_loader and args.remove_unused_columns:
            import inspect

            names = inspect.signature(model.forward).parameters if model is not None else {}
            if COLUMN not in names:
                raise ValueError(
                    "remove_unused_columns=True and the Trainer builds the train loader: it "
                    "keeps only the columns its model's forward signature names, and Opacus's "
                    f"GradSampleModule.forward(*args, **kwargs) names none, so {COLUMN!r} (and "
                    "the inputs) would be dropped. Set remove_unused_columns=False and train on "
                    "Opacus's loader (OpacusTrainer)"
                )
        own = loader is not None and loader is not self.data_loader
        poisson = isinstance(loader, DPDataLoader) if loader is not None else True
        self.trainer = {
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "trainer_built_loader": bool(own),
            "loader": type(loader).__name__ if loader is not None else None,
            "loader_batches": len(loader) if loader is not None else None,
            "remove_unused_columns": bool(args.remove_unused_columns),
            "max_grad_norm": float(args.max_grad_norm or 0.0),
            "logging_strategy": str(getattr(args.logging_strategy, "value", args.logging_strategy)),
            "output_dir": str(args.output_dir),
        }
        # where Opacus draws its noise and Poisson coins: without secure_mode and without a
        # generator of its own, from torch's global generator, which the Trainer seeded with
        # args.seed in __init__; still in exactly that state now = nothing reseeded it
        gen = getattr(self.optimizer, "generator", None)
        secure = bool(getattr(self.optimizer, "secure_mode", False))
        public = torch.Generator().manual_seed(int(args.seed)).get_state()
        self.trainer.update(
            seed=int(args.seed),
            noise_generator="Opacus secure_mode"
            if secure
            else ("the optimizer's generator" if gen is not None else "torch's global generator"),
            noise_seeded_by_trainer=bool(
                gen is None and not secure and torch.equal(torch.random.get_rng_state(), public)
            ),
            save_strategy=str(getattr(args.save_strategy, "value", args.save_strategy)),
            push_to_hub=bool(getattr(args, "push_to_hub", False)),
            global_generator_noise=bool(gen is None and not secure),
        )
        if torch.cuda.is_available() and gen is None and not secure:
            # on a GPU Opacus draws the noise on the parameters' device: the CUDA generator,
            # which set_seed seeds too (a CPU draw after the Trainer hides only the CPU one)
            try:
                dev = next(p.device for p in self.optimizer.params if p.is_cuda)
                g = torch.Generator(device=dev).manual_seed(int(args.seed))
                if torch.equal(torch.cuda.get_rng_state(dev), g.get_state()):
                    self.trainer["noise_seeded_by_trainer"] = True
            except StopIteration:
                pass
        if own:
            # the run's sampling is what the Trainer's loader drew (OpacusAudit reads it)
            self.audit_state.poisson = poisson
            self.audit_state.loader_len = len(loader)
            self.audit_state.dataset_size = len(loader.dataset)
            self.trainer["loader_batch_size"] = int(args.train_batch_size)
        self._begun = True
        self._state = state
        return control

    def on_train_end(self, args, state, control, **kw):
        if self.audit_on_train_end:
            self.run_audit(args.output_dir, trainer_steps=state.global_step, state=state)
        return control

    # --- the audit

    def default_claim(self, steps: int) -> dict:
        """The claim the PrivacyEngine makes for this run: σ and C as ``make_private`` set
        them, q = the Poisson loader's sample rate, ``steps`` noised steps, Poisson sampling
        and its accountant's ε at ``delta``."""
        if self.sigma0 < SIGMA_FLOOR:
            raise ValueError(
                f"σ = {self.sigma0:.3g} < {SIGMA_FLOOR}: Opacus's accountant is not asked at so "
                "small a σ (its grids grow past memory); give the claim explicitly (claim=...)"
            )
        return {
            "level": "sample",
            "noise_multiplier": self.sigma0,
            "clipping_norm": self.clip0,
            "sampling": "poisson",
            "sample_rate": self.q0,
            "steps_per_round": int(steps),
            "rounds": 1,
            "claimed_epsilon": float(self.engine.get_epsilon(self.delta)),
            "delta": self.delta,
            "accounting": "composed",
        }

    def run_audit(self, output_dir=None, *, trainer_steps: int | None = None, state=None) -> dict:
        """Audit the run so far against the claim; write ``library_audit.json`` into
        ``output_dir`` (when given) and log the verdict. Returns the audit dict."""
        a = self.audit_state
        state = state if state is not None else self._state
        if trainer_steps is None and state is not None:
            trainer_steps = state.global_step
        steps = int(trainer_steps if trainer_steps is not None else len(a.obs))
        claim = self.claim if self.claim is not None else self.default_claim(steps)
        kw = {} if self.permutations is None else {"permutations": self.permutations}
        res = a.audit(claim, alpha=self.alpha, seed=self.seed, **kw)
        findings, untested = res["findings"], res["untested"]
        tr = dict(self.trainer)
        k_args = tr.get("gradient_accumulation_steps", 1)
        micro = sorted(set(self.micro_batches))
        tr["optimizer_steps"] = steps
        tr["noised_steps"] = len(a.obs)
        tr["micro_batches_per_noised_step"] = micro[0] if len(micro) == 1 else micro
        twice = int(sum(m > 1 for m in self.multiplicity))
        tr["steps_with_a_canary_drawn_twice"] = twice
        if not self._begun:
            untested.append(
                "the Trainer's configuration (the callback saw no on_train_begin: pass it in "
                "Trainer(callbacks=[...]))"
            )
        if tr.get("noise_seeded_by_trainer"):
            findings.append(
                {
                    "code": "noise_seeded_by_trainer",
                    "message": "Opacus drew its noise and its Poisson coins from torch's global "
                    "generator (secure_mode off, no generator of its own), which the Trainer "
                    f"seeded with args.seed = {tr['seed']} in its __init__ and which nothing "
                    "reseeded before training: the noise is a function of that seed (public; "
                    "the default is 42), so whoever knows it regenerates the noise and "
                    "subtracts it. Reseed from the OS's entropy after building the Trainer "
                    "(torch.manual_seed(secrets.randbits(63))) or use secure_mode",
                }
            )
        if tr.get("global_generator_noise") and (
            tr.get("save_strategy") not in (None, "no") or tr.get("push_to_hub")
        ):
            findings.append(
                {
                    "code": "noise_state_in_checkpoints",
                    "message": "Opacus drew its noise from torch's global generator (secure_mode "
                    "off), and the Trainer writes that generator's state into every checkpoint "
                    f"(rng_state.pth; save_strategy = {tr.get('save_strategy')!r}"
                    + (", push_to_hub" if tr.get("push_to_hub") else "")
                    + "): whoever reads a checkpoint regenerates the noise of every later step. "
                    "Set save_strategy='no', or give Opacus secure_mode",
                }
            )
        if tr.get("trainer_built_loader") and not a.poisson:
            for f in findings:  # OpacusAudit names make_private's flag; here the Trainer did it
                if f["code"] == "sampling_mismatch":
                    f["message"] = (
                        f"the claim's sampling is {res['claim']['sampling']!r} but the Trainer "
                        "drew 'shuffle' batches from a loader it built; Opacus's accountant "
                        "accounts them as Poisson at q = 1/len(its DPDataLoader)"
                    )
            findings.append(
                {
                    "code": "trainer_loader_not_poisson",
                    "message": f"the Trainer trained on a loader it built ({tr['loader']}, "
                    f"{tr['loader_batches']} shuffled batches of {tr.get('loader_batch_size')}) "
                    "and never iterated Opacus's Poisson DPDataLoader, which Opacus's "
                    "accountant accounts (override get_train_dataloader: OpacusTrainer)",
                }
            )
        k_run = max(micro) if micro else 1
        if k_args > 1 or k_run > 1:
            k = max(k_args, k_run)
            sigma = float(np.min(res["run"]["noise_multiplier"]))  # the least noise: ε's max
            eps_ga = None
            if a.poisson:
                try:
                    eps_ga = accumulation_epsilon(
                        max(sigma, SIGMA_FLOOR), self.q0, self.micro_batches, self.delta
                    )
                except Exception as exc:  # the PLD's own limits
                    untested.append(f"the ε of the accumulated mechanism was not computed ({exc})")
                eps_txt = (
                    f"{'≥ ' if sigma < SIGMA_FLOOR else ''}{eps_ga:.4g}"
                    if eps_ga is not None
                    else "not computed"
                )
                what = (
                    f"{k} independent Poisson batches (q = {self.q0:.4g} each), which Opacus "
                    f"accounts as one Poisson draw at rate {k}·q with sensitivity C; a record "
                    f"enters a step Binomial({k}, q) times (up to {k}·C): the ε of what ran is "
                    f"{eps_txt} (claimed {res['claimed_epsilon']:.4g})"
                )
            else:
                what = (
                    f"{k} shuffled batches (about {k} times the batch), which Opacus accounts "
                    f"as one Poisson draw at rate {k}·q; the batches are not Poisson"
                )
            tr["accumulation_epsilon"] = eps_ga
            tr["accumulation_epsilon_at_least"] = bool(eps_ga is not None and sigma < SIGMA_FLOOR)
            findings.append(
                {
                    "code": "gradient_accumulation",
                    "message": f"gradient_accumulation_steps = {k}: each noised step sums "
                    + what
                    + "; use gradient_accumulation_steps=1 with a larger Poisson batch, or "
                    "Opacus's BatchMemoryManager for physical batches",
                }
            )
        if twice:
            findings.append(
                {
                    "code": "canary_drawn_twice_in_a_step",
                    "message": f"in {twice} of {len(a.obs)} noised steps a canary record entered "
                    "more than one micro-batch of the same step (the sampler's coins): its "
                    "contribution to that step was more than C",
                }
            )
        res["outside_releases"] = self._outside_releases(state)
        leak = self._grad_norm_leak(state)
        tr["logged_grad_norm_test"] = leak
        if leak is not None and leak["p_value"] <= ALPHA_WARN:
            weak = leak["p_value"] > ALPHA
            findings.append(
                {
                    "code": "nonprivate_grad_norm_logged" + ("_weak" if weak else ""),
                    **({"severity": "warning"} if weak else {}),
                    "message": "the Trainer logged grad_norm, the norm of the non-private "
                    "gradient (p.grad before Opacus replaces it), and it tells the logged steps "
                    f"where a canary was drawn ({leak['with_canary']}) from the others "
                    f"({leak['without_canary']}): Mann-Whitney p = {leak['p_value']:.3g}, "
                    f"medians {leak['median_with']:.3g} vs {leak['median_without']:.3g}; "
                    'logging_strategy="no" for a run whose logs are released',
                }
            )
        if res["outside_releases"]:
            untested.append(
                "the Trainer's logs ("
                + ", ".join(sorted({r["key"] for r in res["outside_releases"]}))
                + "): statistics of the private batches outside Opacus's mechanism, not "
                "covered by the claim nor audited"
            )
        res["library"] = "opacus (transformers Trainer)"
        res["version"] = _version()
        res["trainer"] = tr
        # warnings and infos are reported, not counted; pass only when sampling, clipping,
        # noise and accounting were each tested (audit.coverage.decide: incomplete, exit 4)
        errors = sum(f.get("severity", "error") == "error" for f in findings)
        res["verdict"], res["exit_code"] = decide(errors, Coverage.from_dict(res["coverage"]))
        self.result = res
        if output_dir is not None:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            save_result(res, out / FILENAME)  # strict JSON, atomic, checked readable
        verdict = res["verdict"]
        if verdict == "incomplete":
            verdict += ": " + ", ".join(f"{p} untested" for p in res["coverage"]["untested"])
        msg = (
            f"library audit: {verdict} (claimed ε = {res['claimed_epsilon']:.4g}, "
            f"recomputed ε = {res['recomputed_epsilon']:.4g}, noise factor "
            f"{res['noise_factor']:.3g}); findings: "
            + (", ".join(f["code"] for f in findings) or "none")
        )
        (logger.info if res["verdict"] == "pass" else logger.warning)(msg)
        return res

    def _grad_norm_leak(self, state) -> dict | None:
        """Does the logged ``grad_norm`` separate the logged steps where an included canary
        was drawn (the coins) from the others? One-sided Mann-Whitney U (larger with a
        canary: its non-private gradient on the canary block is ``gain`` per draw). None
        when no step with and none without a canary was logged."""
        from scipy import stats

        if state is None:
            return None
        coins = self.audit_state.observations()["coins"][:, self.canaries.included]
        drawn = coins.any(axis=1) if coins.size else np.zeros(len(coins), dtype=bool)
        w, wo = [], []
        for h in state.log_history:
            s = h.get("step")
            if "grad_norm" in h and isinstance(s, int) and 1 <= s <= len(drawn):
                (w if drawn[s - 1] else wo).append(float(h["grad_norm"]))
        if not w or not wo:
            return None
        p = float(stats.mannwhitneyu(w, wo, alternative="greater").pvalue)
        return {
            "with_canary": len(w),
            "without_canary": len(wo),
            "p_value": p,
            "median_with": float(np.median(w)),
            "median_without": float(np.median(wo)),
        }

    @staticmethod
    def _outside_releases(state) -> list[dict]:
        """What the Trainer logged from the private batches (its log history)."""
        if state is None:
            return []
        out = []
        for key in ("loss", "grad_norm", "train_loss"):
            n = sum(1 for h in state.log_history if key in h)
            if n:
                out.append({"key": key, "entries": n})
        return out


def _version() -> str:
    import opacus
    import transformers

    return f"transformers {transformers.__version__} / opacus {opacus.__version__}"
