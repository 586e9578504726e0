"""`fedlora base pretrain`: train a small GPT-2-style base offline (:mod:`fl.models.pretrain`);
flags generated from :class:`fl.models.pretrain.PretrainConfig`. `fedlora base random`: a
random-init Llama or Qwen2 folder (:mod:`fl.models.decoders`)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from fl.errors import UsageError
from fl.models.pretrain_config import CORPORA, PretrainConfig

_HELP = {
    "corpus": "public corpus to pretrain on (disjoint from the tweets member sets)",
    "vocab_size": "byte-level BPE vocabulary size",
    "n_embd": "model width",
    "n_layer": "transformer layers",
    "n_head": "attention heads",
    "seq_len": "context length (also the longest --max-length a fine-tuning run may use)",
    "batch_size": "blocks per step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW; linear warm-up, cosine decay to 10%%)",
    "warmup": "share of the steps spent warming up",
    "weight_decay": "AdamW weight decay (matrices only)",
    "test_frac": "share of the documents held out for the test perplexity",
    "max_docs": "use only this many documents (0 = all; for quick tests)",
    "seed": "seed of the split, tokenizer corpus order, initialization and batches",
    "log_every": "print progress every N steps",
}


def register(sub) -> None:
    p = sub.add_parser(
        "base",
        help="offline base models for causal-LM runs (fedlora base pretrain)",
        description="Offline base models for --task causal-lm.",
    )
    bsub = p.add_subparsers(dest="base_command", metavar="SUBCOMMAND", parser_class=type(p))
    q = bsub.add_parser(
        "pretrain",
        help="train a small GPT-2-style causal LM on a public corpus (a Hugging Face folder)",
        description="Train a small GPT-2-style base (own byte-level BPE tokenizer) on a public "
        "corpus and write a Hugging Face folder for `fedlora train --model DIR --task causal-lm`. "
        "Membership results on a random-init base are meaningless; use a pretrained one.",
    )
    for f in dataclasses.fields(PretrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kw: dict = {"dest": f.name, "type": type(f.default), "default": f.default}
        if f.name == "corpus":
            kw["choices"] = CORPORA
        q.add_argument(flag, help=f"{_HELP.get(f.name, '')} (default: {f.default!r})", **kw)
    q.add_argument("--out", required=True, metavar="DIR", help="folder to write (new or empty)")
    q.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    q.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    q.set_defaults(func=cmd_pretrain)
    r = bsub.add_parser(
        "random",
        help="write a random-init Llama or Qwen2 folder (GQA, tied embeddings, byte-level BPE)",
        description="Write a random-init Llama or Qwen2 causal LM built from a configuration "
        "(grouped-query attention, RoPE, RMSNorm, tied embeddings) with a byte-level BPE "
        "tokenizer trained on the synthetic texts, saved with safetensors: a stand-in for a "
        "user's checkpoint, to test code paths and measure time and memory "
        "(fl.models.decoders). Membership results on it are meaningless.",
    )
    r.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="architecture")
    for name, default, what in _SHAPE_FLAGS:
        r.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=int,
            default=default,
            help=f"{what} (default: {default})",
        )
    r.add_argument("--vocab-size", type=int, default=512, help="BPE tokenizer size (default: 512)")
    r.add_argument(
        "--model-vocab",
        type=int,
        default=0,
        help="embedding rows (0: the tokenizer's size; e.g. 32000 as in Llama-2)",
    )
    r.add_argument("--seed", type=int, default=0, help="initialization seed (default: 0)")
    r.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    r.set_defaults(func=cmd_random)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


#: ``fedlora base random``'s shape flags: (DecoderShape field, default, help)
_SHAPE_FLAGS = (
    ("hidden", 64, "model width"),
    ("layers", 2, "decoder layers"),
    ("heads", 4, "query heads"),
    ("kv_heads", 2, "key/value heads (fewer than --heads: grouped-query attention)"),
    ("intermediate", 128, "MLP width"),
    ("context", 256, "context length (max_position_embeddings)"),
)


def cmd_random(args: argparse.Namespace) -> int:
    from fl.models.decoders import DecoderShape, write_decoder_folder

    for name, _, _ in _SHAPE_FLAGS:
        if not 1 <= getattr(args, name) <= 1 << 20:
            raise UsageError(f"--{name.replace('_', '-')} must be in [1, {1 << 20}]")
    # byte-level BPE: the 256 bytes and <|endoftext|> come first
    if not 257 <= args.vocab_size <= 1 << 20:
        raise UsageError(f"--vocab-size must be in [257, {1 << 20}], got {args.vocab_size}")
    if not 0 <= args.model_vocab <= 1 << 22:
        raise UsageError(f"--model-vocab must be in [0, {1 << 22}], got {args.model_vocab}")
    shape = DecoderShape(**{name: getattr(args, name) for name, _, _ in _SHAPE_FLAGS})
    info = write_decoder_folder(
        args.out,
        args.arch,
        shape,
        vocab_size=args.vocab_size,
        seed=args.seed,
        model_vocab=args.model_vocab or None,
    )
    print(json.dumps({k: info[k] for k in ("path", "kind", "parameters", "vocab_size")}))
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    if not 0 <= args.threads <= 4096:
        raise UsageError(f"--threads must be in [0, 4096], got {args.threads}")
    cfg = PretrainConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)}
    ).validate()  # before torch is imported and anything is written

    import torch

    from fl.models.pretrain import pretrain

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    info = pretrain(cfg, args.out, progress=not args.no_progress)
    keys = ("parameters", "test_perplexity", "seconds_total", "threads")
    print(json.dumps({"out": args.out, **{k: info[k] for k in keys}}))
    return 0
