"""`fedlora`: one command line for training, analysis, attacks, audits, reports, benchmarks.

Each package registers its own sub-commands (``register(subparsers)``); this module only
assembles them and turns user errors into one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fl.errors import StoppedAtRound, UsageError

# (module, sub-commands it registers). Each module has register(subparsers).
_COMMAND_MODULES = (
    "fl.cli_train",
    "fl.cli_export",
    "fl.cli_base",
    "analysis.cli",
    "attacks.cli",
    "audit.cli",
    "pipeline.job",
    "benchmarks.cli",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too; keep it short)
        sys.stderr.write(f"fedlora: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fedlora",
        description="Train, measure, attack and audit differentially private federated LoRA.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only a module that does not exist yet is skipped; a broken import raises.
            if exc.name != name:
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except UsageError as exc:
        sys.stderr.write(f"fedlora: error: {exc}\n")
        return 2
    except StoppedAtRound as exc:
        sys.stderr.write(f"fedlora: {exc}\n")
        return 3
    except KeyboardInterrupt:
        sys.stderr.write("fedlora: interrupted\n")
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
