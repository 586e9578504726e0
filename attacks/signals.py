"""Per-example membership signals of a base model + LoRA adapter: loss, logits, p_y and φ.

For n examples (text, label y ∈ {0..C-1}) and the model's logits z ∈ R^{n×C}:

- ``loss``   (n,) cross-entropy in nats, ℓ = logsumexp(z) − z_y;
- ``logits`` (n, C);
- ``p_true`` (n,) true-class probability p_y = exp(−ℓ);
- ``phi``    (n,) logit-scaled confidence of LiRA (Carlini et al. 2022),
  φ = log p_y − log Σ_{y'≠y} p_{y'} = z_y − logsumexp_{y'≠y} z_{y'}
  (the softmax normaliser cancels, so φ is computed from logits without ever forming
  1 − p_y, which underflows to 0 for confident models).

Everything is computed in float64 from the model's float32 logits.

Adapters are loaded only from ``adapter_model.safetensors`` (never pickles). Their
shapes and target modules are checked against the base model first, so a mismatch is a
one-line :class:`fl.errors.UsageError` naming the module instead of a peft traceback.

Results are cached on disk (npz) under a key made of the sha256 of the adapter weights
file, the base model name, a hash of the data (texts and labels) and max_length.

A run directory's or a release bundle's examples and adapter are read by
:mod:`attacks.rundata` (``load_run``, ``load_bundle``, ``run_signals``).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fl.errors import UsageError
from fl.io import file_sha256
from fl.run import rundir

ADAPTER_WEIGHTS = rundir.ADAPTER_WEIGHTS
_PREFIX = "base_model.model."


@dataclass
class Signals:
    """Per-example signals; all arrays have n rows (one per example, input order)."""

    loss: np.ndarray  # (n,) float64, nats
    logits: np.ndarray  # (n, C) float64
    p_true: np.ndarray  # (n,) float64 in [0, 1]
    phi: np.ndarray  # (n,) float64
    labels: np.ndarray  # (n,) int64

    def subset(self, idx) -> Signals:
        idx = np.asarray(idx)
        return Signals(
            self.loss[idx], self.logits[idx], self.p_true[idx], self.phi[idx], self.labels[idx]
        )


def signals_from_logits(logits, labels) -> Signals:
    """Loss, p_y and φ from logits, in float64, stable for any logit magnitude.

    Args:
        logits: (n, C) with C >= 2.
        labels: (n,) ints in [0, C).
    """
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(f"logits must be (n, C) with C >= 2, got shape {z.shape}")
    if y.shape != (z.shape[0],):
        raise ValueError(f"labels must have shape ({z.shape[0]},), got {y.shape}")
    if len(y) and (y.min() < 0 or y.max() >= z.shape[1]):
        raise ValueError(f"labels must lie in [0, {z.shape[1]})")
    rows = np.arange(len(y))
    zy = z[rows, y]
    m = z.max(axis=1)
    lse_all = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    others = z.copy()
    others[rows, y] = -np.inf
    mo = others.max(axis=1)
    lse_other = mo + np.log(np.exp(others - mo[:, None]).sum(axis=1))
    loss = lse_all - zy
    return Signals(loss, z, np.exp(-loss), zy - lse_other, y)


# ---------------------------------------------------------------------------------
# Hashing and cache
# ---------------------------------------------------------------------------------
def data_sha256(texts: list[str], labels) -> str:
    """Hash of the examples (texts and labels, in order)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    h.update(np.asarray(labels, dtype=np.int64).tobytes())
    return h.hexdigest()


