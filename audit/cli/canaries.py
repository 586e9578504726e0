"""`fedlora canaries new`: a canary set for a training the toolkit does not run
(:mod:`audit.canaries.outside`; the training-side hooks: :mod:`audit.canaries.hooks`; the audit:
``fedlora audit --canaries DIR --observations FILE --claim CLAIM``).

    fedlora canaries new --kind gradient --count M --params params.json --clip C --out DIR
    fedlora canaries new --kind input --count M --num-classes K [--source FILE] --out DIR
    fedlora canaries new --kind client --count M --dim D --clip C
                         [--participation poisson --rate Q] --out DIR

Bad input is one line on stderr, exit 2, and nothing is written. Building the parser
imports nothing heavy; the handler imports what it runs.
"""

from __future__ import annotations

import argparse
import math

from fl.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser(
        "canaries",
        help="make a canary set to audit a training done elsewhere (Opacus, PyTorch, Flower)",
        description="Canary sets for trainings the toolkit does not run: the public canaries "
        "(DIR/canaries.json) and the secret inclusion bits (DIR/private/, operator only). "
        "Add them with the hooks of audit.canaries.hooks, then `fedlora audit --canaries DIR "
        "--observations FILE --claim CLAIM`. docs/audit.md: 'Auditing a training done "
        "elsewhere'.",
    )
    ps = p.add_subparsers(
        dest="canaries_command", metavar="ACTION", parser_class=type(p), required=True
    )
    n = ps.add_parser(
        "new",
        help="write a new canary set",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a new canary set into --out (absent or empty). Exit 0: written; "
        "2: bad input (nothing written).",
        epilog=(
            "gradient: --params FILE (audit.canaries.hooks.write_params(model, FILE): trainable "
            "parameter names, shapes, groups), --clip C; canaries own coordinates stratified "
            "over lora_A / lora_B / other.\n"
            "input: --num-classes K; random texts (--words N), or --source FILE (JSONL of "
            "{text, label}) for mislabelled records.\n"
            "client: --dim D (flattened update the server clips) or --params FILE, --clip C, "
            "--participation every_round | poisson --rate Q."
        ),
    )
    n.add_argument("--kind", required=True, choices=("gradient", "input", "client"))
    n.add_argument("--count", required=True, type=int, metavar="M", help="number of canaries")
    n.add_argument("--out", required=True, metavar="DIR", help="folder to create (absent or empty)")
    n.add_argument(
        "--key",
        metavar="FILE",
        help="an existing secret key (64 hex digits) to draw the set from; default: a fresh "
        "key written to DIR/private/noise.key (0600)",
    )
    n.add_argument("--params", metavar="FILE", help="gradient/client: trainable parameters (JSON)")
    n.add_argument("--clip", type=float, metavar="C", help="gradient/client: clipping norm C")
    n.add_argument("--num-classes", type=int, metavar="K", help="input: number of classes")
    n.add_argument("--words", type=int, default=12, help="input: words per random text (12)")
    n.add_argument("--source", metavar="FILE", help="input: JSONL {text, label} to mislabel")
    n.add_argument("--dim", type=int, metavar="D", help="client: coordinates of the update")
    n.add_argument(
        "--participation",
        choices=("every_round", "poisson"),
        default="every_round",
        help="client: canaries take part every round, or each round with probability --rate",
    )
    n.add_argument("--rate", type=float, metavar="Q", help="client: Poisson participation rate")
    n.set_defaults(func=cmd_new)


def _check(args) -> None:
    """Range checks that need no import (one line naming the flag)."""
    if args.count < 1:
        raise UsageError(f"--count must be >= 1, got {args.count}")
    if args.clip is not None and not (math.isfinite(args.clip) and args.clip > 0):
        raise UsageError(f"--clip must be finite and > 0, got {args.clip}")
    if args.rate is not None and not (math.isfinite(args.rate) and 0 < args.rate <= 1):
        raise UsageError(f"--rate must be in (0, 1], got {args.rate}")
    if args.dim is not None and args.dim < 1:
        raise UsageError(f"--dim must be >= 1, got {args.dim}")
    if args.num_classes is not None and args.num_classes < 2:
        raise UsageError(f"--num-classes must be >= 2, got {args.num_classes}")
    own = {
        "gradient": ("params", "clip"),
        "input": ("num_classes", "words", "source"),
        "client": ("params", "clip", "dim", "participation", "rate"),
    }[args.kind]
    defaults = {"words": 12, "participation": "every_round"}
    for k in ("params", "clip", "num_classes", "words", "source", "dim", "participation", "rate"):
        if k not in own and getattr(args, k) != defaults.get(k):
            raise UsageError(f"--{k.replace('_', '-')} does not apply to --kind {args.kind}")


def cmd_new(args) -> int:
    _check(args)
    from audit.canaries.canary_set import new_canary_set

    out = new_canary_set(
        args.kind,
        args.count,
        args.out,
        key_file=args.key,
        params=args.params,
        clip=args.clip,
        num_classes=args.num_classes,
        words=args.words,
        source=args.source,
        dim=args.dim,
        participation=args.participation,
        rate=args.rate,
    )
    print(f"canary set: {out}/canaries.json (public)")
    print(f"inclusion bits: {out}/private/ (operator only; the training hooks read it)")
    return 0
