"""Local training on the shared model: one peft model (and its Opacus per-sample-gradient
wrapper) that every client loads its state into, trains with (DP-)SGD, and reads back.

The Poisson batches and the DP-SGD noise come from the run's secret streams, handed in
by the caller (:class:`fl.contexts.ClientContext`); see :mod:`fl.engine`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from fl import factors as F
from fl.config import TrainConfig
from fl.models import LoraSpec, load_base_model, wrap_lora
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, clip_and_noise
from fl.tokenized import TokenizedData

# Expected and harmless: Opacus' full backward hooks on frozen-input modules, and a
# transformers deprecation notice inside peft; they would drown the progress output.
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def poisson_masks(source, n: int, q: float, steps: int) -> list[torch.Tensor]:
    """The Poisson batches of a local training: step t includes example i iff
    U_{t,i} < q, with U from the noise stream ``source`` (secret: the amplification by
    sampling holds only if nobody can predict the batches)."""
    return [R.bernoulli_mask(source, n, q) for _ in range(steps)]


@dataclass
class TrainResult:
    state: dict
    loss: float
    steps: int
    examples: int
    dp_stats: dict = field(default_factory=dict)


class LocalTrainer:
    """One peft model (and its Opacus per-sample-gradient wrapper), reused by every
    client: load state → train → read state."""

    def __init__(self, cfg: TrainConfig, num_labels: int, device: torch.device):
        from opacus import GradSampleModule

        self.cfg = cfg
        self.device = device
        net = load_base_model(cfg.model, num_labels, seed=cfg.seed)
        targets = tuple(t for t in cfg.target_modules.split(",") if t) or None
        self.model = wrap_lora(
            net, LoraSpec(cfg.rank, cfg.alpha, cfg.lora_dropout, targets), seed=cfg.seed
        )
        self.model.to(device)
        self.scaling = F.scaling(cfg.alpha, cfg.rank)
        # Hooks mode: Opacus computes per-sample gradients for trainable params only.
        self.gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="sum")
        self.gsm.disable_hooks()
        self.lora = F.lora_param_map(self.model)
        self.head = F.head_param_map(self.model)
        self._hook_key = frozenset({"A", "B", "head"})

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

    def initial_state(self) -> dict:
        return F.get_state(self.model)

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
        """Local training from ``start``. Batches are Poisson-sampled with rate
        q = batch_size / n in both DP and non-DP modes (so σ=0, C=∞ DP training equals
        non-DP training); the loss is summed and divided by the expected batch q·n.

        prox_mu: FedProx term μ/2‖θ − θ_start‖² (its gradient is data-independent and is
        added after privatization). correction: SCAFFOLD's c − c_i, per flat state key,
        added after privatization. grad_transform: optional callable(params, dp, gen, b)
        for methods that privatize in their own space (FedASK W-space clipping).
        grad_mask: flat state key → 0/1 tensor of the parameter's shape; masked-out
        coordinates are frozen: excluded from the per-sample norm (so they cost no
        clipping budget) and their (noisy) gradient is zeroed — post-processing. Used
        to train a subset of ranks (heterogeneous ranks, Fed-PLoRA module selection).
        streams: (noise source, batch source): the run's secret streams for this
        client's DP-SGD noise and Poisson batches. dropout_seed: public.
        """
        cfg = self.cfg
        F.set_state(self.model, start)
        self._ensure_hooks(trainable)
        params = self._set_trainable(trainable)
        flat_names = self._flat_names(params)
        self.model.train()
        torch.manual_seed(dropout_seed)
        noise_gen, batch_src = streams
        n = len(positions)
        q = min(1.0, cfg.batch_size / n)
        expected = q * n
        if cfg.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=cfg.lr)
        else:
            opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        start_vals = [p.detach().clone() for p in params] if prox_mu > 0 else None
        # Frozen (masked) coordinates must not move at all — not even by AdamW's
        # decoupled weight decay, which ignores gradients: they are restored each step.
        frozen_vals = [p.detach().clone() for p in params] if grad_mask else None
        pos_t = torch.as_tensor(positions, dtype=torch.long)
        use_hooks = dp is not None
        if use_hooks:
            self.gsm.enable_hooks()
        losses, examples, dp_stats = [], 0, {"mean_norm": [], "frac_clipped": [], "nonfinite": 0}
        masks = poisson_masks(batch_src, n, q, steps)
        try:
            for mask in masks:
                idx = pos_t[mask]
                b = len(idx)
                examples += b
                opt.zero_grad(set_to_none=True)
                if b > 0:
                    batch = data.batch(idx, self.device)
                    labels = batch.pop("labels")
                    net = self.gsm if use_hooks else self.model
                    logits = net(**batch).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits.float(), labels, reduction="sum"
                    )
                    (loss / (1.0 if use_hooks else expected)).backward()
                    losses.append(loss.item() / b)
                masks = None
                if grad_mask:
                    masks = [grad_mask.get(nm) for nm in flat_names]
                    for p, mk in zip(params, masks):
                        if mk is None:
                            continue
                        mk = mk.to(p.device, p.dtype)
                        if getattr(p, "grad_sample", None) is not None:
                            p.grad_sample = p.grad_sample * mk
                        if p.grad is not None:
                            p.grad.mul_(mk)
                if dp is not None:
                    if grad_transform is not None:
                        st = grad_transform(params, dp, noise_gen, b)
                    else:
                        for p in params:
                            if b == 0:
                                p.grad_sample = None
                        st = clip_and_noise(params, dp, noise_gen, b)
                    if b > 0:
                        dp_stats["mean_norm"].append(st["mean_norm"])
                        dp_stats["frac_clipped"].append(st["frac_clipped"])
                    dp_stats["nonfinite"] += st["nonfinite"]
                else:
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                if masks is not None:
                    for p, mk in zip(params, masks):
                        if mk is not None and p.grad is not None:
                            p.grad.mul_(mk.to(p.device, p.dtype))
                if prox_mu > 0:
                    for p, p0 in zip(params, start_vals):
                        p.grad.add_(p.detach() - p0, alpha=prox_mu)
                if correction is not None:
                    for p, nm in zip(params, flat_names):
                        if nm in correction:
                            p.grad.add_(correction[nm].to(p.device, p.dtype))
                if masks is not None and (prox_mu > 0 or correction is not None):
                    for p, mk in zip(params, masks):
                        if mk is not None:
                            p.grad.mul_(mk.to(p.device, p.dtype))
                opt.step()
                if frozen_vals is not None and masks is not None:
                    with torch.no_grad():
                        for p, mk, p0 in zip(params, masks, frozen_vals):
                            if mk is not None:
                                m = mk.to(p.device, p.dtype)
                                p.copy_(m * p + (1 - m) * p0)
        finally:
            if use_hooks:
                self.gsm.disable_hooks()
                for p in params:
                    p.grad_sample = None
        state = F.get_state(self.model)
        stats = {
            k: (float(np.mean(v)) if isinstance(v, list) and v else v) for k, v in dp_stats.items()
        }
        result = TrainResult(
            state, float(np.mean(losses)) if losses else float("nan"), steps, examples, stats
        )
        return result, opt.state_dict()

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

    @torch.no_grad()
    def evaluate(self, state: dict, data: TokenizedData, batch_size: int) -> dict:
        F.set_state(self.model, state)
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
