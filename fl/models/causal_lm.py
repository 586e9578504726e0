"""Causal language models: base model, LoRA targets, the sequence loss, evaluation and
per-token log-probabilities (``--task causal-lm``; docs/causal_lm.md).

The loss. With targets y_{i,t} (the tokens of :class:`fl.data.lm.LmTokenizedData` whose
label is not -100) and the model's next-token distribution p_θ, example i's loss is the
mean NLL over its T_i target tokens,

    ℓ_i(θ) = (1/T_i) Σ_t −log p_θ(y_{i,t} | y_{i,<t}),

and a batch's loss is Σ_i ℓ_i (the trainer divides by the expected batch size, or the
DP privatizer by the batch size after clipping). Per-example DP-SGD therefore clips the
gradient of ℓ_i — one example, all its tokens — never a single token's gradient; the mean
(not the sum) keeps a long text from weighing more than a short one before clipping.

Evaluation is token-weighted: loss = Σ_i Σ_t NLL / Σ_i T_i over the test set, and
perplexity = exp(loss); ``accuracy`` is the next-token top-1 accuracy over the same
tokens.

Models: ``tiny-gpt2`` (random init, hidden 64, 2 layers, the MiniLM tokenizer, for tests)
or any local Hugging Face causal-LM folder (GPT-2, Llama, Qwen, Mistral, ...; e.g. one
written by ``fedlora base pretrain``). LoRA targets default per architecture
(:data:`fl.models.base.LM_TARGETS`). The frozen-prefix cache (:mod:`fl.models.heads`) is BERT-only
and stays off for causal LMs; there is no head (the LM head is frozen, usually tied to the embeddings),
so a released adapter holds LoRA factors only.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from fl.errors import UsageError
from fl.models.base import MODELS, model_folder, tokenizer_size


def tiny_gpt2_lm(vocab_size: int):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=2, n_positions=256)


def load_causal_lm(model: str, seed: int = 0) -> torch.nn.Module:
    """A causal LM (no LoRA), in train mode, fp32: ``tiny-gpt2`` (seeded random init)
    or a local Hugging Face folder (``AutoModelForCausalLM``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if model in ("minilm", "tiny-bert"):
        raise UsageError(
            f"model {model!r} is an encoder (BERT); --task causal-lm needs a causal LM"
        )
    torch.manual_seed(seed)
    path = model_folder(model)
    if path is None:
        net = GPT2LMHeadModel(tiny_gpt2_lm(tokenizer_size("minilm", added=False)))
    else:
        try:
            config = AutoConfig.from_pretrained(path)
            net = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(f"cannot load a causal LM from {path}: {msg}") from None
    net.config.fedlora_task = "causal-lm"
    net.config.use_cache = False
    net.train()
    return net


def check_setup(cfg, method_cls) -> list[str]:
    """Errors for what ``--task causal-lm`` cannot do (called when a run is set up);
    returns warnings for the run's log."""
    if cfg.task != "causal-lm":
        return []
    if not getattr(method_cls, "trains_factors", True):
        raise UsageError(
            f"method {cfg.method!r} trains only a classification head, which a causal LM does "
            "not have (--task causal-lm trains LoRA factors); choose a LoRA method"
        )
    if cfg.canaries > 0 and cfg.canary_kind == "mislabel":
        raise UsageError(
            "--canary-kind mislabel changes a class label, which a causal-LM run does not "
            "have; use --canary-kind random_text"
        )
    if cfg.model in MODELS and cfg.model != "tiny-gpt2":
        raise UsageError(
            f"model {cfg.model!r} is not a causal LM; use tiny-gpt2 or a local causal-LM folder"
        )
    warnings: list[str] = []
    path = model_folder(cfg.model)
    if path is not None:
        from transformers import AutoConfig

        try:
            mc = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"cannot load a model config from {path}: {exc}") from None
        rows = getattr(mc, "vocab_size", None)
        n_tok = tokenizer_size(cfg.model)
        if rows is not None and n_tok > int(rows):
            raise UsageError(
                f"the tokenizer of {path} has {n_tok} tokens but the model's vocabulary {rows}"
            )
        ctx = getattr(mc, "n_positions", None) or getattr(mc, "max_position_embeddings", None)
        if ctx is not None and cfg.max_length > int(ctx):
            raise UsageError(
                f"--max-length {cfg.max_length} exceeds the model's context of {ctx} tokens"
            )
        from fl.models.pretrain import base_corpus

        corpus = base_corpus(path)
        if corpus is not None and cfg.dataset == corpus:
            warnings.append(
                f"warning: the base {path} was pretrained on {corpus!r}, the dataset of this run: "
                "members and non-members may be pretraining text, so membership results on this "
                "run are not meaningful (fine-tune on tweets or a local file instead)"
            )
    return warnings


