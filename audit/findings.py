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


class Code(StrEnum):
    """A finding's code; the value is the string written into the documents. Its
    :attr:`severity` and whether it means :attr:`tampering` are listed below the class."""

    # --- accounting mistakes (claims and runs)
    #: each round accounted afresh instead of composed
    NO_COMPOSITION_ACROSS_ROUNDS = "no_composition_across_rounds"
    #: only one epoch of steps accounted
    PARTIAL_COMPOSITION = "partial_composition"
    #: sampling rate computed over the whole federation
    WRONG_SAMPLE_RATE = "wrong_sample_rate"
    #: Poisson amplification claimed for non-Poisson batches
    AMPLIFICATION_WITHOUT_RANDOM_SAMPLING = "amplification_without_random_sampling"
    #: amplification by client sampling that the mechanism does not give
    CLIENT_SAMPLING_IGNORED = "client_sampling_ignored"
    #: fixed-size batches/cohorts accounted with sensitivity C under add/remove
    REPLACEMENT_SENSITIVITY_IGNORED = "replacement_sensitivity_ignored"
    #: a claim read with Opacus's sampling rate 1/ceil(n/B) (not B/n): explained, named
    OPACUS_SAMPLE_RATE = "opacus_sample_rate"
    #: claimed ε below the recomputed one, no known mistake matches
    UNEXPLAINED_UNDERSTATEMENT = "unexplained_understatement"
    #: noise from a seeded (or unstated) generator: can be regenerated
    NOISE_REPRODUCIBLE = "noise_reproducible"
    #: δ >= 1/n
    DELTA_TOO_LARGE = "delta_too_large"
    #: clipping norm not stated
    CLIPPING_NORM_MISSING = "clipping_norm_missing"
    # --- a run's stated ε against its recomputation
    #: the stated ε is below the recomputed one
    EPSILON_UNDERSTATED = "epsilon_understated"
    #: the stated ε is above the recomputed one (conservative, but not what was computed)
    EPSILON_OVERSTATED = "epsilon_overstated"
    #: a DP run states no ε
    EPSILON_MISSING = "epsilon_missing"
    #: the configuration implies more ε than the ledger
    LEDGER_BELOW_CONFIG = "ledger_below_config"
    #: the ledger records more DP steps than implied
    LEDGER_EXTRA_EVENTS = "ledger_extra_events"
    #: no metrics.jsonl: every client assumed every round
    METRICS_MISSING = "metrics_missing"
    #: unknown method: releases per round read from the ledger
    RELEASES_FROM_LEDGER = "releases_from_ledger"
    #: the run claims no differential privacy
    NO_DP = "no_dp"
    #: the one-run lower bound exceeds what the recomputed ε allows for one canary (ε;
    #: at client level 2ε at δ' = (1 + e^ε)δ, replace-one-client)
    EMPIRICAL_EXCEEDS_CLAIM = "empirical_exceeds_claim"
    #: a conformance test rejects the claimed mechanism: the noise at some group is below
    #: the claimed N(0, σ²C²), not fresh, or a canary added more than C
    MECHANISM_MISMATCH = "mechanism_mismatch"
    #: a conformance test rejects at the warning level (Holm α = 0.05) but not at the
    #: verdict's (0.001): weak evidence, reported, the verdict unchanged
    CONFORMANCE_WEAK = "conformance_weak"
    # --- tampering: the run's files contradict each other or the replay
    #: σ = 0: no privacy
    NOISE_NOT_APPLIED = "noise_not_applied"
    #: the adapter is not the one the run wrote
    ADAPTER_HASH_MISMATCH = "adapter_hash_mismatch"
    #: the released adapter is missing
    ADAPTER_MISSING = "adapter_missing"
    #: splits.json changed after the run
    SPLITS_HASH_MISMATCH = "splits_hash_mismatch"
    #: splits.json is missing
    SPLITS_MISSING = "splits_missing"
    #: ledger.json differs from the manifest's ledger
    LEDGER_FILE_MISMATCH = "ledger_file_mismatch"
    #: config.json differs from the manifest's config
    CONFIG_FILE_MISMATCH = "config_file_mismatch"
    #: the ledger records fewer DP steps than implied
    LEDGER_INCOMPLETE = "ledger_incomplete"
    #: σ differs between config, block and ledger
    SIGMA_MISMATCH = "sigma_mismatch"
    #: the ledger's δ differs from the privacy block's
    DELTA_MISMATCH = "delta_mismatch"
    #: a recorded sampling rate is not batch / n
    SAMPLE_RATE_MISMATCH = "sample_rate_mismatch"
    #: retrained from config and key, the run differs
    REPLAY_MISMATCH = "replay_mismatch"
    #: two copies of a field that decides privacy disagree (config, privacy block, noise
    #: block, ledger, metrics)
    FIELDS_CONTRADICT = "fields_contradict"
    #: a file the manifest vouches for (integrity.files) is missing or was changed
    SEALED_FILE_MISMATCH = "sealed_file_mismatch"
    #: the manifest's MAC does not verify under the run key: the manifest was edited
    MANIFEST_MAC_MISMATCH = "manifest_mac_mismatch"
    #: the replay reproduces the adapter but not the rest of the release (manifest fields,
    #: adapter_config.json, metrics.jsonl)
    RELEASE_MISMATCH = "release_mismatch"
    # --- bad values in what is audited
    #: the stated ε is not a number >= 0 (NaN, negative, text)
    EPSILON_INVALID = "epsilon_invalid"
    #: the released adapter holds NaN or Inf values
    ADAPTER_NONFINITE = "adapter_nonfinite"
    #: a release (a noisy step or round) holds NaN or Inf: its implied ε is ∞
    RELEASE_NONFINITE = "release_nonfinite"
    #: the releases carry no noise at all (observed noise factor 0): implied ε = ∞
    NOISE_ABSENT = "noise_absent"
    # --- neighbour replay (audit.replay)
    #: on neighbours D, D′ a noise primitive's input moved more than the declared sensitivity
    SENSITIVITY_EXCEEDED = "sensitivity_exceeded"
    #: something released without noise differs between neighbours D and D′
    DATA_DEPENDENT_RELEASE = "data_dependent_release"
    #: the replay intercepted no noise call at all: nothing was compared, never a pass
    REPLAY_EMPTY = "replay_empty"
    # --- noise keys
    #: the run's noise key was reused from another run on a different configuration
    KEY_REUSED = "key_reused"
    #: two audited runs share a noise key id (their noise can cancel)
    KEY_SHARED = "key_shared"
    # --- replay
    #: the manifest carries no MAC (written before manifests were sealed, or no key)
    MANIFEST_UNSEALED = "manifest_unsealed"
    #: the key given is not the run's key
    KEY_MISMATCH = "key_mismatch"
    #: the replay matches within tolerance, not bit for bit
    REPLAY_INEXACT = "replay_inexact"

    @property
    def severity(self) -> Severity:
        """How bad a finding of this code is when established (error unless listed)."""
        return _SEVERITY.get(self, Severity.ERROR)

    @property
    def tampering(self) -> bool:
        """The run's files contradict each other or the replay (an error)."""
        return self in TAMPER_CODES


