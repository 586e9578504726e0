"""`fedlora --help` is fast: building the parser imports neither torch nor matplotlib, and
every command module is imported by name (a missing one is an error, not a skip)."""

import subprocess
import sys

import pytest

from pipeline.cli import COMMAND_MODULES, build_parser

HEAVY = ("torch", "matplotlib", "transformers", "peft", "opacus", "scipy", "flwr", "ray")


@pytest.mark.parametrize("argv", [[], ["train"], ["attack"], ["audit"], ["report"],
                                  ["analyze"], ["run"], ["bench"], ["export"], ["base"], ["canaries"], ["canaries", "new"]])  # fmt: skip
def test_help_imports_nothing_heavy(argv):
    code = (
        "import sys\n"
        "from pipeline.cli import build_parser\n"
        "p = build_parser()\n"
        f"try:\n    p.parse_args({argv!r} + ['--help'])\n"
        "except SystemExit:\n    pass\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_every_command_is_registered():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = set(sub.choices)
    assert {
        "train",
        "export",
        "base",
        "analyze",
        "attack",
        "audit",
        "report",
        "run",
        "bench",
        "canaries",
    } <= names
    assert len(COMMAND_MODULES) == 10 and all(hasattr(m, "register") for m in COMMAND_MODULES)