# ---- loss -------------------------------------------------------------------------
def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll, mask), both b × (L−1): −log p(labels[:, t+1] | logits[:, t]) in float32
    where the target is not -100 (0 elsewhere), and the target mask."""
    logits = logits[:, :-1].float()
    tgt = labels[:, 1:]
    mask = tgt != -100
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="none"
    ).view(tgt.shape)
    return nll, mask


def sequence_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ_i ℓ_i with ℓ_i the mean NLL of example i's target tokens (module doc)."""
    nll, mask = token_nll(logits, labels)
    return (nll.sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum()


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module):
    """The base model (the LoRA adapter disabled) inside the block; a no-op for a model
    without an adapter."""
    off = getattr(model, "disable_adapter", None)
    if off is None:
        yield model
        return
    with off():
        yield model


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 autocast: every CPU torch build; CUDA devices that
    compute in bf16 (compute capability 8.0 and later: A100, H100, H200, ...)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return device.type == "cpu"


def check_precision(device: torch.device, precision: str) -> None:
    """A UsageError when ``precision`` is bf16 and ``device`` cannot run it."""
    if precision == "bf16" and not bf16_supported(device):
        raise UsageError(
            f"--precision bf16 asked for, but {torch.device(device)} does not support bf16 "
            "autocast (CUDA needs compute capability 8.0 or later); use --precision fp32"
        )


def autocast(device: torch.device, precision: str):
    """bf16 autocast for ``precision == "bf16"``, else a no-op context."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _scored_batches(model, data, batch_size: int, device, precision: str, adapter: bool = True):
    """Yield (example indices, logits, labels, nll, mask) over ``data`` in batches of
    similar length (shortest first), without gradients, in eval mode (restored after),
    with the adapter disabled when ``adapter`` is False."""
    device = torch.device(device)
    was = model.training
    model.eval()
    order = torch.argsort(data.lengths, stable=True)
    ctx = contextlib.nullcontext() if adapter else adapter_off(model)
    try:
        with ctx, torch.no_grad():
            for s in range(0, len(data), batch_size):
                idx = order[s : s + batch_size]
                batch = data.batch(idx, device)
                labels = batch.pop("labels")
                with autocast(device, precision):
                    logits = model(**batch).logits
                nll, mask = token_nll(logits, labels)
                yield idx, logits, labels, nll, mask
    finally:
        model.train(was)


def token_logprobs(
    model: torch.nn.Module,
    data,
    batch_size: int = 64,
    device="cpu",
    precision: str = "fp32",
    adapter: bool = True,
) -> list[np.ndarray]:
    """log p(target token | its prefix) of every target token of every example of
    ``data`` (an :class:`fl.data.lm.LmTokenizedData`), in data order, as float64 arrays
    (example i's array has ``data.targets[i]`` entries). ``adapter=False`` scores with
    the base model (the adapter disabled). The model is put in eval mode and back."""
    out: list[np.ndarray | None] = [None] * len(data)
    for idx, _, _, nll, mask in _scored_batches(
        model, data, batch_size, device, precision, adapter
    ):
        for j, i in enumerate(idx.tolist()):
            out[i] = (-nll[j][mask[j]]).double().cpu().numpy()
    return out  # type: ignore[return-value]


def evaluate(
    model: torch.nn.Module, data, batch_size: int, device, precision: str = "fp32"
) -> dict:
    """Token-weighted test loss, perplexity = exp(loss), next-token top-1 accuracy and
    the number of target tokens of ``data`` (module doc)."""
    nll_sum, correct, tokens = 0.0, 0, 0
    for _, logits, labels, nll, mask in _scored_batches(model, data, batch_size, device, precision):
        nll_sum += float(nll[mask].double().sum())
        pred = logits[:, :-1].argmax(-1)
        correct += int((pred == labels[:, 1:])[mask].sum())
        tokens += int(mask.sum())
    loss = nll_sum / max(tokens, 1)
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "accuracy": correct / max(tokens, 1),
        "tokens": tokens,
    }


def lora_spec(cfg):
    """The :class:`fl.models.base.LoraSpec` of a config."""
    from fl.models.base import LoraSpec

    targets = tuple(t for t in cfg.target_modules.split(",") if t) or None
    return LoraSpec(cfg.rank, cfg.alpha, cfg.lora_dropout, targets, cfg.lora_layers)
