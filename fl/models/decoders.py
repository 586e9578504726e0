"""Llama- and Qwen2-architecture model folders built from a configuration, offline.

No decoder weights can be fetched here, so a Llama or Qwen2 checkpoint is stood in for by
a random-init model of the same architecture — grouped-query attention
(``num_key_value_heads < num_attention_heads``), RoPE, RMSNorm, SwiGLU MLP, an LM head
tied to the token embeddings — with a byte-level BPE tokenizer trained on a few texts
(:func:`fl.models.pretrain.train_tokenizer`; ``<|endoftext|>`` is bos = eos = pad), saved
with safetensors as an ordinary Hugging Face folder. ``fedlora train --model DIR`` loads it
exactly as it loads a user's checkpoint (``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification``), so the tests and the scale benchmark exercise the
user's path. Membership results on such a random base are meaningless
(docs/causal_lm.md); it exists to test code paths and to measure time and memory.

:func:`decoder_shape` gives a one-parameter family of shapes (depth and width grow
together, as in the Llama/Qwen2 releases) used by ``benchmarks.perf.scale``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fl.errors import UsageError

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class DecoderShape:
    """The size of a decoder: width ``hidden``, ``layers`` blocks, ``heads`` query heads
    sharing ``kv_heads`` key/value heads (GQA when kv_heads < heads), MLP width
    ``intermediate``, context ``context`` tokens."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    context: int = 256

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise UsageError(
                f"hidden {self.hidden} must divide into {self.heads} heads, and the heads "
                f"into {self.kv_heads} key/value groups"
            )


def decoder_shape(hidden: int, head_dim: int = 64, kv_ratio: int = 4, context: int = 512):
    """A Llama-style shape of width ``hidden``: heads of ``head_dim`` (or fewer when the
    width is small), ``kv_ratio`` query heads per key/value head, an MLP of ≈ 8/3·hidden
    rounded up to 32, and depth ≈ hidden / 64 (at least 2), the ratio of the small
    Llama/Qwen2 releases (e.g. Qwen2-0.5B: width 896, 24 layers)."""
    head_dim = min(head_dim, hidden // 2)
    heads = max(2, hidden // head_dim)
    kv = max(1, heads // kv_ratio)
    while heads % kv:
        kv -= 1
    inter = -(-int(8 * hidden / 3) // 32) * 32
    return DecoderShape(
        hidden=hidden,
        layers=max(2, hidden // 64),
        heads=heads,
        kv_heads=kv,
        intermediate=inter,
        context=context,
    )


def decoder_config(kind: str, shape: DecoderShape, vocab_size: int, pad_id: int = 0):
    """The transformers configuration of a ``kind`` (``llama`` | ``qwen2``) decoder."""
    from transformers import LlamaConfig, Qwen2Config

    if kind not in ARCHITECTURES:
        raise UsageError(f"unknown architecture {kind!r}; choose one of {ARCHITECTURES}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=pad_id,
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
    )
    return LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)


def default_texts(n: int = 400) -> list[str]:
    """Texts to train the tokenizer on: the synthetic data set's (offline, instant)."""
    from fl.data.datasets import make_synthetic

    return make_synthetic(n).texts


def write_decoder_folder(
    out: str | Path,
    kind: str = "llama",
    shape: DecoderShape | None = None,
    vocab_size: int = 512,
    texts: list[str] | None = None,
    seed: int = 0,
    tokenizer=None,
    model_vocab: int | None = None,
) -> dict:
    """Write a random-init ``kind`` causal LM of ``shape`` with a byte-level BPE tokenizer
    of ≤ ``vocab_size`` tokens (trained on ``texts``, or the given ``tokenizer``) to
    ``out`` (``config.json``, ``model.safetensors``, tokenizer files). ``model_vocab``:
    rows of the embedding (default: the tokenizer's size; more, e.g. Llama-2's 32,000,
    gives a real model's embedding size, the extra rows unused). Returns
    ``{"path", "kind", "parameters", "vocab_size", "shape"}``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from fl.models.pretrain import EOT, train_tokenizer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    shape = shape or DecoderShape()
    tok = tokenizer or train_tokenizer(texts or default_texts(), vocab_size)
    rows = max(len(tok), model_vocab or 0)
    config = decoder_config(kind, shape, rows, pad_id=tok.convert_tokens_to_ids(EOT))
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return {
        "path": str(out),
        "kind": kind,
        "parameters": sum(p.numel() for p in net.parameters()),
        "vocab_size": rows,
        "shape": asdict(shape),
    }
