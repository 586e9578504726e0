"""`fedlora attack`: membership inference on a run directory, a release bundle or a
foreign PEFT adapter.

fedlora attack RUN_DIR [--attacks loss,calibration,shadow,lira,rmia] [--shadows 8]
               [--json] [--out DIR] [--device auto] [--seed 0]
fedlora attack BUNDLE --members FILE --nonmembers FILE [--shadow-config TOML] [...]
fedlora attack --adapter PATH --model NAME_OR_PATH --members FILE --nonmembers FILE
               [--max-length 64] [--base-seed 0] [--batch-size 128] [--text-column text]
               [--label-column label] [--shadow-config TOML] [...]

A release bundle (``RUN/release``, ``fedlora export``) has no member list (that is in the
operator's ``splits.json``): the candidates come from --members / --nonmembers, and the
base model, max_length and seed from the bundle's public manifest; shadows (reference
attacks) are trained with the bundle's configuration.

The attack settings' flags are generated from :class:`attacks.config.AttackConfig`, the
foreign adapter's from :class:`attacks.target_spec.TargetSpec` (one source of defaults and help).
"""

from __future__ import annotations

import argparse
import json
import sys

from attacks.config import AttackConfig, add_flags, from_args
from attacks.target_spec import TargetSpec

#: ``fedlora attack --help``'s closing text: what the candidate files hold
FILE_FORMATS = """\
candidate files (--members, --nonmembers; for --adapter or a release bundle):
  CSV (header row) or JSONL (one JSON object per line); both files the same format.
  classification adapter (task_type SEQ_CLS, or none):
    a text and a label column (--text-column, default text; --label-column, default
    label); labels are integers >= 0 or class names (sorted), pooled over both files,
    which together need at least 2 distinct labels. Example JSONL line:
      {"text": "great day today", "label": 1}
  causal-LM adapter (task_type CAUSAL_LM):
    plain text: a text column (--text-column), scored on every token; or instruction
    data: prompt and response columns, scored on the response and end of sequence.
      {"text": "a sentence the model may have seen"}
      {"prompt": "Summarise: ...", "response": "..."}
  --max-length may not exceed the base model's positions (512 for minilm, 256 for
  tiny-bert / tiny-gpt2, the config's max_position_embeddings / n_positions for a local
  folder): a longer value is refused with the limit (exit 2).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "attack",
        help="membership-inference attacks (loss, calibration, shadow, LiRA, RMIA, LM "
        "signals; --client-level)",
        description=(
            "Membership inference on a run directory's released adapter, or on any PEFT "
            "LoRA adapter (--adapter/--model/--members/--nonmembers). Writes attacks.json, "
            "scores.npz and roc.png/svg to --out (default RUN_DIR/attacks or ADAPTER/attacks)."
        ),
        epilog=FILE_FORMATS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run_dir",
        nargs="?",
        metavar="RUN_OR_BUNDLE",
        help=TargetSpec.__dataclass_fields__["run_dir"].metadata["help"],
    )
    add_flags(p, AttackConfig)
    p.add_argument("--json", action="store_true", help="print only the JSON document")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory (default: RUN_DIR/attacks, BUNDLE/attacks, ADAPTER/attacks)",
    )
    add_flags(p.add_argument_group("foreign adapter"), TargetSpec)
    p.set_defaults(func=_main)


def _print_table(doc: dict) -> None:
    print(f"{'attack':<16}{'AUC':>8}  {'95% CI':<15}{'TPR@1%':>8}{'TPR@0.1%':>10}{'sec':>8}")
    for name, r in doc["attacks"].items():
        ci = r.get("ci", {}).get("auc")
        cis = f"[{ci[0]:.3f},{ci[1]:.3f}]" if ci else ""
        t = r["tpr_at_fpr"]
        print(
            f"{name:<16}{r['auc']:>8.3f}  {cis:<15}{t['0.01']:>8.3f}{t['0.001']:>10.3f}"
            f"{r['seconds']:>8.2f}"
        )
    cl = doc.get("client_level")
    if cl:
        print(
            f"client level: {cl['n_participating']} participating, "
            f"{cl['n_nonparticipating']} non-participating clients (score: mean over the client)"
        )
        for name, r in cl["attacks"].items():
            ci = (r.get("ci") or {}).get("auc")
            cis = f"[{ci[0]:.3f},{ci[1]:.3f}]" if ci else ""
            print(f"{'  ' + name:<16}{r['auc']:>8.3f}  {cis:<15}{r['tpr_at_fpr']['0.01']:>8.3f}")
    sh = doc.get("shadows")
    if sh:
        print(f"shadow models: {sh['k']}, mean {sh['mean_train_seconds']:.1f} s to train each")


def _main(args: argparse.Namespace) -> int:
    from attacks.run import attack

    cfg = from_args(AttackConfig, args, progress=not args.json and sys.stderr.isatty())
    target = from_args(TargetSpec, args).resolve()
    doc = attack(target, cfg, out=args.out)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    return 0
