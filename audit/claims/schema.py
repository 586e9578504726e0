"""A privacy claim as a record: :class:`Claim`, validated when it is built, and its files.

The fields and their meaning are listed in :mod:`audit.claims.check` (and docs/audit.md); a
claim file is JSON or TOML with those fields (:func:`load_claim`).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from fl.errors import UsageError

__all__ = ["Claim", "load_claim", "validate_claim", "LEVELS", "SAMPLINGS", "ACCOUNTINGS"]

LEVELS = ("sample", "client")
SAMPLINGS = ("poisson", "shuffle", "fixed_batch", "all")
ACCOUNTINGS = ("composed", "per_round", "per_epoch", "unknown")
NOISE_SOURCES = ("keyed_csprng", "csprng", "seeded", "unknown")
_FREE_TEXT = ("name", "source", "notes")
_REQUIRED = ("level", "noise_multiplier", "sampling", "rounds", "claimed_epsilon", "delta")
#: upper limits the accountants handle: σ beyond 1e6 gives ε ≈ 0 to any precision and
#: overflows the PLD's discretization; the PLD's memory grows with the composed count
#: (10^5 Poisson steps at σ = 0.3: about a minute; 10^6: over 5 GiB), so at most
#: 2·10^5 steps (rounds × steps_per_round) are recomputed.
MAX_NOISE_MULTIPLIER = 1e6
MAX_TOTAL_STEPS = 200_000
MAX_COUNT = MAX_TOTAL_STEPS


def _num(key: str, v, *, integer: bool = False, lo=None, lo_open=False, hi=None):
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise UsageError(f"claim field {key!r} must be a number, got {v!r}")
    if integer and not (isinstance(v, int) or float(v).is_integer()):
        raise UsageError(f"claim field {key!r} must be an integer, got {v!r}")
    if not math.isfinite(v):
        raise UsageError(f"claim field {key!r} must be finite, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise UsageError(f"claim field {key!r} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise UsageError(f"claim field {key!r} must be <= {hi}, got {v!r}")
    return int(v) if integer else float(v)


def _choice(key: str, v, allowed: tuple) -> str:
    if v not in allowed:
        raise UsageError(f"claim field {key!r} must be one of {allowed}, got {v!r}")
    return v


@dataclass(frozen=True)
class Claim:
    """A DP federated training mechanism and the (ε, δ) its author reports.

    Built with :meth:`from_dict` (a claim file's table) or directly; either way the
    fields are checked and normalized here (numbers typed, ``accounting`` and
    ``noise_source`` default to ``"unknown"``, ``steps_per_round`` to 1 at client level).

    Raises:
        UsageError: one line naming the offending field.
    """

    level: str
    noise_multiplier: float
    sampling: str
    rounds: int
    claimed_epsilon: float
    delta: float
    clipping_norm: float | None = None
    batch_size: int | None = None
    dataset_size: int | None = None
    sample_rate: float | None = None
    steps_per_round: int | None = None
    clients_per_round: int | None = None
    total_clients: int | None = None
    accounting: str = "unknown"
    noise_source: str = "unknown"
    name: str | None = None
    source: str | None = None
    notes: str | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # frozen: normalize in place
        _choice("level", self.level, LEVELS)
        _choice("sampling", self.sampling, SAMPLINGS)
        _choice("accounting", self.accounting, ACCOUNTINGS)
        _choice("noise_source", self.noise_source, NOISE_SOURCES)
        set_(
            "noise_multiplier",
            _num("noise_multiplier", self.noise_multiplier, lo=0.0, hi=MAX_NOISE_MULTIPLIER),
        )
        set_("claimed_epsilon", _num("claimed_epsilon", self.claimed_epsilon, lo=0.0, lo_open=True))
        set_("delta", _num("delta", self.delta, lo=0.0, lo_open=True))
        if self.delta >= 1.0:
            raise UsageError(f"claim field 'delta' must be < 1, got {self.delta!r}")
        set_("rounds", _num("rounds", self.rounds, integer=True, lo=1, hi=MAX_COUNT))
        if self.clipping_norm is not None:
            set_("clipping_norm", _num("clipping_norm", self.clipping_norm, lo=0.0, lo_open=True))
        for key in ("batch_size", "dataset_size", "clients_per_round", "total_clients"):
            if getattr(self, key) is not None:
                set_(key, _num(key, getattr(self, key), integer=True, lo=1))
        if self.sample_rate is not None:
            set_("sample_rate", _num("sample_rate", self.sample_rate, lo=0.0, lo_open=True, hi=1.0))
        if self.steps_per_round is not None:
            set_(
                "steps_per_round",
                _num("steps_per_round", self.steps_per_round, integer=True, lo=1, hi=MAX_COUNT),
            )
        elif self.level == "client":
            set_("steps_per_round", 1)  # one Gaussian release of the aggregate per round
        else:
            raise UsageError("claim is missing required field 'steps_per_round' (sample level)")
        if self.rounds * self.steps_per_round > MAX_TOTAL_STEPS:
            raise UsageError(
                f"claim fields 'rounds' × 'steps_per_round' = {self.rounds * self.steps_per_round}"
                f" exceed {MAX_TOTAL_STEPS} steps (more than the PLD accountant here handles)"
            )
        if (
            self.clients_per_round
            and self.total_clients
            and self.clients_per_round > self.total_clients
        ):
            raise UsageError(
                f"claim field 'clients_per_round' ({self.clients_per_round}) exceeds "
                f"'total_clients' ({self.total_clients})"
            )
        if self.level == "sample":
            self._check_sample_level()
        else:
            self._check_client_level()

    def _check_sample_level(self) -> None:
        if self.sampling == "all":
            return
        have_bd = self.batch_size is not None and self.dataset_size is not None
        if not have_bd and self.sample_rate is None:
            raise UsageError(
                "claim needs 'batch_size' and 'dataset_size' or 'sample_rate' for sampling "
                f"{self.sampling!r}"
            )
        if have_bd and self.batch_size > self.dataset_size:
            raise UsageError(
                f"claim field 'batch_size' ({self.batch_size}) exceeds 'dataset_size' "
                f"({self.dataset_size}, the records of one client)"
            )
        if have_bd and self.sample_rate is not None:
            q = self.batch_size / self.dataset_size
            if abs(q - self.sample_rate) > 1e-9 * max(q, 1e-300) + 1e-12:
                raise UsageError(
                    f"claim field 'sample_rate' ({self.sample_rate:g}) disagrees with "
                    f"batch_size/dataset_size = {q:g}"
                )

    def _check_client_level(self) -> None:
        for key in ("clients_per_round", "total_clients"):
            if getattr(self, key) is None:
                raise UsageError(f"claim is missing required field {key!r} (client level)")
        if self.sampling == "all" and self.clients_per_round < self.total_clients:
            raise UsageError(
                f"claim field 'clients_per_round' ({self.clients_per_round}) is below "
                f"'total_clients' ({self.total_clients}) but sampling is 'all'; describe "
                "how the cohort is drawn (poisson | shuffle | fixed_batch)"
            )

    @classmethod
    def from_dict(cls, doc) -> Claim:
        """A claim from a file's table; absent (or None) optional fields take their defaults."""
        if not isinstance(doc, dict):
            raise UsageError(f"a claim must be an object/table, got {type(doc).__name__}")
        doc = {k: v for k, v in doc.items() if v is not None}  # None = absent (idempotent)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise UsageError(f"unknown claim field(s) {unknown}; known fields: {known}")
        for key in _REQUIRED:
            if key not in doc:
                raise UsageError(f"claim is missing required field {key!r}")
        return cls(**doc)

    def to_dict(self) -> dict:
        """The normalized claim as a table (free text only when given; others None when
        absent); ``Claim.from_dict(c.to_dict()) == c``."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in _FREE_TEXT or getattr(self, f.name) is not None
        }

    # --- derived quantities the recomputation uses

    @property
    def record_rate(self) -> float:
        """q of one step at sample level: batch / records of ONE client (1 for ``all``)."""
        if self.sampling == "all":
            return 1.0
        if self.sample_rate is not None:
            return self.sample_rate
        return self.batch_size / self.dataset_size

    @property
    def fixed_cohort(self) -> bool:
        """Client level: a cohort of a fixed count m < K (not Poisson, not everyone)."""
        return self.sampling in ("shuffle", "fixed_batch") and (
            self.clients_per_round < self.total_clients
        )


def validate_claim(claim: dict | Claim) -> Claim:
    """Check a claim's schema; return it as a :class:`Claim` (defaults filled, numbers typed).

    Raises:
        UsageError: one line naming the offending field.
    """
    return claim if isinstance(claim, Claim) else Claim.from_dict(claim)


def load_claim(path) -> Claim:
    """Read and validate a claim file (``.json`` or ``.toml``; other suffixes: JSON, then TOML).

    Raises:
        UsageError: unreadable file, bad syntax, or a schema error naming the field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read claim file {p}: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    parsers = {".json": ("json",), ".toml": ("toml",)}.get(suffix, ("json", "toml"))
    errors = []
    for kind in parsers:
        try:
            doc = json.loads(text) if kind == "json" else tomllib.loads(text)
            break
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            errors.append(f"{kind}: {exc}")
    else:
        raise UsageError(f"cannot parse claim file {p} ({'; '.join(errors)})")
    return Claim.from_dict(doc)
