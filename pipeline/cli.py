"""`fedlora`: one command line for training, analysis, attacks, audits, reports, benchmarks.

Each package registers its own sub-commands (``register(subparsers)``); this module, at
the top of the layers (it may import every package it fronts), only assembles them and
turns user errors into one line on stderr with exit code 2. Every command module is
imported by name here: a missing one is an ImportError, never a silently absent
command. Building the parser imports neither torch nor matplotlib (``fedlora --help``
stays fast): the command modules import what they run inside their handlers.
"""

from __future__ import annotations

import argparse
import os
import sys

from analysis import cli as analysis_cli
from attacks import cli as attacks_cli
from audit.cli import audit as audit_cli
from audit.cli import canaries as canaries_cli
from audit.cli import script as script_cli
from benchmarks import cli as benchmarks_cli
from fl.cli import export as cli_export
from fl.cli import pretrain as cli_base
from fl.cli import train as cli_train
from fl.errors import StoppedAtRound, UsageError
from pipeline import job

#: the modules that register sub-commands, in the order `fedlora --help` lists them
COMMAND_MODULES = (
    cli_train,
    cli_export,
    cli_base,
    analysis_cli,
    attacks_cli,
    audit_cli,
    canaries_cli,
    script_cli,
    job,
    benchmarks_cli,
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
    for mod in COMMAND_MODULES:
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from fl.allocator import tune_malloc

    tune_malloc()  # tensors' memory reused, not mapped anew each step (fl/allocator.py)
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
