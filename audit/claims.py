"""Check a privacy claim made elsewhere (a paper, another tool) against its own mechanism.

A *claim* describes a DP federated training mechanism and the (ε, δ) its author reports.
:func:`check_claim` recomputes ε for the mechanism *as described* with
:mod:`fl.privacy.accounting` (PLD is the headline figure, RDP is given beside it) and
then explains a shortfall: it recomputes the ε that each common accounting mistake
would produce and reports the mistake(s) whose ε reproduces the claimed figure.

Neighbouring relation: every recomputed ε is for **add/remove** (``neighbouring`` in the
output, :data:`fl.privacy.accounting.NEIGHBOURING`): datasets D and D ∪ {x} are
neighbours, x being ONE example (record) at sample level and ONE client with all of its
data at client level. A claim stated under another relation (e.g. replace-one) is
recomputed under add/remove.

Claim fields (JSON or TOML, see :func:`load_claim` and docs/audit.md):

==================  =========================================================================
``level``           ``"sample"`` (one example added/removed) or ``"client"`` (one client,
                    with all of its data, added/removed)
``noise_multiplier`` σ = noise std / ℓ2 sensitivity (the clipping norm C), ≥ 0
``clipping_norm``   C (optional, informational: σ is relative to C)
``sampling``        sample level: how a step's batch is drawn from a client's records;
                    client level: how a round's clients are drawn. ``poisson`` (each
                    independently with a fixed probability) | ``shuffle`` (a random
                    permutation, consecutive batches of a fixed size) | ``fixed_batch``
                    (batches / cohorts of a fixed size whose membership is not independent
                    per record, e.g. drawn without replacement) | ``all``
``batch_size``      records per (expected) batch — with ``dataset_size``, or give ``sample_rate``
``dataset_size``    records held by ONE client (the population the batch is drawn from)
``sample_rate``     q of one step (instead of batch_size / dataset_size)
``steps_per_round`` sample level: DP-SGD steps a participating client takes per round;
                    client level: Gaussian releases per round (default 1)
``rounds``          federated rounds
``clients_per_round`` clients taking part in a round (expected number for Poisson)
``total_clients``   clients in the federation
``accounting``      how the claimant composed: composed | per_round | per_epoch | unknown
``noise_source``    where the Gaussian noise comes from: ``keyed_csprng`` (a CSPRNG keyed
                    with a secret key) | ``csprng`` (OS entropy) | ``seeded`` (a seeded,
                    reproducible generator) | ``unknown`` (default when absent)
``claimed_epsilon`` the claimed ε (> 0)
``delta``           the claimed δ in (0, 1)
==================  =========================================================================

The mechanism as recomputed (the *reference*), under add/remove:

* sample level: an example lives on one client, so its guarantee composes that client's
  steps. No amplification by client sampling is granted: the worst case is a client that
  takes part in every round, so the count is ``steps_per_round × rounds``.
  ``poisson``: each step is the Poisson-subsampled Gaussian at q = batch_size /
  dataset_size (sensitivity C: the added record is in a batch or not).
  ``all``: every step uses every record: a plain Gaussian of multiplier σ per step
  (adding a record adds one clipped gradient, sensitivity C).
  ``fixed_batch``: batches of a fixed size. An added record can take the place of
  another in a batch, so a step's sum changes by a replacement (sensitivity 2C), and
  nothing says the record skips any batch: every step is a plain Gaussian of multiplier
  σ/2, no amplification.
  ``shuffle``: a random permutation cut into consecutive batches of a fixed size.
  Inserting a record into the permutation shifts every later record by one position, so
  its batch and every later batch of the pass change by a replacement (one record in,
  one out). The conservative reference is every step a plain Gaussian of multiplier σ/2
  (the record at the start of a pass), no amplification.
* client level: ``rounds × steps_per_round`` Gaussian releases. ``poisson``:
  Poisson-subsampled at q = clients_per_round / total_clients (sensitivity C). ``all``
  (or clients_per_round = total_clients): a plain Gaussian of multiplier σ. A cohort of a
  fixed count m < K (``shuffle`` / ``fixed_batch``): an added client can displace another
  from the cohort, so the sum changes by up to 2C — a plain Gaussian of multiplier σ/2
  per release, no amplification (derivation: :func:`fl.privacy.accounting.client_level_event`,
  a coupling of the cohorts of D and D ∪ {x} and the joint convexity of the
  hockey-stick divergence).

The fixed-size references are what each step gives in the worst case under the coupling
of the batches (cohorts) of D and D ∪ {x}; accounting them at sensitivity C — correct
under replace-one, not under add/remove — is the mistake ``replacement_sensitivity_ignored``.

ε of a composition of plain Gaussians (no subsampling) is computed in closed form (k
Gaussians of noise multiplier s are exactly μ-GDP with μ = √k/s, s = σ or σ/2); the PLD
accountant estimates the same curve, pessimistically and slowly for large ε. Subsampled
mechanisms use the PLD accountant of :mod:`fl.privacy.accounting`.

Noise source: noise drawn from a seeded generator can be regenerated from the seed and
subtracted from the release; the DP guarantee then does not hold against anyone who
knows or guesses the seed. ``noise_source = "seeded"`` is the error ``noise_reproducible``;
``unknown`` (or absent) is the same code as a warning.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from audit.empirical import gdp_epsilon
from fl.errors import UsageError
from fl.privacy.accounting import NEIGHBOURING, Event, epsilon_of_events

__all__ = ["check_claim", "load_claim", "validate_claim", "MATCH_TOLERANCE", "UNDERSTATE_TOLERANCE"]

#: a claimed ε "matches" a recomputed one when within this relative distance
MATCH_TOLERANCE = 0.02
#: a claim is understated when the recomputed ε exceeds it by more than this fraction
UNDERSTATE_TOLERANCE = 0.01

LEVELS = ("sample", "client")
SAMPLINGS = ("poisson", "shuffle", "fixed_batch", "all")
ACCOUNTINGS = ("composed", "per_round", "per_epoch", "unknown")
NOISE_SOURCES = ("keyed_csprng", "csprng", "seeded", "unknown")
_FREE_TEXT = ("name", "source", "notes")
_FIELDS = (
    "level",
    "noise_multiplier",
    "clipping_norm",
    "sampling",
    "batch_size",
    "dataset_size",
    "sample_rate",
    "steps_per_round",
    "rounds",
    "clients_per_round",
    "total_clients",
    "accounting",
    "noise_source",
    "claimed_epsilon",
    "delta",
) + _FREE_TEXT

# Explanations of each finding code (docs/audit.md lists them with examples).
CODES = {
    "no_composition_across_rounds": "each round accounted afresh instead of composed",
    "partial_composition": "only one epoch of steps accounted",
    "wrong_sample_rate": "sampling rate computed over the whole federation",
    "amplification_without_random_sampling": "Poisson amplification claimed for non-Poisson batches",
    "client_sampling_ignored": "amplification by client sampling that the mechanism does not give",
    "replacement_sensitivity_ignored": (
        "fixed-size batches/cohorts accounted with sensitivity C under add/remove"
    ),
    "noise_reproducible": "noise from a seeded (or unstated) generator: can be regenerated",
    "delta_too_large": "δ >= 1/n",
    "noise_not_applied": "σ = 0: no privacy",
    "unexplained_understatement": "claimed ε below the recomputed one, no known mistake matches",
    "clipping_norm_missing": "clipping norm not stated",
}


# --------------------------------------------------------------------------- loading / schema


def _num(claim: dict, key: str, *, integer: bool = False, lo=None, lo_open=False, hi=None):
    v = claim[key]
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


def validate_claim(claim: dict) -> dict:
    """Check a claim's schema; return a normalized copy (defaults filled, numbers typed).

    Raises:
        UsageError: one line naming the offending field.
    """
    if not isinstance(claim, dict):
        raise UsageError(f"a claim must be an object/table, got {type(claim).__name__}")
    claim = {k: v for k, v in claim.items() if v is not None}  # None = absent (idempotent)
    unknown = sorted(set(claim) - set(_FIELDS))
    if unknown:
        raise UsageError(f"unknown claim field(s) {unknown}; known fields: {list(_FIELDS)}")
    for key in ("level", "noise_multiplier", "sampling", "rounds", "claimed_epsilon", "delta"):
        if key not in claim:
            raise UsageError(f"claim is missing required field {key!r}")
    c: dict = {k: claim[k] for k in _FREE_TEXT if k in claim}
    for key, allowed in (("level", LEVELS), ("sampling", SAMPLINGS)):
        if claim[key] not in allowed:
            raise UsageError(f"claim field {key!r} must be one of {allowed}, got {claim[key]!r}")
        c[key] = claim[key]
    c["accounting"] = claim.get("accounting", "unknown")
    if c["accounting"] not in ACCOUNTINGS:
        raise UsageError(
            f"claim field 'accounting' must be one of {ACCOUNTINGS}, got {c['accounting']!r}"
        )
    c["noise_source"] = claim.get("noise_source", "unknown")
    if c["noise_source"] not in NOISE_SOURCES:
        raise UsageError(
            f"claim field 'noise_source' must be one of {NOISE_SOURCES}, got {c['noise_source']!r}"
        )
    c["noise_multiplier"] = _num(claim, "noise_multiplier", lo=0.0)
    c["claimed_epsilon"] = _num(claim, "claimed_epsilon", lo=0.0, lo_open=True)
    c["delta"] = _num(claim, "delta", lo=0.0, lo_open=True)
    if c["delta"] >= 1.0:
        raise UsageError(f"claim field 'delta' must be < 1, got {claim['delta']!r}")
    c["rounds"] = _num(claim, "rounds", integer=True, lo=1)
    c["clipping_norm"] = (
        _num(claim, "clipping_norm", lo=0.0, lo_open=True) if "clipping_norm" in claim else None
    )
    for key in ("batch_size", "dataset_size", "clients_per_round", "total_clients"):
        c[key] = _num(claim, key, integer=True, lo=1) if key in claim else None
    c["sample_rate"] = (
        _num(claim, "sample_rate", lo=0.0, lo_open=True, hi=1.0) if "sample_rate" in claim else None
    )
    if "steps_per_round" in claim:
        c["steps_per_round"] = _num(claim, "steps_per_round", integer=True, lo=1)
    elif c["level"] == "client":
        c["steps_per_round"] = 1  # one Gaussian release of the aggregate per round
    else:
        raise UsageError("claim is missing required field 'steps_per_round' (sample level)")
    if (
        c["clients_per_round"]
        and c["total_clients"]
        and c["clients_per_round"] > c["total_clients"]
    ):
        raise UsageError(
            f"claim field 'clients_per_round' ({c['clients_per_round']}) exceeds "
            f"'total_clients' ({c['total_clients']})"
        )
    if c["level"] == "sample":
        if c["sampling"] != "all":
            have_bd = c["batch_size"] is not None and c["dataset_size"] is not None
            if not have_bd and c["sample_rate"] is None:
                raise UsageError(
                    "claim needs 'batch_size' and 'dataset_size' or 'sample_rate' for sampling "
                    f"{c['sampling']!r}"
                )
            if have_bd and c["batch_size"] > c["dataset_size"]:
                raise UsageError(
                    f"claim field 'batch_size' ({c['batch_size']}) exceeds 'dataset_size' "
                    f"({c['dataset_size']}, the records of one client)"
                )
            if have_bd and c["sample_rate"] is not None:
                q = c["batch_size"] / c["dataset_size"]
                if abs(q - c["sample_rate"]) > 1e-9 * max(q, 1e-300) + 1e-12:
                    raise UsageError(
                        f"claim field 'sample_rate' ({c['sample_rate']:g}) disagrees with "
                        f"batch_size/dataset_size = {q:g}"
                    )
    else:
        for key in ("clients_per_round", "total_clients"):
            if c[key] is None:
                raise UsageError(f"claim is missing required field {key!r} (client level)")
        if c["sampling"] == "all" and c["clients_per_round"] < c["total_clients"]:
            raise UsageError(
                f"claim field 'clients_per_round' ({c['clients_per_round']}) is below "
                f"'total_clients' ({c['total_clients']}) but sampling is 'all'; describe "
                "how the cohort is drawn (poisson | shuffle | fixed_batch)"
            )
    return c


def load_claim(path) -> dict:
    """Read and validate a claim file (``.json`` or ``.toml``; other suffixes: JSON, then TOML).

    Returns the normalized claim (see :func:`validate_claim`).

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
    return validate_claim(doc)


