"""Attack settings: one frozen dataclass, validated, each field with its help text.

``fedlora attack`` generates its setting flags from these fields (:func:`add_flags`, as
``fedlora train`` does from :class:`fl.run.config.TrainConfig`), and ``attacks.run``'s
functions take their defaults from them: there is no second source of defaults or of
valid choices. Field metadata: ``help``; ``choices`` (the valid values, passed to
argparse); ``subset_of`` (a comma-separated subset of these values); ``runtime`` (does
not change the scores); ``cli`` False (no flag).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields

from fl.errors import UsageError

#: what ``--attacks`` selects, in the order results are computed and reported
FAMILIES: tuple[str, ...] = ("loss", "calibration", "shadow", "lira", "rmia", "lm")
#: Carlini et al. recommend a global variance below ~64 shadows; per-example fits need
#: several IN and OUT values per example, so ``global_variance="auto"`` switches at 16
#: (8 IN / 8 OUT).
GLOBAL_VARIANCE_BELOW = 16
#: upper limits of the count flags: far beyond any useful value, low enough that a typo
#: (an extra digit or two) is a one-line error instead of hours of work or an overflow
MAX_SHADOWS = 4096
MAX_WORKERS = 4096
MAX_BOOTSTRAP = 100_000
#: seeds are 32-bit (numpy, torch and the training pipeline all accept them)
MAX_SEED = 2**32 - 1


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def parse_attacks(spec) -> tuple[str, ...]:
    """``"lira,loss"`` or ``("lira", "loss")`` → ``("lira", "loss")`` (duplicates dropped);
    UsageError naming the unknown ones."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [s for s in names if s]
    bad = [s for s in names if s not in FAMILIES]
    if bad or not names:
        raise UsageError(f"unknown attack(s) {bad or names}; choose from {','.join(FAMILIES)}")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class AttackConfig:
    """How to attack a target (what is attacked is :class:`attacks.target.Target`)."""

    attacks: tuple[str, ...] | None = _f(
        None,
        f"comma-separated subset of {','.join(FAMILIES)} "
        "(default: all for a run directory, loss for a bundle or --adapter)",
        subset_of=FAMILIES,
    )
    shadows: int = _f(
        8,
        f"shadow / reference models (>= 2 for calibration/shadow/RMIA, >= 4 for LiRA; at most "
        f"{MAX_SHADOWS}; unused by loss and lm)",
    )
    device: str = _f("auto", "auto | cpu | cuda", runtime=True)
    workers: int = _f(
        0, "shadow models trained at once (0: one per usable CPU; 1: here, in order)", runtime=True
    )
    ray_address: str = _f(
        os.environ.get("FEDLORA_RAY_ADDRESS", "local"),
        "where shadows train as Ray tasks: local (Ray on this machine), a cluster address "
        "(ray://HOST:10001, HOST:6379, auto) or none (in this process); default: "
        "$FEDLORA_RAY_ADDRESS, else local",
        runtime=True,
    )
    seed: int = _f(0, "seed of shadow splits and bootstrap")
    rmia_a: float = _f(0.3, "RMIA offline parameter a")
    global_variance: str = _f(
        "auto",
        f"LiRA: one variance for all examples (auto: yes below {GLOBAL_VARIANCE_BELOW} shadows)",
        choices=("auto", "yes", "no"),
    )
    bootstrap: int = _f(200, "bootstrap resamples for CIs")
    min_k: float = _f(0.2, "causal LM: the fraction k of lowest-probability tokens of min-k%% (++)")
    client_level: bool = _f(
        False, "also client-level membership inference (run directory; clients.json)"
    )
    client_fpr: float = _f(0.05, "client level: the FPR the calibrated threshold aims at")
    rmia_gamma: float = _f(1.0, "RMIA threshold γ >= 1 on the pairwise likelihood ratio", cli=False)
    progress: bool = _f(True, "show progress bars", runtime=True, cli=False)

    def __post_init__(self):
        # frozen: normalise the spelling once, here (a string or any iterable of names);
        # an empty string means the target's default, as `--attacks ""` always has
        attacks = None if self.attacks in (None, "") else parse_attacks(self.attacks)
        object.__setattr__(self, "attacks", attacks)
        for f in fields(self):
            allowed = f.metadata.get("choices")
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise UsageError(f"unknown {f.name} {value!r}; choose one of {list(allowed)}")
        if not 0 <= self.shadows <= MAX_SHADOWS:
            raise UsageError(f"--shadows must be in [0, {MAX_SHADOWS}], got {self.shadows}")
        if not 0 <= self.workers <= MAX_WORKERS:
            raise UsageError(
                f"--workers must be in [0, {MAX_WORKERS}] (0: one per CPU), got {self.workers}"
            )
        if not 0 <= self.bootstrap <= MAX_BOOTSTRAP:
            raise UsageError(f"--bootstrap must be in [0, {MAX_BOOTSTRAP}], got {self.bootstrap}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed must be in [0, 2**32 - 1], got {self.seed}")
        if not 0.0 <= self.rmia_a <= 1.0:
            raise UsageError(
                f"--rmia-a (RMIA offline parameter a) must be in [0, 1], got {self.rmia_a}"
            )
        if not 0.0 < self.min_k <= 1.0:
            raise UsageError(f"--min-k must be a fraction in (0, 1], got {self.min_k}")
        if not 0.0 <= self.client_fpr < 1.0:
            raise UsageError(f"--client-fpr must be in [0, 1), got {self.client_fpr}")
        if not (self.rmia_gamma >= 1.0 and math.isfinite(self.rmia_gamma)):
            raise UsageError(f"RMIA threshold gamma must be >= 1, got {self.rmia_gamma}")

    @classmethod
    def with_variance(cls, global_variance: bool | None, **kw) -> AttackConfig:
        """The config with ``global_variance`` given as the Python API spells it
        (None = auto, True = yes, False = no)."""
        gv = {None: "auto", True: "yes", False: "no"}[global_variance]
        return cls(global_variance=gv, **kw)

    def lira_global_variance(self) -> bool:
        """One σ_in / σ_out for all examples? ``auto``: yes below
        :data:`GLOBAL_VARIANCE_BELOW` shadows."""
        if self.global_variance == "auto":
            return self.shadows < GLOBAL_VARIANCE_BELOW
        return self.global_variance == "yes"


