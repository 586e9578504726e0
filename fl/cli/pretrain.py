"""`fedlora base pretrain`: train a small GPT-2-style base offline (:mod:`fl.models.pretrain`);
flags generated from :class:`fl.models.pretrain.PretrainConfig`."""

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
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


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