def cache_key(adapter_dir: str | Path, base_model: str, texts, labels, max_length: int) -> str:
    parts = [
        file_sha256(Path(adapter_dir) / ADAPTER_WEIGHTS),
        str(base_model),
        data_sha256(texts, labels),
        str(int(max_length)),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------
# Adapter loading
# ---------------------------------------------------------------------------------
def read_adapter_config(adapter_dir: str | Path) -> dict:
    d = Path(adapter_dir)
    cfg_path = d / "adapter_config.json"
    if not d.is_dir():
        raise UsageError(f"adapter folder not found: {d}")
    if not cfg_path.is_file():
        raise UsageError(f"{d} has no adapter_config.json (not a PEFT adapter folder)")
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise UsageError(
            f"{d} has no {ADAPTER_WEIGHTS}; only safetensors adapters are loaded (no pickles)"
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{cfg_path}: invalid JSON ({exc})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UsageError(f"{d}: peft_type {cfg.get('peft_type')!r} is not a LoRA adapter")
    return cfg


def adapter_shapes(adapter_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape, read from the safetensors header only."""
    from safetensors import safe_open

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        raise UsageError(f"{path}: not a readable safetensors file ({exc})") from None


def adapter_num_labels(adapter_dir: str | Path) -> int | None:
    """Number of classes of the adapter's saved classification head, if it has one."""
    for k, shp in adapter_shapes(adapter_dir).items():
        if k.endswith(("classifier.weight", "score.weight")) and len(shp) == 2:
            return int(shp[0])
    return None


def _in_out(mod) -> tuple[int, int] | None:
    if hasattr(mod, "in_features") and hasattr(mod, "out_features"):
        return int(mod.in_features), int(mod.out_features)
    if type(mod).__name__ == "Conv1D":  # GPT-2: weight (in, out)
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])
    return None


def check_adapter_fits(adapter_dir: str | Path, base: torch.nn.Module) -> None:
    """Check every tensor of the adapter against the base model; UsageError naming the
    first module that is missing or has the wrong shape."""
    modules = dict(base.named_modules())
    params = dict(base.named_parameters())
    for key, shp in adapter_shapes(adapter_dir).items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        for which in ("lora_A", "lora_B"):
            tag = f".{which}."
            if tag in name:
                mod_name = name.split(tag)[0]
                mod = modules.get(mod_name)
                io = _in_out(mod) if mod is not None else None
                if io is None:
                    raise UsageError(
                        f"adapter targets module {mod_name!r}, which the base model does not "
                        "have as a linear layer"
                    )
                fan_in, fan_out = io
                ok = len(shp) == 2 and (
                    shp[1] == fan_in if which == "lora_A" else shp[0] == fan_out
                )
                if not ok:
                    raise UsageError(
                        f"adapter tensor {which} of module {mod_name!r} has shape {list(shp)}, "
                        f"which does not fit the base layer (in={fan_in}, out={fan_out})"
                    )
                break
        else:
            # modules_to_save (the classification head): same shape as the base parameter.
            pname = name.replace(".modules_to_save.default", "")
            p = params.get(pname)
            if p is None:
                raise UsageError(f"adapter tensor {key!r} has no counterpart in the base model")
            if tuple(p.shape) != tuple(shp):
                raise UsageError(
                    f"adapter module {pname.rsplit('.', 1)[0]!r} has shape {list(shp)}, the base "
                    f"model's has {list(p.shape)} (different number of labels?)"
                )


def adapter_pooling(adapter_dir: str | Path) -> str:
    """The pooling the head of ``adapter_dir`` reads: recorded in the manifest beside it
    (a run directory or a release bundle, :func:`fl.models.base.recorded_pooling`), else
    ``cls``, Hugging Face's own sequence-classification head (a foreign adapter)."""
    from fl.models.base import recorded_pooling

    man = Path(adapter_dir).parent / "manifest.json"
    try:
        doc = json.loads(man.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "cls"
    return recorded_pooling(doc) if isinstance(doc, dict) else "cls"


def peft_from_pretrained(base: torch.nn.Module, adapter_dir: str | Path):
    """``peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)`` without
    the transformers FutureWarning "`is_gradient_checkpointing` is deprecated" that peft
    0.21's ``PeftModel.__init__`` raises by reading that attribute of every base model
    (``getattr(model, "is_gradient_checkpointing", True)``): only that warning, only here."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)


def load_adapter_model(
    adapter_dir: str | Path,
    base_model: str,
    num_labels: int,
    seed: int = 0,
    device="cpu",
    pooling: str | None = None,
):
    """Base model (``fl.models.base.load_base_model``) + the PEFT LoRA adapter, in eval mode.

    ``seed`` must be the seed the base was created with for random-init models
    (tiny-bert, tiny-gpt2); it is irrelevant for pretrained ones. ``pooling``: what the
    head reads (None: :func:`adapter_pooling`)."""
    from fl.models.base import load_base_model

    read_adapter_config(adapter_dir)
    if pooling is None:
        pooling = adapter_pooling(adapter_dir)
    base = load_base_model(base_model, num_labels, seed=seed, pooling=pooling)
    check_adapter_fits(adapter_dir, base)
    try:
        model = peft_from_pretrained(base, adapter_dir)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise UsageError(f"cannot load adapter {adapter_dir}: {str(exc).splitlines()[0]}") from None
    model.to(device)
    model.eval()
    return model


# ---------------------------------------------------------------------------------
# Computing signals
# ---------------------------------------------------------------------------------
@torch.no_grad()
def model_logits(
    model, tokenizer, texts, max_length: int, device, batch_size: int = 128, progress=False
) -> np.ndarray:
    """(n, C) float32 logits in the order of ``texts``, batched shortest first: each
    batch holds texts of similar length and is padded only to its longest (a text's
    logits do not depend on its batch, up to float rounding)."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, 2), np.float32)
    cached = _prefix_logits(model, tokenizer, texts, max_length, device, batch_size)
    if cached is not None:
        return cached
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    order = np.argsort([len(x) for x in ids], kind="stable")
    out = []
    starts = range(0, len(texts), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="signals", unit="batch", leave=False)
    for s in starts:
        enc = tokenizer(
            [texts[i] for i in order[s : s + batch_size]],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        out.append(model(**enc).logits.float().cpu().numpy())
    logits = np.concatenate(out)
    result = np.empty_like(logits)
    result[order] = logits
    return result


@torch.no_grad()
def _prefix_logits(model, tokenizer, texts, max_length, device, batch_size):
    """Logits over the frozen-prefix cache, or None when ``model`` has no frozen prefix
    (not a BERT-family classifier of ``fl.models.heads``, or LoRA in its lowest layer).

    When the adapter's LoRA sits in the top layers only, the layers below are the base
    model's own, whatever the adapter: their hidden states are computed once per process
    for the same base and texts (``fl.models.heads.FrozenPrefix.encode_cached``) and every
    adapter scored on those texts (the target, each shadow) runs only its top layers:
    the same logits up to float rounding (``tests/fl/test_heads.py``)."""
    from fl.data.tokenized import TokenizedData
    from fl.models.heads import BertClassifier, FrozenPrefix

    get_base = getattr(model, "get_base_model", None)
    net = get_base() if callable(get_base) else None
    if not isinstance(net, BertClassifier):
        return None
    prefix = FrozenPrefix(model, net, frozen_encoder=False, use_cache=True)
    if not prefix.enabled:
        return None
    data = TokenizedData(texts, np.zeros(len(texts), dtype=np.int64), tokenizer, max_length)
    prefix.check(data)
    order = torch.argsort(data.lengths, stable=True)
    out = []
    for s in range(0, len(texts), batch_size):
        batch = data.batch(order[s : s + batch_size], device)
        batch.pop("labels")
        out.append(model(**batch).logits.float().cpu().numpy())
    logits = np.concatenate(out)
    result = np.empty_like(logits)
    result[order.numpy()] = logits
    return result


def adapter_signals(
    adapter_dir: str | Path,
    base_model: str,
    texts: list[str],
    labels,
    max_length: int,
    device="auto",
    seed: int = 0,
    num_labels: int | None = None,
    batch_size: int = 128,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Signals:
    """Signals of ``base_model`` + the adapter in ``adapter_dir`` on (texts, labels).

    Args:
        adapter_dir: PEFT LoRA adapter folder (adapter_config.json + safetensors).
        base_model: a fl.models.base name (minilm, tiny-bert, tiny-gpt2) or a local HF folder.
        texts, labels: n examples; labels (n,) ints.
        max_length: truncation length in tokens (use the training one).
        seed: seed of the random-init base model (tiny models); see load_adapter_model.
        num_labels: classes of the head (default: from the adapter's head, else labels).
        cache_dir: where to keep ``signals-<key>.npz`` (None = no cache).
    """
    from fl.models.base import encoding_tokenizer, resolve_device

    labels = np.asarray(labels, dtype=np.int64)
    if len(texts) != len(labels):
        raise UsageError(f"{len(texts)} texts but {len(labels)} labels")
    read_adapter_config(adapter_dir)
    cache_path = None
    if cache_dir is not None:
        key = cache_key(adapter_dir, f"{base_model}|seed={seed}", texts, labels, max_length)
        cache_path = Path(cache_dir) / f"signals-{key}.npz"
        if cache_path.is_file():
            with np.load(cache_path, allow_pickle=False) as z:
                return signals_from_logits(z["logits"], z["labels"])
    if num_labels is None:
        num_labels = adapter_num_labels(adapter_dir) or int(labels.max()) + 1
    if len(labels) and labels.max() >= num_labels:
        raise UsageError(f"labels go up to {labels.max()} but the model has {num_labels} classes")
    dev = resolve_device(device) if isinstance(device, str) else device
    model = load_adapter_model(adapter_dir, base_model, num_labels, seed=seed, device=dev)
    tok = encoding_tokenizer(base_model)
    logits = model_logits(model, tok, texts, max_length, dev, batch_size, progress)
    sig = signals_from_logits(logits, labels)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(f".{cache_path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, logits=logits, labels=labels)
        os.replace(tmp, cache_path)
    return sig
