"""The in-process federated engine: data, one shared model, rounds of stages, ledger,
checkpoints and the run directory.

One base model lives in memory; a client "trains" by loading its starting LoRA state
into it, running local (DP-)SGD and reading the result back.

Randomness: public draws (split, partition, init, Ω, dropout) derive from the public
``--seed``; every draw a DP guarantee relies on (DP-SGD noise, Poisson batches, client
cohorts, server noise, canary choices) comes from the run's secret noise key
(:mod:`fl.privacy.rng`, ``RUN/private/noise.key``), one stream per (purpose, round,
client, stage). Both are functions of their names only, so a resumed run — or a new
run given the same config and key — replays exactly what the first one did.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from fl import factors as F
from fl.config import TrainConfig
from fl.data import ids_hash, load_dataset, partition, split_dataset
from fl.errors import ClientFailure, UsageError
from fl.io import RunLock, atomic_write_json, atomic_write_text, file_sha256, read_json
from fl.methods import registry
from fl.methods.base import RoundInfo, parse_options
from fl.models import LoraSpec, load_base_model, load_tokenizer, resolve_device, wrap_lora
from fl.privacy import rng as R
from fl.privacy.accounting import (
    NEIGHBOURING,
    Event,
    Ledger,
    PrivacyError,
    calibrate_client_level,
    calibrate_noise,
    client_level_event,
    epsilon,
)
from fl.privacy.dpsgd import DpSgdParams, clip_and_noise
from fl.privacy.rng import derive_seed
from fl.release import write_release
from fl.transport import Delivery, Dispatcher, transport_class

SCHEMA_VERSION = 1

# Expected and harmless: Opacus' full backward hooks on frozen-input modules, and a
# transformers deprecation notice inside peft; they would drown the progress output.
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def generator(*parts: Any) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g


# ---------------------------------------------------------------------------------
# Data on the device
# ---------------------------------------------------------------------------------
class TokenizedData:
    """All texts tokenized once (padded to max_length); batches trimmed to their
    longest sequence."""

    def __init__(self, texts: list[str], labels: np.ndarray, tokenizer, max_length: int):
        enc = tokenizer(
            texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
        )
        self.input_ids = enc["input_ids"]
        self.attention_mask = enc["attention_mask"]
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.lengths = self.attention_mask.sum(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, idx: torch.Tensor | np.ndarray, device) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        L = int(self.lengths[idx].max()) if len(idx) else 1
        return {
            "input_ids": self.input_ids[idx, :L].to(device),
            "attention_mask": self.attention_mask[idx, :L].to(device),
            "labels": self.labels[idx].to(device),
        }


def poisson_masks(source, n: int, q: float, steps: int) -> list[torch.Tensor]:
    """The Poisson batches of a local training: step t includes example i iff
    U_{t,i} < q, with U from the noise stream ``source`` (secret: the amplification by
    sampling holds only if nobody can predict the batches)."""
    return [R.bernoulli_mask(source, n, q) for _ in range(steps)]


# ---------------------------------------------------------------------------------
# Local training on the shared model
# ---------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------
# Client and server contexts
# ---------------------------------------------------------------------------------
class ClientContext:
    """What a client handler sees: its id, data size, persistent state, and ``train``."""

    def __init__(self, engine: Engine, cid: str, rnd: RoundInfo):
        self.engine = engine
        self.id = cid
        self.round = rnd
        self.positions = engine.client_positions[cid]
        self.n = len(self.positions)
        self.state: dict = engine.client_states.setdefault(cid, {})
        self.events: list[Event] = []

    @property
    def scaling(self) -> float:
        return self.engine.trainer.scaling

    def steps(self) -> int:
        return self.engine.local_steps_for(self.engine.public_size(self.id))

    def dp_params(self) -> DpSgdParams | None:
        return self.engine.dp_params_for(self.engine.public_size(self.id))

    def train(
        self,
        start: dict,
        trainable: set[str] | tuple[str, ...] = ("A", "B", "head"),
        prox_mu: float = 0.0,
        correction: dict[str, torch.Tensor] | None = None,
        grad_transform=None,
        grad_mask: dict[str, torch.Tensor] | None = None,
        stage: str = "train",
    ) -> TrainResult:
        eng = self.engine
        dp = self.dp_params()
        steps = self.steps()
        opt_state = None if eng.cfg.reset_optimizer else self.state.get("_opt")
        r, cid = self.round.index, self.id
        result, opt_sd = eng.trainer.train(
            start,
            eng.members_data,
            self.positions,
            steps,
            set(trainable),
            dp,
            streams=(
                eng.rand.stream("dpsgd-noise", r, cid, stage),
                eng.rand.stream("poisson-batches", r, cid, stage),
            ),
            dropout_seed=derive_seed(eng.cfg.seed, "round", r, "client", cid, stage, "dropout"),
            prox_mu=prox_mu,
            correction=correction,
            opt_state=opt_state,
            grad_transform=grad_transform,
            grad_mask=grad_mask,
        )
        if not eng.cfg.reset_optimizer:
            self.state["_opt"] = opt_sd
        if dp is not None:
            self.events.append(
                Event(
                    "poisson_gaussian" if dp.sample_rate < 1 else "gaussian",
                    dp.noise_multiplier,
                    dp.sample_rate,
                    steps,
                    unit=f"client:{self.id}",
                    round=self.round.index,
                    stage=stage,
                    note="DP-SGD local steps",
                )
            )
        return result


class InProcessTransport:
    """Direct calls to the method's handlers (the engine's :class:`Dispatcher` does
    byte counts, validation, failures and ledger events)."""

    name = "inprocess"

    def __init__(self, engine: Engine):
        self.engine = engine

    def deliver(self, method, rnd: RoundInfo, stage, payloads, faults) -> dict[str, Delivery]:
        eng = self.engine
        handler = getattr(method, f"on_{stage}")
        out: dict[str, Delivery] = {}
        for cid, p in eng.progress(payloads, desc=f"round {rnd.index + 1} {stage}", leave=False):
            saved = dict(eng.client_states.get(cid, {}))
            ctx = ClientContext(eng, cid, rnd)
            try:
                if faults.get(cid):
                    raise ClientFailure(faults[cid])
                reply = dict(handler(ctx, p))
            except ClientFailure as exc:
                # The client's state is rolled back (what it trained is not kept); the
                # DP steps it took still count: its data was touched.
                eng.client_states[cid] = saved
                out[cid] = Delivery(None, list(ctx.events), f"{type(exc).__name__}: {exc}")
                continue
            reply.setdefault("n", ctx.n)
            out[cid] = Delivery(reply, list(ctx.events))
        return out


class ServerContext:
    """What a method's server program sees of the engine."""

    def __init__(self, engine: Engine):
        self.e = engine

    @property
    def cfg(self) -> TrainConfig:
        return self.e.cfg

    @property
    def scaling(self) -> float:
        return self.e.trainer.scaling

    @property
    def dp_level(self) -> str:
        return self.e.cfg.dp_level

    @property
    def noise_multiplier(self) -> float:
        return self.e.sigma

    @property
    def clip(self) -> float:
        return self.e.cfg.clip

    @property
    def expected_clients_per_round(self) -> float:
        return self.e.expected_clients_per_round()

    def noise_generator(self, rnd: RoundInfo, purpose: str) -> R.NoiseSource:
        """The run's secret noise stream for this round's server-side release."""
        return self.e.rand.stream("server", rnd.index, purpose)

    def noise(self, shape, std, gen) -> torch.Tensor:
        return R.draw_normal(gen, shape, std)

    def record_client_level_release(self, rnd: RoundInfo, stage: str, count: int = 1, sigma=None):
        self.e.record_client_level(rnd, stage, count, sigma)

    def log(self, msg: str) -> None:
        self.e.log(msg)

    def client_sizes(self) -> dict[str, int]:
        return {c: len(p) for c, p in self.e.client_positions.items()}

    def client_rank(self, cid: str) -> int:
        return self.e.client_ranks.get(cid, self.e.cfg.rank)