_SEVERITY = {
    Code.LEDGER_BELOW_CONFIG: Severity.WARNING,
    Code.METRICS_MISSING: Severity.WARNING,
    Code.RELEASES_FROM_LEDGER: Severity.WARNING,
    Code.CLIPPING_NORM_MISSING: Severity.INFO,
    Code.LEDGER_EXTRA_EVENTS: Severity.INFO,
    Code.NO_DP: Severity.INFO,
    Code.REPLAY_INEXACT: Severity.WARNING,
    Code.MANIFEST_UNSEALED: Severity.WARNING,
    Code.EPSILON_OVERSTATED: Severity.WARNING,
    Code.OPACUS_SAMPLE_RATE: Severity.WARNING,
    Code.CONFORMANCE_WEAK: Severity.WARNING,
}

#: the codes that mean tampering, as strings too (``"replay_mismatch" in TAMPER_CODES``)
TAMPER_CODES = frozenset(
    {
        Code.NOISE_NOT_APPLIED,
        Code.ADAPTER_HASH_MISMATCH,
        Code.ADAPTER_MISSING,
        Code.SPLITS_HASH_MISMATCH,
        Code.SPLITS_MISSING,
        Code.LEDGER_FILE_MISMATCH,
        Code.CONFIG_FILE_MISMATCH,
        Code.LEDGER_INCOMPLETE,
        Code.SIGMA_MISMATCH,
        Code.DELTA_MISMATCH,
        Code.SAMPLE_RATE_MISMATCH,
        Code.REPLAY_MISMATCH,
        Code.FIELDS_CONTRADICT,
        Code.SEALED_FILE_MISMATCH,
        Code.MANIFEST_MAC_MISMATCH,
        Code.RELEASE_MISMATCH,
    }
)


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
