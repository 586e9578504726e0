"""Local training on the shared model: one peft model (and its Opacus per-sample-gradient
wrapper) that every client loads its state into, trains with (DP-)SGD, and reads back.

Each local step is: backward, a *privatizer* (DP-SGD in the parameters' space or a
method's own, or none), then the *post-privacy hooks* in order, then the optimizer step;
the privatizers, the hooks and :func:`fl.run.local_step.local_step`, which builds them from
the arguments of ``ClientContext.train``, live in :mod:`fl.run.local_step`.

The Poisson batches (drawn by :mod:`fl.run.batches`) and the DP-SGD noise come from the run's
secret streams, handed in by the caller (:class:`fl.run.contexts.ClientContext`); see
:mod:`fl.run.engine`.

The canaries and planted faults the audit places in a local training are
:mod:`fl.run.probes`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from fl.data.tokenized import TokenizedData, length_chunks
from fl.models import causal_lm
from fl.models import factors as F
from fl.models.base import LoraSpec, dropout_off, load_base_model, wrap_lora
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, DpStats
from fl.privacy.tap import batches as batches_tap
from fl.run.batches import fixed_batches, poisson_masks, release_freed_memory
from fl.run.config import TrainConfig
from fl.run.local_step import DpSgd, Hook, local_step
from fl.run.probes import TrainerProbes, noise_factor

# Expected and harmless: Opacus' full backward hooks on frozen-input modules, and a
# transformers deprecation notice inside peft; they would drown the progress output.
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def _join_grad_samples(params: list[torch.nn.Parameter]) -> None:
    """After several backward passes on one batch, Opacus leaves each parameter's
    per-sample gradients as a list, one tensor per pass; join them into one
    (examples × shape) tensor, the rows of every parameter in the same example order."""
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if isinstance(gs, list):
            p.grad_sample = torch.cat(gs, dim=0)


@dataclass
class TrainResult:
    state: dict
    loss: float
    steps: int
    examples: int
    dp_stats: dict = field(default_factory=dict)


class LocalTrainer(TrainerProbes):
    """One peft model (and its Opacus per-sample-gradient wrapper), reused by every
    client: load state → train → read state."""

    def __init__(
        self,
        cfg: TrainConfig,
        num_labels: int,
        device: torch.device,
        frozen_encoder: bool = False,
    ):
        """``frozen_encoder``: the method never trains the LoRA factors (the linear
        probe), so the whole encoder is a frozen prefix and its pooled features can be
        cached."""
        from opacus import GradSampleModule

        self.cfg = cfg
        self.device = device
        self.causal = cfg.task == "causal-lm"
        causal_lm.check_precision(device, cfg.precision)
        if self.causal:  # a causal LM (no head; the prefix cache stays off): fl.models.causal_lm
            net = causal_lm.load_causal_lm(cfg.model, seed=cfg.seed)
        else:
            net = load_base_model(
                cfg.model, num_labels, seed=cfg.seed, pooling=cfg.pooling, head_init=cfg.head_init
            )
        targets = tuple(t for t in cfg.target_modules.split(",") if t) or None
        spec = LoraSpec(cfg.rank, cfg.alpha, cfg.lora_dropout, targets, cfg.lora_layers)
        self.model = wrap_lora(net, spec, seed=cfg.seed)
        if cfg.dropout == "off":
            dropout_off(self.model)
        self.model.to(device)
        from fl.models.heads import FrozenPrefix

        self.prefix = FrozenPrefix(self.model, net, frozen_encoder, cfg.prefix_cache)
        self.scaling = F.scaling(cfg.alpha, cfg.rank)
        # Hooks mode: Opacus computes per-sample gradients for trainable params only.
        self.gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="sum")
        self.gsm.disable_hooks()
        self.lora = F.lora_param_map(self.model)
        self.head = F.head_param_map(self.model)
        self._in_train_mode = False  # see run()
        self.lr_scale = 1.0  # the last run()'s lr_schedule multiplier (lr_of)
        self._hook_key = frozenset({"A", "B", "head"})
        #: the run's gradient canaries (``--canary-kind gradient``, set by the engine's
        #: set-up: :class:`fl.privacy.gradient_canaries.GradientCanaries`); None otherwise
        self.gradient_canaries = None
        #: where sampler canaries' observations go (``--sampler-canaries``: the run
        #: directory, set by the engine); None otherwise
        self.sampler_out = None

    def _ensure_hooks(self, trainable: set[str]) -> None:
        """Opacus hooks only the modules that were trainable when hooks were added; a
        frozen module with a hook would fail ("No activations detected"). Re-hook when
        the trainable set changes (cheap: no copy of the model)."""
        key = frozenset(trainable)
        if key == self._hook_key:
            return
        self.gsm.remove_hooks()
        self._set_trainable(trainable)
        self.gsm.add_hooks(loss_reduction="sum", batch_first=True)
        self.gsm.disable_hooks()
        self._hook_key = key

    def _maps(self) -> F.ParamMaps:
        return self.lora, self.head

    def initial_state(self) -> dict:
        return F.get_state(self.model, self._maps())

    def _set_trainable(self, trainable: set[str]) -> list[torch.nn.Parameter]:
        params = []
        for ab in self.lora.values():
            for which, p in ab.items():
                p.requires_grad_(which in trainable)
                if which in trainable:
                    params.append(p)
        for p in self.head.values():
            p.requires_grad_("head" in trainable)
            if "head" in trainable:
                params.append(p)
        return params

    def train(
        self,
        start: dict,
        data: TokenizedData,
        positions: np.ndarray,
        steps: int,
        trainable: set[str],
        dp: DpSgdParams | None,
        streams: tuple,
        dropout_seed: int,
        prox_mu: float = 0.0,
        correction: dict[str, torch.Tensor] | None = None,
        opt_state: dict | None = None,
        grad_transform=None,
        grad_mask: dict[str, torch.Tensor] | None = None,
    ) -> tuple[TrainResult, dict]:
        """:meth:`run` with the privatizer and hooks of :func:`local_step` (the
        arguments of ``ClientContext.train``). streams: (noise source, batch source)."""
        noise, batch_src = streams
        privatizer, hooks = local_step(dp, noise, prox_mu, correction, grad_transform, grad_mask)
        return self.run(
            start,
            data,
            positions,
            steps,
            trainable,
            privatizer,
            hooks,
            batch_src,
            dropout_seed,
            opt_state,
        )

    def run(
        self,
        start: dict,
        data: TokenizedData,
        positions: np.ndarray,
        steps: int,
        trainable: set[str],
        privatizer,
        hooks: list[Hook],
        batch_source,
        dropout_seed: int,
        opt_state: dict | None = None,
        lr_scale: float = 1.0,
        sample_size: int | None = None,
    ) -> tuple[TrainResult, dict]:
        """Local training from ``start``: each step backward, ``privatizer``, then
        ``hooks`` (see :class:`Hook`), then the optimizer step. Batches are
        Poisson-sampled with rate q = batch_size / n in both DP and non-DP modes (so
        σ=0, C=∞ DP training equals non-DP training); the loss is summed and divided by
        the expected batch q·n (by the privatizer in DP mode). batch_source: the run's
        secret stream for this client's Poisson batches. dropout_seed: public.
        lr_scale: this round's multiplier of both learning rates (``lr_schedule``).
        sample_size: the client's public size n (default ``len(positions)``): q and the
        expected batch use it, so that secret canaries among ``positions`` change neither
        (each position, canary or not, is in a batch with probability q = B/n).
        """
        cfg = self.cfg
        F.set_state(self.model, start, self._maps())
        self.prefix.check(data)
        self._ensure_hooks(trainable)
        params = self._set_trainable(trainable)
        flat_names = self._flat_names(params)
        # train() walks every module (milliseconds a client): only when something may
        # have switched a module to eval since this trainer last set train mode.
        if not (self._in_train_mode and self.model.training):
            self.model.train()
            self._in_train_mode = True
        if self.device.type == "cpu":  # the CPU generator is the one dropout draws from
            torch.default_generator.manual_seed(dropout_seed)
        else:
            torch.manual_seed(dropout_seed)
        n = len(positions)
        q = min(1.0, cfg.batch_size / (sample_size or n))
        expected = q * (sample_size or n)
        opt = self._optimizer(params)
        if opt_state is not None:
            opt.load_state_dict(opt_state)  # restores the saved lrs: set them after
        self.lr_scale = float(lr_scale)
        for g, base in zip(opt.param_groups, self._group_lrs(params), strict=True):
            g["lr"] = base * self.lr_scale
        for h in hooks:
            h.start(params, flat_names)
        if isinstance(privatizer, DpSgd):
            privatizer.start(params, flat_names)
        canaries = self._begin_canaries(privatizer, params, flat_names, q, steps)
        sampler = self._begin_sampler(privatizer, q)
        rows = n + (sampler.m if sampler is not None else 0)  # canary rows after the examples
        fault = self._plant_fault(privatizer, params, flat_names) if cfg.inject_fault else None
        pos_t = torch.as_tensor(positions, dtype=torch.long)
        per_sample = privatizer.per_sample
        end_pass = getattr(privatizer, "end_pass", None)
        if per_sample:
            self.gsm.enable_hooks()
        # Losses and DP stats stay on the device until the end (no host sync per step).
        losses, examples, dp_stats = [], 0, DpStats()
        try:
            if fault == "fixed_batches":  # planted fault (tests only): no Poisson sampling
                masks = fixed_batches(batch_source, rows, q, steps)
                if canaries is not None:  # a canary is one more record of the shuffle
                    nb = -(-n // max(1, int(round(q * n))))
                    slot = R.integers(batch_source, nb, len(canaries.included))
                    canaries.coins = [slot == t % nb for t in range(steps)]
            else:
                masks = poisson_masks(batch_source, rows, q, steps)
            masks = batches_tap(masks, n)  # the neighbour replay's frozen coins (fl.privacy.tap)
            for mask in masks:
                if sampler is not None:  # the sampler canaries' rows, drawn with the rest
                    mask, tail = mask[:n], mask[n:]
                idx = pos_t[mask]
                b = len(idx)
                examples += b
                opt.zero_grad(set_to_none=True)
                if b > 0:
                    net = self.gsm if per_sample else self.model
                    loss = 0.0
                    chunks = self._chunks(data, idx)
                    for chunk in chunks:
                        batch = data.batch(chunk, self.device)
                        labels = batch.pop("labels")
                        with causal_lm.autocast(self.device, cfg.precision):
                            logits = net(**batch).logits
                        part = self.loss_sum(logits, labels)
                        (part / (1.0 if per_sample else expected)).backward()
                        loss = loss + part.detach()
                        if end_pass is not None:  # a transform that keeps per-pass state
                            end_pass()
                    if per_sample and len(chunks) > 1:
                        _join_grad_samples(params)
                    losses.append((loss, b))
                for h in hooks:
                    h.pre(params)
                st = privatizer(params, b)
                if sampler is not None:  # their isolated coordinates, from the same stream
                    sampler.step(tail, privatizer.noise, noise_factor(privatizer))
                if st is not None:
                    dp_stats.add(st, b > 0)
                for h in hooks:
                    h.post(params)
                opt.step()
                for h in hooks:
                    h.after_step(params)
        finally:
            if per_sample:
                self.gsm.disable_hooks()
                for p in params:
                    p.grad_sample = None
            if canaries is not None:
                privatizer.canaries = None
            if fault is not None:
                privatizer.fault = None
            if self.device.type == "cpu":
                release_freed_memory()
        if canaries is not None:
            self.gradient_canaries.finish(canaries)
        if sampler is not None:
            sampler.finish(self.sampler_out)
        state = F.get_state(self.model, self._maps())
        losses = [float(loss) / b for loss, b in losses]
        result = TrainResult(
            state,
            float(np.mean(losses)) if losses else float("nan"),
            steps,
            examples,
            dp_stats.summary(),
        )
        return result, opt.state_dict()

    #: the fixed cost of one forward/backward pass on the CPU, in padded tokens: the
    #: length buckets' trade-off (:func:`fl.data.tokenized.length_chunks`). Measured on
    #: minilm's top layer, batch 128 of tweets at 48 tokens, one thread: 256 gave 3
    #: sub-batches and 0.70× the single pass's step time; 0 (35 sub-batches) 0.85×.
    BUCKET_OVERHEAD_TOKENS = 256.0

    def _chunks(self, data: TokenizedData, idx: torch.Tensor) -> list[torch.Tensor]:
        """The sub-batches (passes) of one training batch: ``length_buckets`` (CPU only),
        each cut into passes of at most ``physical_batch`` examples (gradient
        accumulation, any device). An example's gradient does not depend on the other
        examples of its pass nor on padding beyond its own length, so only the float
        rounding changes; the step still clips and noises once (one release)."""
        if (
            not self.cfg.length_buckets
            or self.device.type != "cpu"
            or len(idx) < 2
            or data.cache_kind == "features"  # pooled features: nothing is padded
        ):
            parts = [idx]
        else:
            buckets = length_chunks(data.lengths[idx].numpy(), self.BUCKET_OVERHEAD_TOKENS)
            parts = [idx[torch.as_tensor(p, dtype=torch.long)] for p in buckets]
        cap = self.cfg.physical_batch
        if cap and any(len(p) > cap for p in parts):
            parts = [p[s : s + cap] for p in parts for s in range(0, len(p), cap)]
        return parts

    def _groups(self, params: list[torch.nn.Parameter]) -> list[dict]:
        """The optimizer's parameter groups: the LoRA factors at ``lr``, the head at
        ``head_lr`` (``lr`` when 0); empty groups left out."""
        cfg = self.cfg
        head_ids = {id(p) for p in self.head.values()}
        groups = [
            {"params": [p for p in params if id(p) not in head_ids], "lr": cfg.lr},
            {"params": [p for p in params if id(p) in head_ids], "lr": cfg.head_lr or cfg.lr},
        ]
        return [g for g in groups if g["params"]]

    def _group_lrs(self, params: list[torch.nn.Parameter]) -> list[float]:
        return [g["lr"] for g in self._groups(params)]

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """SGD or AdamW over :meth:`_groups` (their lrs before ``lr_scale``)."""
        cfg = self.cfg
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(self._groups(params), lr=cfg.lr)
        return torch.optim.AdamW(self._groups(params), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_of(self, flat_name: str) -> float:
        """The learning rate a flat state key (``head/...`` or ``factors/...``) had in
        the last local training: its group's lr times that round's ``lr_scale``."""
        cfg = self.cfg
        base = (cfg.head_lr or cfg.lr) if flat_name.startswith("head/") else cfg.lr
        return base * self.lr_scale

    def _flat_names(self, params: list[torch.nn.Parameter]) -> list[str]:
        ident = {id(p): None for p in params}
        for k, ab in self.lora.items():
            for which, p in ab.items():
                if id(p) in ident:
                    ident[id(p)] = f"factors/{k}/{which}"
        for k, p in self.head.items():
            if id(p) in ident:
                ident[id(p)] = f"head/{k}"
        return [ident[id(p)] for p in params]

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Σ over the batch of each example's loss: cross-entropy of the class, or the
        mean next-token NLL of its target tokens (:func:`fl.models.causal_lm.sequence_loss_sum`)."""
        if self.causal:
            return causal_lm.sequence_loss_sum(logits, labels)
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")

    @torch.no_grad()
    def evaluate(self, state: dict, data: TokenizedData, batch_size: int) -> dict:
        F.set_state(self.model, state, self._maps())
        self.prefix.check(data)
        self._in_train_mode = False
        if self.causal:
            return causal_lm.evaluate(self.model, data, batch_size, self.device, self.cfg.precision)
        self.model.eval()
        correct, loss_sum = 0, 0.0
        n = len(data)
        preds = []
        # Batches of similar length (shortest first) pad less; the metrics do not depend
        # on the order, and the predictions are put back in data order below.
        order = torch.argsort(data.lengths, stable=True)
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            batch = data.batch(idx, self.device)
            labels = batch.pop("labels")
            logits = self.model(**batch).logits.float()
            loss_sum += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(-1) == labels).sum())
            preds.append(logits.argmax(-1).cpu())
        self.model.train()
        pred = torch.zeros(n, dtype=torch.long)
        if preds:
            pred[order] = torch.cat(preds)
        # Balanced accuracy (mean per-class recall): tweets is ~70% negative, so plain
        # accuracy alone would flatter a majority-class model.
        recalls = [
            float((pred[data.labels == c] == c).float().mean())
            for c in torch.unique(data.labels).tolist()
        ]
        return {
            "accuracy": correct / max(n, 1),
            "balanced_accuracy": sum(recalls) / max(len(recalls), 1),
            "loss": loss_sum / max(n, 1),
        }