# --------------------------------------------------------------------------- recomputation


@dataclass(frozen=True)
class _Mech:
    """A (self-composed) mechanism: ``count`` steps of a Gaussian with rate ``q``
    (Poisson-subsampled when q < 1 and ``poisson``) and ℓ2 sensitivity ``sens`` × C —
    1 when the neighbour adds one clipped contribution, 2 when it can also displace one
    (fixed-size batches/cohorts under add/remove): the Gaussian's multiplier is σ/sens."""

    poisson: bool
    q: float
    count: int
    sens: int = 1

    def event(self, sigma: float) -> Event:
        if self.poisson and self.q < 1.0:
            return Event("poisson_gaussian", sigma / self.sens, self.q, self.count, unit="_")
        return Event("gaussian", sigma / self.sens, 1.0, self.count, unit="_")

    def key(self) -> tuple:
        return (
            self.poisson and self.q < 1.0,
            self.q if self.poisson else 1.0,
            self.count,
            self.sens,
        )


class _Eps:
    """Memoized ε(δ) of a mechanism with both accountants."""

    def __init__(self, sigma: float, delta: float):
        self.sigma, self.delta = sigma, delta
        self._memo: dict = {}

    def __call__(self, m: _Mech, accountant: str, discretization: float = 1e-4) -> float:
        key = (m.key(), accountant, discretization if accountant == "pld" else None)
        if key not in self._memo and accountant == "pld" and not (m.poisson and m.q < 1.0):
            # k plain Gaussians of std σ and sensitivity s compose exactly to μ-GDP with
            # μ = s√k/σ, whose privacy profile ε(δ) is the exact one the PLD estimates
            # (pessimistically, and slowly for large ε): use the closed form.
            self._memo[key] = (
                gdp_epsilon(m.sens * math.sqrt(m.count) / self.sigma, self.delta)
                if self.sigma > 0 and m.count > 0
                else (0.0 if m.count == 0 else math.inf)
            )
        if key not in self._memo:
            self._memo[key] = epsilon_of_events(
                [m.event(self.sigma)], self.delta, accountant, discretization
            )
        return self._memo[key]

    def matches(self, m: _Mech, target: float, tol: float) -> list[tuple[str, float]]:
        """(accountant, ε) pairs of ``m`` within ``tol`` of ``target``. PLD is screened on a
        coarse grid (10× faster, slightly pessimistic) and refined only near the target."""
        out = []
        e = self(m, "rdp")
        if _close(target, e, tol):
            out.append(("rdp", e))
        if _close(target, self(m, "pld", 1e-3), 3 * tol):
            e = self(m, "pld")
            if _close(target, e, tol):
                out.append(("pld", e))
        return out