# ---------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------
class Engine:
    def __init__(
        self,
        cfg: TrainConfig,
        out: str | Path,
        resume: bool = False,
        quiet: bool = False,
        noise_key: str | Path | R.NoiseKey | None = None,
    ):
        self.cfg = cfg.validate()
        self.noise_key_arg = noise_key
        self.rand: R.RunRandomness | None = None
        self.out = Path(out)
        self.resume = resume
        self.quiet = quiet or not cfg.progress
        self.fault_injector = None  # tests: callable(rnd, cid, stage) -> str | None
        self.round_bytes: dict = {}
        self.client_states: dict[str, dict] = {}
        self.client_ranks: dict[str, int] = {}
        self._log_lines: list[str] = []
        self._pending_log: list[str] = []
        self.rejected_updates = 0

    # ---- output helpers ----------------------------------------------------------
    def progress(self, it, **kw):
        if self.quiet:
            return it
        from tqdm.auto import tqdm

        return tqdm(it, file=sys.stderr, dynamic_ncols=True, **kw)

    def log(self, msg: str) -> None:
        self._log_lines.append(msg)
        with open(self.out / "run.log", "a", encoding="utf-8") as fh:
            fh.write(msg + "\n")
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def add_bytes(self, rnd: RoundInfo, cid: str, direction: str, n: int) -> None:
        d = self.round_bytes.setdefault(cid, {"up": 0, "down": 0})
        d[direction] += int(n)

    # ---- set-up ------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.device = resolve_device(cfg.device)
        self.method_cls = registry.get(cfg.method)
        if cfg.dp_level not in self.method_cls.dp_levels:
            raise UsageError(
                f"method {cfg.method!r} supports dp levels {self.method_cls.dp_levels}, not {cfg.dp_level!r}"
            )
        self.options = parse_options(self.method_cls.Options, cfg.opts)
        ds = load_dataset(cfg.dataset, cfg.text_column, cfg.label_column)
        self.dataset = ds
        split = split_dataset(len(ds), cfg.members, cfg.nonmembers, cfg.test, cfg.seed)
        self.split = split
        member_labels = ds.labels[split.members]
        parts = partition(
            member_labels,
            cfg.clients,
            cfg.partition,
            cfg.dirichlet_alpha,
            cfg.seed,
            cfg.min_client_size,
        )
        self.client_positions = {str(k): p for k, p in enumerate(parts)}
        self.client_ranks = self._draw_client_ranks()
        self._setup_randomness()
        tok = load_tokenizer(cfg.model)
        texts = [ds.texts[i] for i in split.members]
        labels = list(ds.labels[split.members])
        self.position_ids = [ds.ids[i] for i in split.members]
        self.public_sizes = {c: len(p) for c, p in self.client_positions.items()}
        self._canaries = self._make_canaries(ds, split)
        for c in self._canaries.get("canaries", []):
            if c["included"]:
                # Added to the client's data (add/remove neighbours), never replacing
                # a member: the one-run audit's bound assumes exactly that relation.
                pos = len(texts)
                texts.append(c["text"])
                labels.append(c["label"])
                self.position_ids.append(c["id"])
                cid = c["client"]
                self.client_positions[cid] = np.append(self.client_positions[cid], pos)
        labels = np.asarray(labels, dtype=np.int64)
        self.members_data = TokenizedData(texts, labels, tok, cfg.max_length)
        self.test_data = TokenizedData(
            [ds.texts[i] for i in split.test], ds.labels[split.test], tok, cfg.max_length
        )
        self.trainer = LocalTrainer(cfg, ds.num_classes, self.device)
        self.server = ServerContext(self)
        self.method = self.method_cls(self.server, self.options)
        self._setup_privacy()
        self.method.init_state(self.trainer.initial_state())
        self.start_round = 0
        self.metrics_rows: list[dict] = []

    def _draw_client_ranks(self) -> dict[str, int]:
        cfg = self.cfg
        if cfg.client_ranks_list:
            try:
                ranks = [int(x) for x in cfg.client_ranks_list.split(",")]
            except ValueError:
                raise UsageError(
                    f"--client-ranks-list must be integers, got {cfg.client_ranks_list!r}"
                ) from None
            if len(ranks) != cfg.clients:
                raise UsageError(
                    f"--client-ranks-list gives {len(ranks)} ranks for {cfg.clients} clients"
                )
        elif cfg.client_ranks:
            try:
                choices = [int(x) for x in cfg.client_ranks.split(",")]
            except ValueError:
                raise UsageError(
                    f"--client-ranks must be integers, got {cfg.client_ranks!r}"
                ) from None
            rng = np.random.default_rng([cfg.seed, 0xA11])
            ranks = [int(rng.choice(choices)) for _ in range(cfg.clients)]
        else:
            return {}
        bad = [r for r in ranks if r < 1 or r > cfg.rank]
        if bad:
            raise UsageError(f"client ranks must be in [1, R={cfg.rank}], got {bad}")
        return {str(k): r for k, r in enumerate(ranks)}

    def _setup_randomness(self) -> None:
        """The run's noise streams: keyed by the secret run key (default), or seeded
        from the public seed under --insecure-deterministic-noise (not private)."""
        if self.rand is not None:
            return
        cfg = self.cfg
        if cfg.dp_level == "none" and not cfg.insecure_deterministic_noise:
            # No DP claimed, nothing to keep secret: draws from the public seed keep a
            # non-private run (a shadow model, a baseline) reproducible from its config.
            if self.noise_key_arg is not None:
                raise UsageError("--noise-key needs a DP run (--dp-level sample or client)")
            self.rand = R.RunRandomness(None, cfg.seed, no_dp=True)
            return
        if cfg.insecure_deterministic_noise:
            if self.noise_key_arg is not None:
                raise UsageError(
                    "--noise-key and --insecure-deterministic-noise exclude each other"
                )
            self.rand = R.RunRandomness(None, cfg.seed, insecure=True)
            return
        key = self.noise_key_arg
        if isinstance(key, str | Path):
            path = Path(key)
            key = R.NoiseKey.read(path)
            if not R.key_file_is_private(path):
                self._pending_log.append(
                    f"warning: noise key file {path} is readable by others than its owner"
                )
        elif key is None:
            own = self.out / R.PRIVATE_DIR / R.KEY_FILE
            if self.resume:
                if not own.is_file():
                    raise UsageError(
                        f"--resume: {own} is missing; a private run cannot be resumed "
                        "without its noise key (fresh noise would release the resumed "
                        "rounds twice)"
                    )
                key = R.NoiseKey.read(own)
            else:
                key = R.NoiseKey.generate()
        self.rand = R.RunRandomness(key, cfg.seed)

    def _make_canaries(self, ds, split) -> dict:
        """Audit canaries: M canaries, each ADDED with probability 1/2 to a random
        client's data (never replacing a member). Every choice (source example, label,
        text, inclusion, client) comes from the run's secret stream ``canaries``: the
        one-run audit needs inclusions nobody can predict."""
        cfg = self.cfg
        if cfg.canaries <= 0:
            return {}
        if cfg.canary_kind not in ("mislabel", "random_text"):
            raise UsageError(
                f"unknown canary kind {cfg.canary_kind!r}; use mislabel or random_text"
            )
        pool = split.nonmembers
        if len(pool) < cfg.canaries:
            raise UsageError(
                f"--canaries {cfg.canaries} needs at least as many non-member examples"
            )
        src = self.rand.stream("canaries")
        M, C = cfg.canaries, ds.num_classes
        chosen = pool[R.random_subset(src, len(pool), M)]
        order = R.integers(src, 1 << 30, M)  # shuffle the sorted subset
        chosen = chosen[np.argsort(order, kind="stable")]
        cids = self.client_ids()
        client_of = R.integers(src, len(cids), M)
        included = R.bernoulli_mask(src, M, 0.5).numpy()
        shift = R.integers(src, max(C - 1, 1), M)
        words = R.integers(src, 9000, 12 * M).reshape(M, 12) + 1000
        rand_labels = R.integers(src, C, M)
        canaries = []
        for j, i in enumerate(chosen):
            y = int(ds.labels[i])
            if cfg.canary_kind == "mislabel":
                text, label = ds.texts[i], int((y + 1 + shift[j]) % C)
            else:
                text = " ".join(f"zq{w}" for w in words[j])
                label = int(rand_labels[j])
            canaries.append(
                {
                    "id": f"canary:{j}",
                    "source_id": ds.ids[i],
                    "text": text,
                    "label": label,
                    "included": bool(included[j]),
                    "client": cids[int(client_of[j])] if included[j] else None,
                }
            )
        return {"canaries": canaries}

    # ---- privacy -----------------------------------------------------------------
    def client_ids(self) -> list[str]:
        return list(self.client_positions)

    def public_size(self, cid: str) -> int:
        """A client's member count before canaries are added: its sampling rate
        q = B/n and step count use it, so the public rates do not reveal how many
        secret canaries a client received (each example, canary or not, is still in a
        batch with probability q)."""
        return self.public_sizes[cid]

    def local_steps_for(self, n: int) -> int:
        cfg = self.cfg
        if cfg.local_epochs > 0:
            return max(1, math.ceil(cfg.local_epochs * n / cfg.batch_size))
        return cfg.local_steps

    def dp_params_for(self, n: int) -> DpSgdParams | None:
        if self.cfg.dp_level != "sample":
            return None
        q = min(1.0, self.cfg.batch_size / n)
        return DpSgdParams(self.sigma, self.cfg.clip, q, q * n)

    def expected_clients_per_round(self) -> float:
        cfg, K = self.cfg, self.cfg.clients
        cpr = cfg.clients_per_round
        if cpr == 0:
            return float(K)
        return float(cpr * K) if cpr < 1 else float(cpr)

    def client_rate(self) -> float:
        return self.expected_clients_per_round() / self.cfg.clients

    def _default_delta(self) -> float:
        n = self.cfg.members if self.cfg.dp_level == "sample" else self.cfg.clients
        return min(1e-5, 1.0 / (10.0 * n))

    def _setup_privacy(self) -> None:
        cfg = self.cfg
        level = cfg.dp_level
        if level == "none":
            self.sigma = 0.0
            self.delta = cfg.delta or 1e-5
            self.ledger = Ledger("none", self.delta)
            self.participation_note = "no DP: nothing is accounted"
            return
        n_pop = cfg.members if level == "sample" else cfg.clients
        self.delta = cfg.delta if cfg.delta > 0 else self._default_delta()
        if self.delta >= 1.0 / n_pop:
            raise UsageError(
                f"delta={self.delta:g} is >= 1/n = {1.0 / n_pop:g} (n = {n_pop} "
                f"{'examples' if level == 'sample' else 'clients'}); such a δ allows releasing a record"
            )
        if level == "sample":
            # Worst case: every client participates in every round (calibration);
            # the reported ε composes only the rounds each client actually took part in.
            mechs = sorted(
                {
                    (min(1.0, cfg.batch_size / n), self.local_steps_for(n))
                    for n in self.public_sizes.values()
                }
            )
            if cfg.epsilon > 0:
                self.sigma = max(
                    calibrate_noise(cfg.epsilon, q, s * cfg.rounds, self.delta, cfg.accountant)
                    for q, s in mechs
                )
            else:
                self.sigma = cfg.noise_multiplier
            self.participation_note = (
                "sample-level: an example lives on one client; its guarantee composes the DP-SGD "
                "steps of every round its client took part in (no amplification by client "
                "sampling is claimed). σ was calibrated for the worst case (a client that takes "
                "part in every round); the reported ε is the maximum over clients of the "
                "composition over the rounds each actually took part in."
            )
        else:
            releases = self.method.client_dp_releases()
            scheme, m, K = self.client_scheme()
            q = m / K if scheme == "poisson" else 1.0
            self.client_level_rate = q
            if cfg.epsilon > 0:
                self.sigma = calibrate_client_level(
                    cfg.epsilon, scheme, m, K, releases * cfg.rounds, self.delta, cfg.accountant
                )
            else:
                self.sigma = cfg.noise_multiplier
            how = {
                "poisson": f"Clients are Poisson-sampled with rate q={q:g} and the amplification "
                "by that sampling is used.",
                "all": "Every client takes part in every round: each release is a Gaussian of "
                "sensitivity C (no amplification).",
                "uniform": f"A fixed count of {m:g} of {K} clients is drawn each round without "
                "replacement: under add/remove an added client can displace another, so each "
                "release is accounted with sensitivity 2C (multiplier σ/2) and no amplification.",
            }[scheme]
            self.participation_note = (
                "client-level: neighbouring = one client's whole data added or removed; every "
                f"round makes {releases} Gaussian release(s) of the clipped client updates. " + how
            )
        self.ledger = Ledger(level, self.delta, budget=cfg.epsilon if cfg.epsilon > 0 else None)

    def client_scheme(self) -> tuple[str, float, int]:
        """(scheme, clients per round, total clients) of the client-level accounting:
        ``poisson`` (expected count), ``all`` (every client, every round) or ``uniform``
        (a fixed count drawn without replacement)."""
        K = self.cfg.clients
        m = self.expected_clients_per_round()
        if self.cfg.client_sampling == "poisson":
            return ("poisson", m, K) if m < K else ("all", K, K)
        m = int(round(m))
        return ("uniform", m, K) if m < K else ("all", K, K)

    def client_level_event(self, r: int, count: int, sigma=None, stage: str = "") -> Event:
        scheme, m, K = self.client_scheme()
        return client_level_event(
            scheme,
            m,
            K,
            self.sigma if sigma is None else sigma,
            count,
            round=r,
            stage=stage,
            note="server-side Gaussian on clipped client updates",
        )

    def record_client_level(self, rnd: RoundInfo, stage: str, count: int, sigma=None) -> None:
        self.ledger.record(self.client_level_event(rnd.index, count, sigma, stage))

    def planned_client_event(self, rnd: RoundInfo | int, cid: str, stage: str = "train"):
        """The DP-SGD event a client's local training makes (sample level), from what
        the server knows (σ, the client's q and steps); None without sample-level DP."""
        if self.cfg.dp_level != "sample":
            return None
        r = rnd.index if isinstance(rnd, RoundInfo) else int(rnd)
        n = self.public_size(cid)
        dp = self.dp_params_for(n)
        return Event(
            "poisson_gaussian" if dp.sample_rate < 1 else "gaussian",
            self.sigma,
            dp.sample_rate,
            self.local_steps_for(n),
            unit=f"client:{cid}",
            round=r,
            stage=stage,
            note="DP-SGD local steps",
        )

    def _planned_events(self, rnd: int, clients: list[str]) -> list[Event]:
        if self.cfg.dp_level == "sample":
            return [self.planned_client_event(rnd, c) for c in clients]
        if self.cfg.dp_level == "client":
            return [self.client_level_event(rnd, self.method.client_dp_releases())]
        return []

    # ---- client sampling ---------------------------------------------------------
    def sample_clients(self, rnd: int) -> list[str]:
        """The round's cohort, from the secret stream ``cohort`` (amplification by
        client sampling holds only if the cohort cannot be predicted)."""
        cfg = self.cfg
        ids = self.client_ids()
        m = int(round(self.expected_clients_per_round()))
        if cfg.client_sampling != "poisson" and m >= len(ids):
            return ids
        src = self.rand.stream("cohort", rnd)
        if cfg.client_sampling == "poisson":
            keep = R.bernoulli_mask(src, len(ids), self.client_rate())
            return [c for c, k in zip(ids, keep.tolist()) if k]
        return [ids[i] for i in R.random_subset(src, len(ids), m)]

    # ---- run -----------------------------------------------------------------------
    def prepare_out(self) -> None:
        out = self.out
        if self.resume:
            if not out.is_dir():
                raise UsageError(f"--resume: {out} does not exist")
        else:
            # A directory holding only a lock / temp files was killed before it wrote
            # anything: starting it again is safe.
            if out.exists() and (
                not out.is_dir()
                or any(
                    not p.name.startswith(".") and p.name != R.PRIVATE_DIR for p in out.iterdir()
                )
            ):
                raise UsageError(
                    f"output directory {out} is not empty (use --resume to continue a run)"
                )
        try:
            out.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError, PermissionError) as exc:
            raise UsageError(
                f"cannot create output directory {out}: {exc.strerror or exc}"
            ) from None
        if not os.access(out, os.W_OK):
            raise UsageError(f"output directory {out} is not writable")

    def _start_files(self) -> None:
        """Under the run lock: the noise key, then config.json. From config.json on,
        `--resume DIR` knows the configuration and finds the key beside it; a start
        killed before config.json released nothing, so its key may be replaced."""
        self._setup_randomness()
        if self.resume:
            return
        if self.rand.private:
            self.rand.key.write(self.out, overwrite=True)
        atomic_write_json(self.out / "config.json", self.cfg.to_dict())

    def run(self) -> dict:
        self.prepare_out()
        with RunLock(self.out):
            self._start_files()
            return self._run_locked()

    def _run_locked(self) -> dict:
        t0 = time.time()
        self.setup()
        cfg = self.cfg
        if self.resume:
            self._load_checkpoint()
            self._account_inflight()
        if self.start_round == 0 or not (self.out / "splits.json").exists():
            atomic_write_json(self.out / "splits.json", self._splits_doc())
        if self.start_round >= cfg.rounds and (self.out / "manifest.json").exists():
            self.log(f"run already complete ({cfg.rounds} rounds)")
            return read_json(self.out / "manifest.json")
        self._truncate_metrics(self.start_round)
        dispatcher = Dispatcher(self, self.make_transport())
        for line in self._pending_log:
            self.log(line)
        self._pending_log = []
        self.log(
            f"fedlora train: method={cfg.method} model={cfg.model} dataset={cfg.dataset} "
            f"clients={cfg.clients} rounds={cfg.rounds} dp={cfg.dp_level} σ={self.sigma:.4g} "
            f"δ={self.delta:g} device={self.device}"
            + (f" (resuming at round {self.start_round + 1})" if self.start_round else "")
        )
        rounds = self.progress(
            range(self.start_round, cfg.rounds),
            desc="rounds",
            initial=self.start_round,
            total=cfg.rounds,
        )
        for r in rounds:
            rt = time.time()
            clients = self.sample_clients(r)
            rnd = RoundInfo(index=r, seed=derive_seed(cfg.seed, "round", r), clients=clients)
            planned = self._planned_events(r, clients)
            if self.ledger.would_exceed(planned, cfg.accountant):
                self.log(
                    f"stopping before round {r + 1}: it would take ε past the budget "
                    f"{self.ledger.budget:g} (now {self.ledger.epsilon(cfg.accountant):.3f})"
                )
                break
            self.round_bytes = {}
            self.rejected_updates = 0
            self._write_inflight(r, planned)
            # Under client-level DP the server releases (noise) even for an empty cohort:
            # skipping would reveal that no client was sampled.
            if clients or cfg.dp_level == "client":

                def send(cl, stage, payload, per_client=False, _rnd=rnd):
                    return dispatcher.send(self.method, _rnd, cl, stage, payload, per_client)

                extra = self.method.server_round(rnd, clients, send) or {}
            else:
                extra = {"skipped": "no client sampled"}
            row = {"round": r + 1, "clients": clients}
            if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
                row.update(
                    self.trainer.evaluate(
                        self.method.released_state(), self.test_data, cfg.eval_batch_size
                    )
                )
                for name, st in self.method.eval_states().items():
                    ev = self.trainer.evaluate(st, self.test_data, cfg.eval_batch_size)
                    row[f"{name}_accuracy"] = ev["accuracy"]
            row["epsilon"] = self.ledger.epsilon("pld") if cfg.dp_level != "none" else None
            row["bytes_up"] = sum(v["up"] for v in self.round_bytes.values())
            row["bytes_down"] = sum(v["down"] for v in self.round_bytes.values())
            row["bytes_per_client"] = self.round_bytes
            row["rejected_updates"] = self.rejected_updates
            row.update(extra)
            row["seconds"] = time.time() - rt
            self._append_metrics(row)
            self.log(self._summary_line(row))
            self._save_checkpoint(r + 1)
            self._clear_inflight()
        return self._finish(time.time() - t0)

    def noise_key_file(self) -> str | None:
        """Path of the run's key file (for Flower nodes on this machine), or None."""
        if not self.rand.private:
            return None
        if isinstance(self.noise_key_arg, str | Path):
            return str(Path(self.noise_key_arg).resolve())
        own = self.out / R.PRIVATE_DIR / R.KEY_FILE
        return str(own.resolve()) if own.is_file() else None

    def noise_key_id(self) -> str | None:
        return self.rand.key.key_id if self.rand.private else None

    # ---- rounds started but not completed ------------------------------------------
    def replays_bit_exact(self) -> bool:
        """Does re-running a round reproduce its releases bit for bit? On the CPU with
        the in-process transport, yes: every draw is a function of (key, round, client,
        stage) and the computation is deterministic. On a GPU (non-deterministic
        kernels) or over Flower (node-side state outlives a server kill) it may not."""
        return self.device.type == "cpu" and self.cfg.transport == "inprocess"

    def _inflight_path(self) -> Path:
        return self.out / "checkpoint" / "inflight.json"

    def _write_inflight(self, r: int, planned: list[Event]) -> None:
        """Journal a round before anything of it is sent: if the run is killed in it,
        resume knows its releases may have been observed."""
        path = self._inflight_path()
        path.parent.mkdir(exist_ok=True)
        doc = {
            "round": r,
            "device": self.device.type,
            "transport": self.cfg.transport,
            "planned": [e.to_dict() for e in planned],
        }
        atomic_write_json(path, doc)

    def _clear_inflight(self) -> None:
        self._inflight_path().unlink(missing_ok=True)

    def _account_inflight(self) -> None:
        """On resume: a round that was started but not completed may have released
        (a Flower message, a log line). If re-running it replays the same releases bit
        for bit, the re-run releases nothing new and nothing is charged; otherwise its
        planned events are composed into the ledger now, before it is run again."""
        path = self._inflight_path()
        if not path.is_file():
            return
        doc = read_json(path)
        r = int(doc.get("round", -1))
        if r < self.start_round:
            path.unlink(missing_ok=True)
            return
        same = doc.get("device") == "cpu" and doc.get("transport") == "inprocess"
        if (same and self.replays_bit_exact()) or self.cfg.dp_level == "none":
            self.log(
                f"round {r + 1} was started before the run stopped; it is re-run with the same "
                "noise streams (bit-exact on CPU), so its releases are not charged twice"
            )
        else:
            evs = [Event.from_dict(e) for e in doc.get("planned", [])]
            for ev in evs:
                self.ledger.record(
                    Event(
                        ev.kind,
                        ev.noise_multiplier,
                        ev.sample_rate,
                        ev.count,
                        unit=ev.unit,
                        round=ev.round,
                        stage="interrupted",
                        note="round started before a stop; its noise may have been observed",
                    )
                )
            self.log(
                f"round {r + 1} was started before the run stopped and cannot be replayed "
                f"bit-exactly here; its {len(evs)} planned event(s) are charged before re-running it"
            )
        path.unlink(missing_ok=True)

    def make_transport(self):
        if self.cfg.transport == "inprocess":
            return InProcessTransport(self)
        # Transports above the engine (Flower) are looked up by name: they import the
        # engine, the engine does not import them (no cycle; see pyproject's contracts).
        return transport_class(self.cfg.transport)(self)

    def _summary_line(self, row: dict) -> str:
        parts = [f"round {row['round']}/{self.cfg.rounds}"]
        if "accuracy" in row:
            parts.append(
                f"acc={row['accuracy']:.4f} bal_acc={row['balanced_accuracy']:.4f} loss={row['loss']:.4f}"
            )
        if row.get("epsilon") is not None:
            parts.append(f"ε={row['epsilon']:.3f}")
        if "train_loss" in row:
            parts.append(f"train_loss={row['train_loss']:.4f}")
        parts.append(f"{row['seconds']:.1f}s")
        return " | ".join(parts)

    # ---- files ---------------------------------------------------------------------
    def _splits_doc(self) -> dict:
        ds, sp = self.dataset, self.split
        doc = {
            "members": [ds.ids[i] for i in sp.members],
            "nonmembers": [ds.ids[i] for i in sp.nonmembers],
            "test": [ds.ids[i] for i in sp.test],
            "clients": {
                c: [self.position_ids[i] for i in p] for c, p in self.client_positions.items()
            },
        }
        if self.client_ranks:
            doc["client_ranks"] = self.client_ranks
        if self._canaries:
            doc["canaries"] = [{k: v for k, v in c.items()} for c in self._canaries["canaries"]]
        return doc

    def _append_metrics(self, row: dict) -> None:
        self.metrics_rows.append(row)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(_jsonable(row)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _truncate_metrics(self, completed: int) -> None:
        path = self.out / "metrics.jsonl"
        rows = []
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a kill
                if isinstance(row, dict) and row.get("round", 1e9) <= completed:
                    rows.append(row)
        self.metrics_rows = rows
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

    def _save_checkpoint(self, completed: int) -> None:
        ck = self.out / "checkpoint"
        ck.mkdir(exist_ok=True)
        tensors, meta = self.method.state_dict()
        client_meta = {
            cid: _encode_nested(st, tensors, f"client/{cid}")
            for cid, st in self.client_states.items()
        }
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        st_path = ck / f"state-{completed:05d}.safetensors"
        tmp = st_path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        _fsync_file(tmp)
        os.replace(tmp, st_path)
        doc = {
            "version": 1,
            "completed_rounds": completed,
            "state_file": st_path.name,
            "state_sha256": file_sha256(st_path),
            "method_meta": meta,
            "client_meta": client_meta,
            "ledger": self.ledger.state_dict(),
            "sigma": self.sigma,
            "config": self.cfg.to_dict(),
        }
        atomic_write_json(ck / f"meta-{completed:05d}.json", doc)
        for old in ck.glob("*-*.*"):
            stem = old.name.split("-", 1)[1].split(".", 1)[0]
            if stem.isdigit() and int(stem) < completed:
                old.unlink(missing_ok=True)

    def _load_checkpoint(self) -> None:
        ck = self.out / "checkpoint"
        metas = sorted(ck.glob("meta-*.json"), reverse=True) if ck.is_dir() else []
        if not metas:
            self.start_round = 0
            self.log("checkpoint/ has no completed round: starting from round 1")
            return
        doc = read_json(metas[0])
        st_path = ck / str(doc.get("state_file", ""))
        if not st_path.is_file() or file_sha256(st_path) != doc.get("state_sha256"):
            raise UsageError(f"checkpoint {st_path} is missing or corrupt (checksum mismatch)")
        saved_cfg = doc.get("config", {})
        mine = self.cfg.to_dict()
        diffs = [k for k in mine if k not in ("progress", "device") and saved_cfg.get(k) != mine[k]]
        if diffs:
            raise UsageError(f"--resume with a different configuration (fields {diffs}); refusing")
        tensors = load_file(str(st_path))
        self.method.load_state_dict(
            {k: v for k, v in tensors.items() if not k.startswith("client/")}, doc["method_meta"]
        )
        self.client_states = {
            cid: _decode_nested(cm, tensors) for cid, cm in doc.get("client_meta", {}).items()
        }
        self.ledger = Ledger.from_state_dict(doc["ledger"])
        if abs(float(doc.get("sigma", self.sigma)) - self.sigma) > 1e-12:
            raise UsageError(
                "checkpoint's noise multiplier differs from the recalibrated one; refusing"
            )
        self.start_round = int(doc["completed_rounds"])
        self.log(
            f"resumed from checkpoint after round {self.start_round}; ε so far "
            f"{self.ledger.epsilon('pld') if self.cfg.dp_level != 'none' else 0:.4f}"
        )

    def _finish(self, wall: float) -> dict:
        cfg = self.cfg
        adapter = self.out / "adapter"
        tmp = self.out / "adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        F.set_state(self.trainer.model, self.method.released_state())
        self.trainer.model.save_pretrained(str(tmp))
        shutil.rmtree(adapter, ignore_errors=True)
        os.replace(tmp, adapter)
        atomic_write_json(self.out / "ledger.json", self.ledger.state_dict())
        final = next((r for r in reversed(self.metrics_rows) if "accuracy" in r), {})
        eps = (
            {"pld": self.ledger.epsilon("pld"), "rdp": self.ledger.epsilon("rdp")}
            if cfg.dp_level != "none"
            else {"pld": None, "rdp": None}
        )
        sizes = dict(self.public_sizes)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "tool": "fedlora-audit",
            "tool_version": _version(),
            "created": datetime.now(UTC).isoformat(),
            "config": cfg.to_dict(),
            "method": cfg.method,
            "method_options": _jsonable(vars(self.options)),
            "released": self.method.release_note,
            "privacy": {
                "level": cfg.dp_level,
                "mechanism": _mechanism_text(cfg),
                "noise_multiplier": self.sigma,
                "clipping_norm": cfg.clip if cfg.dp_level != "none" else None,
                "delta": self.delta,
                "target_epsilon": cfg.epsilon if cfg.epsilon > 0 else None,
                "sampling": "poisson",
                "sample_rates": {c: min(1.0, cfg.batch_size / n) for c, n in sizes.items()}
                if cfg.dp_level == "sample"
                else {},
                "client_sizes": sizes,
                "steps_per_round": {c: self.local_steps_for(n) for c, n in sizes.items()},
                "rounds": cfg.rounds,
                "rounds_completed": len(self.metrics_rows),
                "client_sampling": {
                    "scheme": cfg.client_sampling,
                    "clients_per_round": self.expected_clients_per_round(),
                    "total_clients": cfg.clients,
                },
                "participation_accounting": self.participation_note,
                "method_mechanism": self.method.privacy_note(),
                "public_log_note": "metrics.jsonl and run.log are the operator's logs (they name "
                "the sampled clients); the released artifact is the adapter",
                "neighbouring": NEIGHBOURING.get(cfg.dp_level),
                "noise": self.rand.describe(),
                "epsilon": eps,
                "ledger": self.ledger.state_dict(),
            },
            "data": {
                "dataset": cfg.dataset,
                "num_classes": self.dataset.num_classes,
                "label_names": self.dataset.label_names,
                "n_members": len(self.split.members),
                "n_nonmembers": len(self.split.nonmembers),
                "n_test": len(self.split.test),
                "splits_sha256": file_sha256(self.out / "splits.json"),
                "members_sha256": ids_hash([self.dataset.ids[i] for i in self.split.members]),
            },
            "client_ranks": self.client_ranks or None,
            "seeds": {"seed": cfg.seed},
            "versions": _versions(),
            "metrics": {
                "final": {
                    k: final.get(k) for k in ("accuracy", "balanced_accuracy", "loss") if k in final
                }
            },
            "adapter_sha256": file_sha256(adapter / "adapter_model.safetensors"),
            "wall_seconds": wall,
            "log": self._log_lines[-50:],
        }
        manifest["visibility"] = "operator"
        manifest["device"] = self.device.type
        atomic_write_json(self.out / "manifest.json", _jsonable(manifest))
        write_release(self.out, self.out / "release")
        self.log(
            f"done: accuracy={final.get('accuracy', float('nan')):.4f} "
            + (
                f"ε={eps['pld']:.3f} (PLD), {eps['rdp']:.3f} (RDP) at δ={self.delta:g} "
                if eps["pld"] is not None
                else ""
            )
            + f"in {wall:.0f}s → {self.out}"
        )
        return manifest


