"""`fedlora train`: flags generated from :class:`fl.run.config.TrainConfig` (one source of
defaults). Precedence: field defaults < ``--config FILE.toml`` < flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from fl.errors import UsageError
from fl.run.config import (
    RUNTIME_FIELDS,
    TrainConfig,
    field_choices,
    field_type,
    load_toml,
)


def number(text: str) -> int | float:
    """A count or a fraction from the command line: ``"3"`` → 3, ``"0.5"`` → 0.5."""
    t = str(text).strip()
    if t.lstrip("-").isdigit():
        return int(t)
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def parse_opt_value(v: str):
    """--opt key=value: ints, floats, booleans, else string."""
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def add_config_flags(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainConfig):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        # Static choices go to argparse (checked while parsing, listed in --help); the
        # methods (callable choices: the registry, which imports every method) are
        # checked by TrainConfig.validate() and listed by --list-methods.
        choices = None if callable(f.metadata.get("choices")) else field_choices(f)
        shown = choices or f.metadata.get("examples")
        helptext = f.metadata.get("help", "")
        if shown:
            helptext += f" ({'choices:' if choices else 'e.g.'} {' | '.join(shown)})"
        helptext += f" (default: {default!r})"
        if isinstance(default, bool):
            p.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=helptext,
            )
        else:
            p.add_argument(
                flag,
                dest=f.name,
                # a float field with an integer default (clients_per_round) takes both
                type=number if field_type(f) is not type(default) else type(default),
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=helptext,
            )
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method option (repeatable), validated against the method's options",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with any of the fields above, or a run's config.json",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    data: dict = {}
    if getattr(args, "config", None):
        data.update(load_toml(args.config))
    for f in dataclasses.fields(TrainConfig):
        if hasattr(args, f.name) and f.name != "opts":
            data[f.name] = getattr(args, f.name)
    opts = dict(data.get("opts", {}))
    for item in getattr(args, "opt", []) or []:
        if "=" not in item:
            raise UsageError(f"--opt expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        opts[k.strip()] = parse_opt_value(v.strip())
    data["opts"] = opts
    # The "not set" values of --epsilon (0), --noise-multiplier (-1) and --delta (0) are
    # defaults, not values to give: given on the command line they are mistakes (ε = 0
    # would silently train without DP).
    for name, unset, what in (
        ("epsilon", 0, "a target ε > 0 (leave --epsilon out for no target)"),
        ("noise_multiplier", -1, "σ >= 0 (leave --noise-multiplier out to calibrate from ε)"),
        ("delta", 0, "δ in (0, 1) (leave --delta out for the default 1/(10·n))"),
    ):
        given = getattr(args, name, None)
        if given is not None and given == unset:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {given:g}: give {what}")
    cfg = TrainConfig.from_dict(data).validate()
    if cfg.method == "probe" and "lr" in data and cfg.head_lr > 0 and cfg.head_lr != cfg.lr:
        # the probe trains only the head, whose rate is head_lr (lr when head_lr is 0):
        # a given --lr would otherwise be silently unused
        raise UsageError(
            f"the probe trains only the head, at --head-lr {cfg.head_lr:g}; --lr {cfg.lr:g} "
            "would be unused: give the head's rate as --head-lr (or --head-lr 0 to use --lr)"
        )
    return cfg


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train one federated method (writes a run directory)",
        description="Train a federated LoRA method, with or without DP, and write a run directory.",
    )
    add_config_flags(p)
    p.add_argument(
        "--out", metavar="DIR", help="run directory to create (default: runs/<method>-<seed>)"
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a killed run from its last completed round"
    )
    p.add_argument(
        "--noise-key",
        metavar="FILE",
        help="reuse this secret noise key (a run's private/noise.key) instead of a fresh one: "
        "same config and key replay the run bit-exactly on CPU; a key made for another "
        "configuration is refused (see --allow-key-reuse)",
    )
    p.add_argument(
        "--allow-key-reuse",
        action="store_true",
        help="accept a --noise-key made for another configuration (or of unknown origin): "
        "its noise cancels against the first run's, so the run is recorded as NOT private "
        "and `fedlora export` refuses it",
    )
    p.add_argument("--list-methods", action="store_true", help="list the methods and their options")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from fl.io import read_json
    from fl.methods import registry
    from fl.run.engine import train

    if args.list_methods:
        for name in registry.names():
            cls = registry.get(name)
            opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Options))
            print(f"{name:10s} dp levels: {','.join(cls.dp_levels):18s} options: {opts or '-'}")
        return 0
    if args.resume:
        run_dir = Path(args.resume)
        if (run_dir / "config.json").exists():
            saved = read_json(run_dir / "config.json")
        elif (run_dir / "manifest.json").exists():
            saved = read_json(run_dir / "manifest.json").get("config")
        else:
            raise UsageError(f"--resume: {run_dir} is not a run directory (no config.json)")
        cfg = TrainConfig.from_dict(saved)
        # Only the fields that do not change results may differ from the saved run.
        for k in RUNTIME_FIELDS:
            if hasattr(args, k):
                setattr(cfg, k, getattr(args, k))
        cfg.validate()
        if getattr(args, "noise_key", None) or getattr(args, "allow_key_reuse", False):
            raise UsageError(
                "--resume reads the run's own private/noise.key; drop --noise-key and "
                "--allow-key-reuse"
            )
        manifest = train(cfg, run_dir, resume=True)
    else:
        cfg = config_from_args(args)
        out = args.out or f"runs/{cfg.method}-{cfg.dp_level}-seed{cfg.seed}"
        if getattr(args, "allow_key_reuse", False) and not getattr(args, "noise_key", None):
            raise UsageError("--allow-key-reuse needs --noise-key FILE")
        manifest = train(
            cfg,
            out,
            noise_key=getattr(args, "noise_key", None),
            allow_key_reuse=getattr(args, "allow_key_reuse", False),
        )
    final = manifest.get("metrics", {}).get("final", {})
    print(
        json.dumps(
            {
                "run_dir": str(Path(args.resume or out)),
                "accuracy": final.get("accuracy"),
                **({"perplexity": final["perplexity"]} if "perplexity" in final else {}),
                "epsilon": manifest["privacy"]["epsilon"],
            },
            default=str,
        )
    )
    return 0