def _record_rate(c: dict) -> float:
    """q of one step at sample level: batch / records of ONE client (1 for ``all``)."""
    if c["sampling"] == "all":
        return 1.0
    if c["sample_rate"] is not None:
        return c["sample_rate"]
    return c["batch_size"] / c["dataset_size"]


def _fixed_cohort(c: dict) -> bool:
    """Client level: a cohort of a fixed count m < K (not Poisson, not everyone)."""
    return c["sampling"] in ("shuffle", "fixed_batch") and (
        c["clients_per_round"] < c["total_clients"]
    )


_REPL = frozenset({"replacement_sensitivity_ignored"})


def _plain_models(c: dict) -> list[tuple[frozenset, int, int, int, str]]:
    """Per-round models of a mechanism without amplification, for the reference and the
    replacement mistake: (codes, steps per round, steps per epoch, sensitivity, what).
    The model with no code is the reference (see the module docstring)."""
    S = c["steps_per_round"]
    if c["level"] == "client":
        if c["sampling"] == "poisson" and c["clients_per_round"] < c["total_clients"]:
            return []
        if not _fixed_cohort(c):
            return [(frozenset(), S, S, 1, "Gaussian release(s)")]
        return [
            (frozenset(), S, S, 2, "Gaussian release(s) at σ/2 (sensitivity 2C)"),
            (_REPL, S, S, 1, "Gaussian release(s) at sensitivity C"),
        ]
    q = _record_rate(c)
    epoch = min(S, max(1, math.ceil(1.0 / q - 1e-9)))
    if c["sampling"] == "poisson":
        return []
    if c["sampling"] == "all":
        return [(frozenset(), S, epoch, 1, "plain Gaussian step(s)")]
    out = [
        (frozenset(), S, epoch, 2, "plain Gaussian step(s) at σ/2 (sensitivity 2C)"),
        (_REPL, S, epoch, 1, "plain Gaussian step(s) at sensitivity C"),
    ]
    if c["sampling"] == "shuffle":
        # each record sits in exactly one batch per pass: one Gaussian per pass at
        # sensitivity C (the replace-one view) — a round makes ceil(S*q) passes
        passes = max(1, math.ceil(S * q - 1e-9))
        out.append(
            (_REPL, passes, 1, 1, "plain Gaussian(s), one per pass over the data, at sensitivity C")
        )
    return out