def help_with_default(f) -> str:
    """A field's help text ending in ``(default: X)``, unless it says its default itself
    (a help that mentions "default") or the default is None / False (absent, off)."""
    text = f.metadata["help"]
    if "default" in text or f.default is None or f.default is False:
        return text
    d = f.default
    d = ",".join(d) if isinstance(d, tuple) else d
    return f"{text} (default: {str(d).replace('%', '%%')})"


def add_flags(parser, cls) -> None:
    """One ``--name-with-dashes`` flag per field of the dataclass ``cls`` (except metadata
    ``cli`` False), with the field's help (ending in its default) and ``choices``. Flags
    not given are absent from the namespace (argparse.SUPPRESS), so the dataclass's
    defaults apply (:func:`from_args`)."""
    for f in fields(cls):
        if f.metadata.get("cli") is False:
            continue
        if isinstance(f.default, bool):  # a switch: --name sets True
            flag = "--" + f.name.replace("_", "-")
            parser.add_argument(
                flag, dest=f.name, action="store_true", default=argparse.SUPPRESS,
                help=f.metadata["help"],
            )  # fmt: skip
            continue
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=str if f.default is None else type(f.default),
            choices=f.metadata.get("choices"),
            default=argparse.SUPPRESS,
            help=help_with_default(f),
            **({"metavar": f.metadata["metavar"]} if "metavar" in f.metadata else {}),
        )


def from_args(cls, args: argparse.Namespace, **extra):
    """An instance of ``cls`` from the flags :func:`add_flags` made (given ones only) and
    ``extra`` (fields without a flag)."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**given, **extra)
