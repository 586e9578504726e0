"""`fedlora attack`: membership inference on a run directory, a release bundle or a
foreign PEFT adapter.

fedlora attack RUN_DIR [--attacks loss,calibration,shadow,lira,rmia] [--shadows 8]
               [--json] [--out DIR] [--device auto] [--seed 0]
fedlora attack BUNDLE --members FILE --nonmembers FILE [--shadow-config TOML] [...]
fedlora attack --adapter PATH --model NAME_OR_PATH --members FILE --nonmembers FILE
               [--max-length 64] [--base-seed 0] [--shadow-config TOML] [...]

A release bundle (``RUN/release``, ``fedlora export``) has no member list (that is in the
operator's ``splits.json``): the candidates come from --members / --nonmembers, and the
base model, max_length and seed from the bundle's public manifest; shadows (reference
attacks) are trained with the bundle's configuration.
"""

from __future__ import annotations

import argparse
import json
import sys

from fl.errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "attack",
        help="membership-inference attacks (loss, calibration, shadow, LiRA, RMIA)",
        description=(
            "Membership inference on a run directory's released adapter, or on any PEFT "
            "LoRA adapter (--adapter/--model/--members/--nonmembers). Writes attacks.json, "
            "scores.npz and roc.png/svg to --out (default RUN_DIR/attacks or ADAPTER/attacks)."
        ),
    )
    p.add_argument(
        "run_dir",
        nargs="?",
        metavar="RUN_OR_BUNDLE",
        help="a finished fedlora run directory, or a release bundle (with --members and "
        "--nonmembers)",
    )
    p.add_argument(
        "--attacks",
        default=None,
        help="comma-separated subset of loss,calibration,shadow,lira,rmia "
        "(default: all for a run directory, loss for a bundle or --adapter)",
    )
    p.add_argument("--shadows", type=int, default=8, help="shadow / reference models (>= 2)")
    p.add_argument("--json", action="store_true", help="print only the JSON document")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default: RUN_DIR/attacks, BUNDLE/attacks, ADAPTER/attacks)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of shadow splits and bootstrap")
    p.add_argument("--rmia-a", type=float, default=0.3, help="RMIA offline parameter a")
    p.add_argument(
        "--global-variance",
        choices=("auto", "yes", "no"),
        default="auto",
        help="LiRA: one variance for all examples (auto: yes below 16 shadows)",
    )
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for CIs")
    g = p.add_argument_group("foreign adapter")
    g.add_argument("--adapter", help="PEFT LoRA adapter folder (adapter_model.safetensors)")
    g.add_argument("--model", help="base model: minilm | tiny-bert | tiny-gpt2 | local folder")
    g.add_argument(
        "--members", help="CSV/JSONL of member examples (text, label); also for a bundle"
    )
    g.add_argument(
        "--nonmembers", help="CSV/JSONL of non-member examples (text, label); also for a bundle"
    )
    g.add_argument("--max-length", type=int, default=64, help="tokens per example")
    g.add_argument("--base-seed", type=int, default=0, help="seed of a random-init base model")
    g.add_argument(
        "--shadow-config",
        help="TOML of TrainConfig fields for the reference pipeline (default: a bundle's "
        "configuration; for --adapter 1 client, non-private, TrainConfig defaults, the "
        "adapter's rank/alpha/targets)",
    )
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
    sh = doc.get("shadows")
    if sh:
        print(f"shadow models: {sh['k']}, mean {sh['mean_train_seconds']:.1f} s to train each")


def _attack_bundle(args: argparse.Namespace, common: dict) -> dict:
    """Attacks on a release bundle's adapter, with candidates from --members/--nonmembers."""
    from pathlib import Path

    from attacks.run import run_attacks_adapter
    from attacks.signals import load_bundle
    from fl.io import atomic_write_json

    b = load_bundle(args.run_dir)
    cfg = b.config
    shadow_cfg = {k: v for k, v in cfg.items() if k not in ("device", "progress")}
    if args.shadow_config:
        from fl.config import load_toml

        shadow_cfg.update(load_toml(args.shadow_config))
    out = Path(common.pop("out") or b.bundle_dir / "attacks")
    doc = run_attacks_adapter(
        b.adapter_dir,
        cfg["model"],
        args.members,
        args.nonmembers,
        attacks=args.attacks or "loss",
        max_length=int(cfg.get("max_length", 64)),
        base_seed=int(cfg.get("seed", 0)),
        shadow_config=shadow_cfg,
        out=out,
        **common,
    )
    doc["target"].update(
        bundle=str(b.bundle_dir),
        method=cfg.get("method"),
        dataset=cfg.get("dataset"),
        dp_level=cfg.get("dp_level"),
        members_from=str(args.members),
        nonmembers_from=str(args.nonmembers),
    )
    atomic_write_json(out / "attacks.json", doc)
    return doc


def _main(args: argparse.Namespace) -> int:
    from attacks.run import run_attacks, run_attacks_adapter
    from fl.release import is_release

    gv = {"auto": None, "yes": True, "no": False}[args.global_variance]
    foreign = [args.adapter, args.model, args.members, args.nonmembers]
    bundle = bool(args.run_dir) and is_release(args.run_dir)
    if bundle:
        if args.adapter or args.model:
            raise UsageError(
                f"{args.run_dir} is a release bundle: it brings its adapter and base model; "
                "give only --members FILE and --nonmembers FILE"
            )
        if not (args.members and args.nonmembers):
            raise UsageError(
                f"{args.run_dir} is a release bundle: it carries no member list (that lives in "
                "the operator's splits.json); give --members FILE and --nonmembers FILE with "
                "the candidate examples"
            )
    elif args.run_dir and any(foreign):
        raise UsageError("give either RUN_DIR or --adapter/--model/--members/--nonmembers")
    common = dict(
        shadows=args.shadows,
        out=args.out,
        device=args.device,
        seed=args.seed,
        global_variance=gv,
        rmia_a=args.rmia_a,
        progress=not args.json and sys.stderr.isatty(),
        n_bootstrap=args.bootstrap,
    )
    if bundle:
        doc = _attack_bundle(args, common)
    elif args.run_dir:
        doc = run_attacks(
            args.run_dir, attacks=args.attacks or "loss,calibration,shadow,lira,rmia", **common
        )
    else:
        if not all(foreign):
            raise UsageError(
                "give RUN_DIR, or all of --adapter, --model, --members and --nonmembers"
            )
        shadow_cfg = None
        if args.shadow_config:
            from fl.config import load_toml

            shadow_cfg = load_toml(args.shadow_config)
        doc = run_attacks_adapter(
            args.adapter,
            args.model,
            args.members,
            args.nonmembers,
            attacks=args.attacks or "loss",
            max_length=args.max_length,
            base_seed=args.base_seed,
            shadow_config=shadow_cfg,
            **common,
        )
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    return 0