def _reference(c: dict) -> _Mech:
    """The mechanism as actually described (see the module docstring)."""
    R, S = c["rounds"], c["steps_per_round"]
    models = _plain_models(c)
    if not models:  # Poisson-subsampled
        if c["level"] == "client":
            return _Mech(True, c["clients_per_round"] / c["total_clients"], R * S)
        return _Mech(True, _record_rate(c), R * S)
    _, per_round, _, sens, _ = models[0]
    return _Mech(False, 1.0, R * per_round, sens)


def _mistakes(c: dict) -> list[tuple[frozenset, _Mech, str]]:
    """Mechanisms that common accounting mistakes would use instead of the reference.

    Returns (codes, mechanism, how) triples; ``how`` describes the mistaken computation.
    """
    R, S = c["rounds"], c["steps_per_round"]
    out: list[tuple[frozenset, _Mech, str]] = []
    if c["level"] == "client":
        K, m = c["total_clients"], c["clients_per_round"]
        p = m / K
        comps = [(frozenset(), R, f"{R} rounds × {S}")]
        if R > 1:
            comps.append((frozenset({"no_composition_across_rounds"}), 1, f"one round ({S})"))
        for cc, rounds, chow in comps:
            if c["sampling"] == "poisson" and p < 1:
                out.append(
                    (cc, _Mech(True, p, rounds * S), f"{chow} Gaussian release(s), "
                     f"Poisson-subsampled at q={p:.4g}")
                )  # fmt: skip
            for mc, per_round, _, sens, what in _plain_models(c):
                out.append((cc | mc, _Mech(False, 1.0, rounds * per_round, sens), f"{chow} {what}"))
            if c["sampling"] != "poisson" and p < 1:
                out.append(
                    (
                        cc | {"client_sampling_ignored"},
                        _Mech(True, p, rounds * S),
                        f"{chow} Gaussian release(s), Poisson-subsampled at q={p:.4g}",
                    )
                )
        return out

    q0 = _record_rate(c)
    K, m = c["total_clients"], c["clients_per_round"]
    # (codes, rate, description) of the per-step record sampling rate the claimant may use
    rates = [(frozenset(), q0, f"q={q0:.4g}")]
    if K and K > 1 and c["sampling"] != "all":
        pop = (
            f"{K}×{c['dataset_size']} = {K * c['dataset_size']} records"
            if c["dataset_size"]
            else f"{K} clients' records"
        )
        rates.append(
            (frozenset({"wrong_sample_rate"}), q0 / K, f"q={q0 / K:.4g} (batch over {pop})")
        )
    if K and m and m < K:
        rates.append(
            (
                frozenset({"client_sampling_ignored"}),
                q0 * m / K,
                f"q={q0 * m / K:.4g} (q × {m}/{K} clients per round)",
            )
        )
    epoch_steps = max(1, math.ceil(1.0 / q0 - 1e-9))
    comps = [(frozenset(), S * R, f"{R} rounds × {S} steps")]
    if R > 1:
        comps.append((frozenset({"no_composition_across_rounds"}), S, f"one round ({S} steps)"))
    if epoch_steps < S:
        comps.append(
            (frozenset({"partial_composition"}), epoch_steps, f"one epoch ({epoch_steps} steps)")
        )
    non_random = c["sampling"] in ("shuffle", "fixed_batch")
    for cc, count, chow in comps:
        for rc, q, rhow in rates:
            # The claimant's step: Poisson-subsampled at q. It is the reference step for
            # poisson sampling; for shuffle / fixed batches it is a mistake in itself.
            codes = cc | rc
            if non_random:
                codes = codes | {"amplification_without_random_sampling"}
            if c["sampling"] == "all" and not rc:
                continue  # no subsampling and no rate mistake: the plain models below
            out.append((codes, _Mech(True, q, count), f"{chow}, Poisson-subsampled at {rhow}"))
    # the plain (unamplified) models: the reference, its sensitivity-C variants, and the
    # composition mistakes on each
    plain_comps = [(frozenset(), None, f"{R} rounds")]
    if R > 1:
        plain_comps.append((frozenset({"no_composition_across_rounds"}), None, "one round"))
    plain_comps.append((frozenset({"partial_composition"}), "epoch", "one epoch"))
    for mc, per_round, per_epoch, sens, what in _plain_models(c):
        for cc, kind, chow in plain_comps:
            if kind == "epoch":
                if per_epoch >= per_round:
                    continue  # one epoch is the whole round: no partial composition
                n = per_epoch
            else:
                n = R * per_round if not cc else per_round
            out.append((cc | mc, _Mech(False, 1.0, n, sens), f"{chow}: {n} {what}"))
    return out


