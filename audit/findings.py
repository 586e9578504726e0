"""What an audit finds: one :class:`Finding` per problem, its :class:`Code` from one list.

Each code carries its severity (``error`` | ``warning`` | ``info``) and whether it means
tampering (the run's files contradict each other or the replay; exit code 1 in the CLI
like every error, and ``tampered`` in a run audit's result). A finding may be weaker
than its code (a ``warning`` where the evidence is only suggestive, e.g. a claim that
does not say where its noise comes from), never stronger.

Findings are written into the audit documents (``fedlora audit --json``, the report) as
``{"code", "severity", "message"}`` (:meth:`Finding.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Severity", "Code", "Finding", "Findings", "TAMPER_CODES"]


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return ("info", "warning", "error").index(self.value)


_E, _W, _I = Severity.ERROR, Severity.WARNING, Severity.INFO


class Code(StrEnum):
    """A finding's code; the value is the string written into the documents."""

    severity: Severity
    tampering: bool
    meaning: str

    def __new__(cls, value: str, severity: Severity, tampering: bool, meaning: str):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.severity, obj.tampering, obj.meaning = severity, tampering, meaning
        return obj

    # --- accounting mistakes (claims and runs)
    NO_COMPOSITION_ACROSS_ROUNDS = (
        "no_composition_across_rounds", _E, False,
        "each round accounted afresh instead of composed",
    )  # fmt: skip
    PARTIAL_COMPOSITION = (
        "partial_composition", _E, False, "only one epoch of steps accounted",
    )  # fmt: skip
    WRONG_SAMPLE_RATE = (
        "wrong_sample_rate", _E, False, "sampling rate computed over the whole federation",
    )  # fmt: skip
    AMPLIFICATION_WITHOUT_RANDOM_SAMPLING = (
        "amplification_without_random_sampling", _E, False,
        "Poisson amplification claimed for non-Poisson batches",
    )  # fmt: skip
    CLIENT_SAMPLING_IGNORED = (
        "client_sampling_ignored", _E, False,
        "amplification by client sampling that the mechanism does not give",
    )  # fmt: skip
    REPLACEMENT_SENSITIVITY_IGNORED = (
        "replacement_sensitivity_ignored", _E, False,
        "fixed-size batches/cohorts accounted with sensitivity C under add/remove",
    )  # fmt: skip
    UNEXPLAINED_UNDERSTATEMENT = (
        "unexplained_understatement", _E, False,
        "claimed ε below the recomputed one, no known mistake matches",
    )  # fmt: skip
    NOISE_REPRODUCIBLE = (
        "noise_reproducible", _E, False,
        "noise from a seeded (or unstated) generator: can be regenerated",
    )  # fmt: skip
    DELTA_TOO_LARGE = ("delta_too_large", _E, False, "δ >= 1/n")
    CLIPPING_NORM_MISSING = ("clipping_norm_missing", _I, False, "clipping norm not stated")
    # --- a run's stated ε against its recomputation
    EPSILON_UNDERSTATED = (
        "epsilon_understated", _E, False, "the stated ε is below the recomputed one",
    )  # fmt: skip
    EPSILON_MISSING = ("epsilon_missing", _E, False, "a DP run states no ε")
    LEDGER_BELOW_CONFIG = (
        "ledger_below_config", _W, False, "the configuration implies more ε than the ledger",
    )  # fmt: skip
    LEDGER_EXTRA_EVENTS = (
        "ledger_extra_events", _I, False, "the ledger records more DP steps than implied",
    )  # fmt: skip
    METRICS_MISSING = (
        "metrics_missing", _W, False, "no metrics.jsonl: every client assumed every round",
    )  # fmt: skip
    RELEASES_FROM_LEDGER = (
        "releases_from_ledger", _W, False,
        "unknown method: releases per round read from the ledger",
    )  # fmt: skip
    NO_DP = ("no_dp", _I, False, "the run claims no differential privacy")
    EMPIRICAL_EXCEEDS_CLAIM = (
        "empirical_exceeds_claim", _E, False,
        "the one-run lower bound exceeds the recomputed ε",
    )  # fmt: skip
    # --- tampering: the run's files contradict each other or the replay
    NOISE_NOT_APPLIED = ("noise_not_applied", _E, True, "σ = 0: no privacy")
    ADAPTER_HASH_MISMATCH = (
        "adapter_hash_mismatch", _E, True, "the adapter is not the one the run wrote",
    )  # fmt: skip
    ADAPTER_MISSING = ("adapter_missing", _E, True, "the released adapter is missing")
    SPLITS_HASH_MISMATCH = (
        "splits_hash_mismatch", _E, True, "splits.json changed after the run",
    )  # fmt: skip
    SPLITS_MISSING = ("splits_missing", _E, True, "splits.json is missing")
    LEDGER_FILE_MISMATCH = (
        "ledger_file_mismatch", _E, True, "ledger.json differs from the manifest's ledger",
    )  # fmt: skip
    CONFIG_FILE_MISMATCH = (
        "config_file_mismatch", _E, True, "config.json differs from the manifest's config",
    )  # fmt: skip
    LEDGER_INCOMPLETE = (
        "ledger_incomplete", _E, True, "the ledger records fewer DP steps than implied",
    )  # fmt: skip
    SIGMA_MISMATCH = ("sigma_mismatch", _E, True, "σ differs between config, block and ledger")
    SAMPLE_RATE_MISMATCH = (
        "sample_rate_mismatch", _E, True, "a recorded sampling rate is not batch / n",
    )  # fmt: skip
    REPLAY_MISMATCH = (
        "replay_mismatch", _E, True, "retrained from config and key, the run differs",
    )  # fmt: skip
    # --- replay
    KEY_MISMATCH = ("key_mismatch", _E, False, "the key given is not the run's key")
    REPLAY_INEXACT = (
        "replay_inexact", _I, False, "the replay matches within tolerance, not bit for bit",
    )  # fmt: skip


#: the codes that mean tampering, as strings (``"replay_mismatch" in TAMPER_CODES``)
TAMPER_CODES = frozenset(c for c in Code if c.tampering)


@dataclass(frozen=True)
class Finding:
    """One problem found: ``code``, ``message`` (one paragraph for a reader), ``severity``
    (the code's unless given weaker)."""

    code: Code
    message: str
    severity: Severity | None = None

    def __post_init__(self):
        object.__setattr__(self, "code", Code(self.code))
        sev = self.code.severity if self.severity is None else Severity(self.severity)
        if sev.rank > self.code.severity.rank:
            raise ValueError(
                f"finding {self.code}: severity {sev} above its code's ({self.code.severity})"
            )
        object.__setattr__(self, "severity", sev)

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    @property
    def tampering(self) -> bool:
        return self.code.tampering

    def to_dict(self) -> dict:
        return {"code": str(self.code), "severity": str(self.severity), "message": self.message}

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(Code(d["code"]), d["message"], Severity(d["severity"]))


class Findings(list):
    """The findings of one audit, in the order found (a list of :class:`Finding`)."""

    def add(self, code: Code, message: str, severity: Severity | None = None) -> Finding:
        f = Finding(code, message, severity)
        self.append(f)
        return f

    def add_once(self, code: Code, message: str, severity: Severity | None = None) -> None:
        """Add unless a finding of ``code`` is already there (the first explanation wins)."""
        if not self.has(code):
            self.add(code, message, severity)

    def has(self, code: Code) -> bool:
        return any(f.code is code for f in self)

    def to_dicts(self) -> list[dict]:
        return [f.to_dict() for f in self]