def _mechanism_text(cfg: TrainConfig) -> str:
    if cfg.dp_level == "sample":
        return (
            "DP-SGD on each client: Poisson sampling, per-example ℓ2 clipping to C over all "
            "trainable parameters (Opacus per-sample gradients), Gaussian noise σ·C per step"
        )
    if cfg.dp_level == "client":
        return "server-side: each client update clipped to C, Gaussian noise σ·C on the sum"
    return "none"


def _encode_nested(obj, tensors: dict, prefix: str):
    """JSON-able copy of ``obj`` with every tensor moved into ``tensors`` (by key)."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {
            "__dict__": [[k, _encode_nested(v, tensors, f"{prefix}/{k}")] for k, v in obj.items()]
        }
    if isinstance(obj, list | tuple):
        return [_encode_nested(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    return obj


def _decode_nested(obj, tensors: dict):
    if isinstance(obj, dict) and "__tensor__" in obj:
        key = obj["__tensor__"]
        if key not in tensors:
            raise UsageError(f"checkpoint is missing tensor {key!r}")
        return tensors[key]
    if isinstance(obj, dict) and "__dict__" in obj:
        return {k: _decode_nested(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_decode_nested(v, tensors) for v in obj]
    return obj


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating | float):
        f = float(obj)
        return f if math.isfinite(f) else (None if math.isnan(f) else ("inf" if f > 0 else "-inf"))
    return obj


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fedlora-audit")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0+unknown"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "opacus", "dp-accounting", "numpy", "flwr"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def train(
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    quiet: bool = False,
    noise_key: str | Path | R.NoiseKey | None = None,
) -> dict:
    """Run (or resume) a federated training run; returns the manifest. ``noise_key``: a
    key file (or key) to reuse instead of a fresh secret one (a replay)."""
    return Engine(cfg, out, resume=resume, quiet=quiet, noise_key=noise_key).run()


__all__ = [
    "Engine",
    "train",
    "derive_seed",
    "ClientContext",
    "ServerContext",
    "PrivacyError",
    "epsilon",
]