def _close(a: float, b: float, tol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= tol * max(abs(b), 1e-12)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def check_claim(claim: dict, tol: float = MATCH_TOLERANCE) -> dict:
    """Recompute ε for a claimed mechanism and name the mistakes that explain a shortfall.

    Args:
        claim: claim fields (validated here, see :func:`validate_claim`).
        tol: relative tolerance for "the claimed ε matches the ε of a mistaken accounting".

    Returns:
        ``{"claimed_epsilon", "delta", "epsilon_pld", "epsilon_rdp", "understated", "ratio",
        "neighbouring", "noise_source", "findings": [{"code", "severity", "message"}],
        "mechanism"}``: ε in nats at the claimed δ, under the add/remove relation named by
        ``neighbouring``; ``understated`` is true when ``epsilon_pld`` exceeds the claim by
        more than 1%; ``ratio`` = epsilon_pld / claimed_epsilon (inf when σ = 0).
    """
    c = validate_claim(claim)
    sigma, delta, claimed = c["noise_multiplier"], c["delta"], c["claimed_epsilon"]
    eps = _Eps(sigma, delta)
    ref = _reference(c)
    e_pld, e_rdp = eps(ref, "pld"), eps(ref, "rdp")
    understated = e_pld > claimed * (1.0 + UNDERSTATE_TOLERANCE)
    findings: list[dict] = []

    def add(code: str, severity: str, message: str) -> None:
        if not any(f["code"] == code for f in findings):
            findings.append({"code": code, "severity": severity, "message": message})

    R = c["rounds"]
    if sigma == 0.0:
        add(
            "noise_not_applied",
            "error",
            f"The noise multiplier is 0, so the mechanism is not differentially private at all "
            f"(ε = inf), whatever the claimed ε = {claimed:g}.",
        )

    # Explain a shortfall: the mistaken accountings whose ε reproduces the claimed figure.
    matched: list[tuple[int, float, frozenset, str, str, float]] = []
    if understated and sigma > 0:
        ref_key = ref.key()
        for codes, mech, how in _mistakes(c):
            if mech.key() == ref_key or not codes:
                continue
            for acc, e in eps.matches(mech, claimed, tol):
                matched.append((len(codes), abs(claimed - e) / e, codes, how, acc, e))
    if matched:
        best = min(matched, key=lambda t: (t[0], t[1]))
        _, _, codes, how, acc, e = best
        expl = (
            f"The claimed ε = {claimed:g} matches the ε = {e:.4g} ({acc.upper()}) of {how}, "
            f"while the mechanism as described gives ε = {e_pld:.4g} (PLD) at δ = {delta:g}"
        )
        text = {
            "no_composition_across_rounds": f"{expl}: the {R} rounds were not composed.",
            "partial_composition": f"{expl}: only one epoch was accounted.",
            "wrong_sample_rate": (
                f"{expl}: the sampling rate was taken over the whole federation, but a batch is "
                f"drawn from one client's {c['dataset_size'] or 'records'} records "
                f"(q = {_record_rate(c) if c['level'] == 'sample' else math.nan:.4g})."
            ),
            "amplification_without_random_sampling": (
                f"{expl}: amplification by Poisson subsampling was claimed, but batches are "
                f"drawn by {c['sampling']}, which gives no such amplification."
            ),
            "client_sampling_ignored": (
                f"{expl}: amplification by client sampling "
                f"({c['clients_per_round']}/{c['total_clients']} clients per round) was "
                + (
                    "claimed, but clients are not Poisson-sampled."
                    if c["level"] == "client"
                    else "claimed, but a sample-level guarantee must assume a client may take "
                    "part in every round."
                )
            ),
            "replacement_sensitivity_ignored": (
                f"{expl}: fixed-size "
                + (
                    f"cohorts ({c['clients_per_round']} of {c['total_clients']} clients) were "
                    "accounted with sensitivity C, but under add/remove of one client an added "
                    "client can displace another from the fixed-size cohort, so the sum changes "
                    "by up to 2C: a Gaussian of multiplier σ/2 per release."
                    if c["level"] == "client"
                    else "batches were accounted with sensitivity C, but under add/remove of one "
                    "example an added record can displace another from its fixed-size batch"
                    + (
                        " and shift every later batch of the pass by one position"
                        if c["sampling"] == "shuffle"
                        else ""
                    )
                    + ", so a step's sum changes by a replacement (up to 2C): a Gaussian of "
                    "multiplier σ/2 per step."
                )
            ),
        }
        for code in sorted(codes):
            add(code, "error", text[code])

    # Direct rules, from what the claimant says they did.
    if c["accounting"] == "per_round" and R > 1:
        e1 = eps(_Mech(ref.poisson, ref.q, ref.count // R, ref.sens), "pld")
        add(
            "no_composition_across_rounds",
            "error" if understated else "warning",
            f"The claim says each round was accounted separately (accounting = per_round): one "
            f"round gives ε = {e1:.4g}, but the {R} rounds compose to ε = {e_pld:.4g} (PLD) "
            f"at δ = {delta:g}.",
        )
    if c["accounting"] == "per_epoch" and c["level"] == "sample":
        add(
            "partial_composition",
            "error" if understated else "warning",
            f"The claim says ε was accounted per epoch (accounting = per_epoch), but the "
            f"guarantee must compose all {R} × {c['steps_per_round']} steps: ε = {e_pld:.4g} "
            f"(PLD) at δ = {delta:g}.",
        )
    if c["level"] == "sample":
        n = c["dataset_size"] * (c["total_clients"] or 1) if c["dataset_size"] else None
        unit = "records"
    else:
        n, unit = c["total_clients"], "clients"
    if n is not None and delta >= 1.0 / n:
        add(
            "delta_too_large",
            "error",
            f"δ = {delta:g} is at least 1/n = {1.0 / n:.3g} (n = {n} {unit}): a mechanism that "
            f"publishes one random {unit[:-1]} in the clear satisfies such a δ.",
        )
    if understated and not matched and sigma > 0:
        add(
            "unexplained_understatement",
            "error",
            f"The claimed ε = {claimed:g} is below the ε = {e_pld:.4g} (PLD; {e_rdp:.4g} by RDP) "
            f"of the mechanism as described, at δ = {delta:g}; no known accounting mistake "
            f"reproduces the claimed figure.",
        )
    if c["noise_source"] in ("seeded", "unknown"):
        add(
            "noise_reproducible",
            "error" if c["noise_source"] == "seeded" else "warning",
            (
                "The noise is drawn from a seeded generator (noise_source = seeded). "
                if c["noise_source"] == "seeded"
                else "The claim does not say where the noise comes from (noise_source = unknown). "
            )
            + "Noise drawn from a seeded generator can be regenerated from the seed and "
            "subtracted from the release: the DP guarantee then does not hold against anyone "
            "who knows or guesses the seed. Draw it from a CSPRNG (keyed with a secret key "
            "when runs must be reproducible).",
        )
    if c["clipping_norm"] is None:
        add(
            "clipping_norm_missing",
            "info",
            "The claim does not state the clipping norm C; σ is read as noise std / C "
            "(sensitivity 1 after clipping).",
        )
    return {
        "claimed_epsilon": claimed,
        "delta": delta,
        "epsilon_pld": e_pld,
        "epsilon_rdp": e_rdp,
        "understated": bool(understated),
        "ratio": e_pld / claimed,
        "neighbouring": NEIGHBOURING[c["level"]],
        "noise_source": c["noise_source"],
        "findings": findings,
        "mechanism": _describe(c, ref),
    }


def _describe(c: dict, ref: _Mech) -> str:
    unit = "Gaussian step(s)" if c["level"] == "sample" else "Gaussian release(s)"
    if ref.poisson and ref.q < 1:
        return (
            f"{ref.count} Poisson-subsampled {unit} at q={ref.q:.4g}, σ={c['noise_multiplier']:g}"
        )
    if ref.sens == 2:
        what = "batches" if c["level"] == "sample" else "cohort"
        return (
            f"{ref.count} plain {unit} (no amplification) at multiplier σ/2 = "
            f"{c['noise_multiplier'] / 2:g} (fixed-size {what}: sensitivity 2C under "
            f"{NEIGHBOURING[c['level']]}), σ={c['noise_multiplier']:g}"
        )
    return f"{ref.count} plain {unit} (no amplification), σ={c['noise_multiplier']:g}"
