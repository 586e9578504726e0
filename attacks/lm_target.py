"""A causal-LM adapter's membership signals on texts: the model scored with the adapter on,
with it off (the base model, the reference of a LoRA), and on the lowercased texts.

Sequences are framed exactly as training frames them (:class:`fl.data.lm.LmTokenizedData`:
``[bos] prompt text [eos]``, scored on the text and eos; plain text is scored on every token
after bos). The per-token statistics (:class:`attacks.lm_signals.TokenStats`) are cached on
disk (npz) under a key of the adapter weights' sha256, the base model and seed, the texts
and prompts, max_length and which pass (adapter on / off, lowercased), so a new k of
min-k% costs nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from attacks.lm_signals import LMSignals, TokenStats, token_stats
from attacks.signals import cache_key, peft_from_pretrained, read_adapter_config
from fl.errors import UsageError


def is_causal_adapter(adapter_dir) -> bool:
    """Whether a PEFT adapter folder is a causal-LM adapter (its task_type)."""
    return read_adapter_config(adapter_dir).get("task_type") == "CAUSAL_LM"


@torch.no_grad()
def lm_token_stats(model, data, batch_size: int, device, adapter: bool = True) -> TokenStats:
    """Token stats of ``model`` on ``data`` (an :class:`fl.data.lm.LmTokenizedData`), in
    data order; ``adapter=False`` scores the base model (the adapter disabled)."""
    import contextlib

    from fl.models.causal_lm import adapter_off

    parts = []
    ctx = contextlib.nullcontext() if adapter else adapter_off(model)
    with ctx:
        for s in range(0, len(data), batch_size):
            idx = torch.arange(s, min(s + batch_size, len(data)))
            b = data.batch(idx, device)
            labels = b.pop("labels").cpu()
            logits = model(**b).logits[:, :-1].float().cpu()
            tgt = labels[:, 1:]
            parts.append(token_stats(logits, tgt.clamp_min(0).numpy(), (tgt != -100).numpy()))
    return TokenStats.concat(parts)


def _key(adapter_dir, base: str, texts, prompts, max_length: int, kind: str) -> str:
    h = hashlib.sha256()
    for t in [*texts, "\x00prompts", *(prompts or [])]:
        b = str(t).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    data = [h.hexdigest()]
    return cache_key(adapter_dir, f"{base}|lm|{kind}", data, np.zeros(1), max_length)


def _cached(path: Path | None, compute) -> TokenStats:
    if path is not None and path.is_file():
        with np.load(path, allow_pickle=False) as z:
            return TokenStats(z["logp"], z["mu"], z["sigma"], z["mask"])
    st = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, logp=st.logp, mu=st.mu, sigma=st.sigma, mask=st.mask)
        os.replace(tmp, path)
    return st


def lm_adapter_signals(
    adapter_dir,
    base_model: str,
    texts: list[str],
    prompts: list[str] | None,
    max_length: int,
    device="auto",
    seed: int = 0,
    k: float = 0.2,
    batch_size: int = 64,
    cache_dir=None,
    extras: bool = True,
) -> LMSignals:
    """:class:`LMSignals` of ``base_model`` + the causal-LM adapter on the texts.

    Args:
        adapter_dir: PEFT LoRA adapter folder (task_type CAUSAL_LM, safetensors).
        base_model: ``tiny-gpt2`` or a local causal-LM folder; seed: a random-init base's.
        texts, prompts: the scored texts (responses) and their prompts (None: plain text).
        k: the fraction of min-k% and min-k%++.
        extras: also the base model's loss (adapter off) and the loss on lowercased texts
            (the target needs them; the shadows do not).
    """
    from fl.data.lm import LmTokenizedData
    from fl.models.base import load_tokenizer, resolve_device
    from fl.models.causal_lm import load_causal_lm

    read_adapter_config(adapter_dir)
    if prompts is not None and len(prompts) != len(texts):
        raise UsageError(f"{len(prompts)} prompts for {len(texts)} texts")
    dev = resolve_device(device) if isinstance(device, str) else device
    base = f"{base_model}|seed={seed}"
    model = tok = None

    def loaded():
        nonlocal model, tok
        if model is None:
            net = load_causal_lm(base_model, seed=seed)
            try:
                model = peft_from_pretrained(net, adapter_dir)
            except (OSError, ValueError, RuntimeError, KeyError) as exc:
                msg = str(exc).splitlines()[0]
                raise UsageError(f"cannot load adapter {adapter_dir}: {msg}") from None
            model.to(dev).eval()
            tok = load_tokenizer(base_model)
        return model, tok

    def stats(kind: str, tx, px, adapter: bool) -> TokenStats:
        path = None
        if cache_dir is not None:
            key = _key(adapter_dir, base, tx, px, max_length, kind)
            path = Path(cache_dir) / f"lmstats-{key}.npz"

        def compute():
            m, t = loaded()
            data = LmTokenizedData(list(tx), t, max_length, prompts=px)
            return lm_token_stats(m, data, batch_size, dev, adapter=adapter)

        return _cached(path, compute)

    on = stats("on", texts, prompts, True)
    if not extras:
        return LMSignals.from_stats(on, texts, k)
    lower_px = None if prompts is None else [p.lower() for p in prompts]
    lower = stats("lower", [t.lower() for t in texts], lower_px, True)
    off = stats("off", texts, prompts, False)
    return LMSignals.from_stats(on, texts, k, lower=lower, base=off)
