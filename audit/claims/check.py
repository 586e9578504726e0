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

import math
from dataclasses import dataclass

from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.schema import Claim, load_claim, validate_claim
from audit.findings import Code, Findings, Severity
from fl.privacy.accounting import NEIGHBOURING, Event, epsilon_of_events

__all__ = [
    "Claim",
    "check_claim",
    "load_claim",
    "validate_claim",
    "MATCH_TOLERANCE",
    "UNDERSTATE_TOLERANCE",
]

#: a claimed ε "matches" a recomputed one when within this relative distance
MATCH_TOLERANCE = 0.02
#: a claim is understated when the recomputed ε exceeds it by more than this fraction
UNDERSTATE_TOLERANCE = 0.01
#: the finding of Opacus's sample-rate convention (audit.findings.Code.OPACUS_SAMPLE_RATE,
#: severity warning; the plain string until that member exists)
OPACUS_SAMPLE_RATE = getattr(Code, "OPACUS_SAMPLE_RATE", "opacus_sample_rate")


def opacus_sample_rate(c: Claim) -> float | None:
    """The Poisson rate Opacus uses for a claim's ``batch_size`` and ``dataset_size``:
    ``1 / len(data_loader) = 1 / ceil(dataset_size / batch_size)`` (Opacus's
    ``DPDataLoader`` samples each record with that probability; its accountant composes
    at that q). None when the claim does not give both sizes for Poisson sampling at
    sample level, or when the two rates agree (batch_size divides dataset_size)."""
    if c.level != "sample" or c.sampling != "poisson":
        return None
    if c.batch_size is None or c.dataset_size is None:
        return None
    q = 1.0 / math.ceil(c.dataset_size / c.batch_size)
    return None if _close(q, c.batch_size / c.dataset_size, 1e-12) else q


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


_REPL = frozenset({"replacement_sensitivity_ignored"})


def _plain_models(c: Claim) -> list[tuple[frozenset, int, int, int, str]]:
    """Per-round models of a mechanism without amplification, for the reference and the
    replacement mistake: (codes, steps per round, steps per epoch, sensitivity, what).
    The model with no code is the reference (see the module docstring)."""
    S = c.steps_per_round
    if c.level == "client":
        if c.sampling == "poisson" and c.clients_per_round < c.total_clients:
            return []
        if not c.fixed_cohort:
            return [(frozenset(), S, S, 1, "Gaussian release(s)")]
        return [
            (frozenset(), S, S, 2, "Gaussian release(s) at σ/2 (sensitivity 2C)"),
            (_REPL, S, S, 1, "Gaussian release(s) at sensitivity C"),
        ]
    q = c.record_rate
    epoch = min(S, max(1, math.ceil(1.0 / q - 1e-9)))
    if c.sampling == "poisson":
        return []
    if c.sampling == "all":
        return [(frozenset(), S, epoch, 1, "plain Gaussian step(s)")]
    out = [
        (frozenset(), S, epoch, 2, "plain Gaussian step(s) at σ/2 (sensitivity 2C)"),
        (_REPL, S, epoch, 1, "plain Gaussian step(s) at sensitivity C"),
    ]
    if c.sampling == "shuffle":
        # each record sits in exactly one batch per pass: one Gaussian per pass at
        # sensitivity C (the replace-one view) — a round makes ceil(S*q) passes
        passes = max(1, math.ceil(S * q - 1e-9))
        out.append(
            (_REPL, passes, 1, 1, "plain Gaussian(s), one per pass over the data, at sensitivity C")
        )
    return out


def _reference(c: Claim) -> _Mech:
    """The mechanism as actually described (see the module docstring)."""
    R, S = c.rounds, c.steps_per_round
    models = _plain_models(c)
    if not models:  # Poisson-subsampled
        if c.level == "client":
            return _Mech(True, c.clients_per_round / c.total_clients, R * S)
        return _Mech(True, c.record_rate, R * S)
    _, per_round, _, sens, _ = models[0]
    return _Mech(False, 1.0, R * per_round, sens)


def _mistakes(c: Claim) -> list[tuple[frozenset, _Mech, str]]:
    """Mechanisms that common accounting mistakes would use instead of the reference.

    Returns (codes, mechanism, how) triples; ``how`` describes the mistaken computation.
    """
    R, S = c.rounds, c.steps_per_round
    out: list[tuple[frozenset, _Mech, str]] = []
    if c.level == "client":
        K, m = c.total_clients, c.clients_per_round
        p = m / K
        comps = [(frozenset(), R, f"{R} rounds × {S}")]
        if R > 1:
            comps.append((frozenset({"no_composition_across_rounds"}), 1, f"one round ({S})"))
        for cc, rounds, chow in comps:
            if c.sampling == "poisson" and p < 1:
                out.append(
                    (cc, _Mech(True, p, rounds * S), f"{chow} Gaussian release(s), "
                     f"Poisson-subsampled at q={p:.4g}")
                )  # fmt: skip
            for mc, per_round, _, sens, what in _plain_models(c):
                out.append((cc | mc, _Mech(False, 1.0, rounds * per_round, sens), f"{chow} {what}"))
            if c.sampling != "poisson" and p < 1:
                out.append(
                    (
                        cc | {"client_sampling_ignored"},
                        _Mech(True, p, rounds * S),
                        f"{chow} Gaussian release(s), Poisson-subsampled at q={p:.4g}",
                    )
                )
        return out

    q0 = c.record_rate
    K, m = c.total_clients, c.clients_per_round
    # (codes, rate, description) of the per-step record sampling rate the claimant may use
    rates = [(frozenset(), q0, f"q={q0:.4g}")]
    if K and K > 1 and c.sampling != "all":
        pop = (
            f"{K}×{c.dataset_size} = {K * c.dataset_size} records"
            if c.dataset_size
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
    non_random = c.sampling in ("shuffle", "fixed_batch")
    for cc, count, chow in comps:
        for rc, q, rhow in rates:
            # The claimant's step: Poisson-subsampled at q. It is the reference step for
            # poisson sampling; for shuffle / fixed batches it is a mistake in itself.
            codes = cc | rc
            if non_random:
                codes = codes | {"amplification_without_random_sampling"}
            if c.sampling == "all" and not rc:
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


def check_claim(claim: Claim | dict, tol: float = MATCH_TOLERANCE) -> dict:
    """Recompute ε for a claimed mechanism and name the mistakes that explain a shortfall.

    Args:
        claim: a :class:`Claim`, or claim fields (validated here, see :func:`validate_claim`).
        tol: relative tolerance for "the claimed ε matches the ε of a mistaken accounting".

    Returns:
        ``{"claimed_epsilon", "delta", "epsilon_pld", "epsilon_rdp", "understated", "ratio",
        "neighbouring", "noise_source", "findings": [{"code", "severity", "message"}],
        "mechanism"}``: ε in nats at the claimed δ, under the add/remove relation named by
        ``neighbouring``; ``understated`` is true when ``epsilon_pld`` exceeds the claim by
        more than 1%; ``ratio`` = epsilon_pld / claimed_epsilon (inf when σ = 0). Findings
        are :class:`audit.findings.Finding` dicts (a code once, its first explanation).
    """
    c = validate_claim(claim)
    sigma, delta, claimed = c.noise_multiplier, c.delta, c.claimed_epsilon
    eps = _Eps(sigma, delta)
    ref = _reference(c)
    e_pld, e_rdp = eps(ref, "pld"), eps(ref, "rdp")
    understated = e_pld > claimed * (1.0 + UNDERSTATE_TOLERANCE)
    findings = Findings()
    extra: list[dict] = []  # findings whose code audit.findings does not list yet
    q_op = opacus_sample_rate(c)
    if understated and sigma > 0 and q_op is not None:
        # Opacus's convention: the claim's q = batch/dataset is not the rate Opacus ran and
        # accounted; when that rate gives the claimed ε, the claim is right for the
        # mechanism that ran (Opacus's sampler), which becomes the reference.
        op = _Mech(True, q_op, ref.count)
        op_pld, op_rdp = eps(op, "pld"), eps(op, "rdp")
        if op_pld <= claimed * (1.0 + UNDERSTATE_TOLERANCE):
            msg = (
                f"The claim gives batch_size = {c.batch_size} and dataset_size = "
                f"{c.dataset_size} (q = {c.batch_size / c.dataset_size:.4g}, which gives ε = "
                f"{e_pld:.4g} by PLD), but its ε = {claimed:g} is that of q = 1/ceil("
                f"{c.dataset_size}/{c.batch_size}) = {q_op:.4g}, the rate Opacus samples and "
                f"accounts at (1/len(data_loader); expected batch {q_op * c.dataset_size:.4g}):"
                f" ε = {op_pld:.4g} (PLD; {op_rdp:.4g} by RDP) at δ = {delta:g}. The claim "
                f"holds for Opacus's sampler; state sample_rate = {q_op:.6g} to check it "
                "exactly."
            )
            if isinstance(OPACUS_SAMPLE_RATE, str):
                extra.append({"code": OPACUS_SAMPLE_RATE, "severity": "warning", "message": msg})
            else:
                findings.add_once(OPACUS_SAMPLE_RATE, msg)
            ref, e_pld, e_rdp, understated = op, op_pld, op_rdp, False
    if sigma == 0.0:
        findings.add_once(
            Code.NOISE_NOT_APPLIED,
            f"The noise multiplier is 0, so the mechanism is not differentially private at all "
            f"(ε = inf), whatever the claimed ε = {claimed:g}.",
        )
    matched = understated and sigma > 0 and _explain_shortfall(c, eps, ref, e_pld, tol, findings)
    _direct_rules(c, eps, ref, e_pld, understated, findings)
    if understated and not matched and sigma > 0:
        findings.add_once(
            Code.UNEXPLAINED_UNDERSTATEMENT,
            f"The claimed ε = {claimed:g} is below the ε = {e_pld:.4g} (PLD; {e_rdp:.4g} by RDP) "
            f"of the mechanism as described, at δ = {delta:g}; no known accounting mistake "
            f"reproduces the claimed figure.",
        )
    _noise_and_clipping(c, findings)
    return {
        "claimed_epsilon": claimed,
        "delta": delta,
        "epsilon_pld": e_pld,
        "epsilon_rdp": e_rdp,
        "understated": bool(understated),
        "ratio": e_pld / claimed,
        "neighbouring": NEIGHBOURING[c.level],
        "noise_source": c.noise_source,
        "findings": extra + findings.to_dicts(),
        "mechanism": _describe(c, ref),
    }


def _explain_shortfall(
    c: Claim, eps: _Eps, ref: _Mech, e_pld: float, tol: float, findings: Findings
) -> bool:
    """Add the mistakes of the simplest mistaken accounting whose ε reproduces the claimed
    figure (fewest codes, then closest); False when none does."""
    claimed = c.claimed_epsilon
    matched: list[tuple[int, float, frozenset, str, str, float]] = []
    ref_key = ref.key()
    for codes, mech, how in _mistakes(c):
        if mech.key() == ref_key or not codes:
            continue
        for acc, e in eps.matches(mech, claimed, tol):
            matched.append((len(codes), abs(claimed - e) / e, codes, how, acc, e))
    if not matched:
        return False
    _, _, codes, how, acc, e = min(matched, key=lambda t: (t[0], t[1]))
    expl = (
        f"The claimed ε = {claimed:g} matches the ε = {e:.4g} ({acc.upper()}) of {how}, "
        f"while the mechanism as described gives ε = {e_pld:.4g} (PLD) at δ = {c.delta:g}"
    )
    for code in sorted(codes):
        findings.add_once(Code(code), _mistake_text(Code(code), c, expl))
    return True


def _mistake_text(code: Code, c: Claim, expl: str) -> str:
    """Why the mistake ``code`` gives the claimed figure (``expl`` says which figure)."""
    if code is Code.NO_COMPOSITION_ACROSS_ROUNDS:
        return f"{expl}: the {c.rounds} rounds were not composed."
    if code is Code.PARTIAL_COMPOSITION:
        return f"{expl}: only one epoch was accounted."
    if code is Code.WRONG_SAMPLE_RATE:
        return (
            f"{expl}: the sampling rate was taken over the whole federation, but a batch is "
            f"drawn from one client's {c.dataset_size or 'records'} records "
            f"(q = {c.record_rate if c.level == 'sample' else math.nan:.4g})."
        )
    if code is Code.AMPLIFICATION_WITHOUT_RANDOM_SAMPLING:
        return (
            f"{expl}: amplification by Poisson subsampling was claimed, but batches are "
            f"drawn by {c.sampling}, which gives no such amplification."
        )
    if code is Code.CLIENT_SAMPLING_IGNORED:
        return (
            f"{expl}: amplification by client sampling "
            f"({c.clients_per_round}/{c.total_clients} clients per round) was "
            + (
                "claimed, but clients are not Poisson-sampled."
                if c.level == "client"
                else "claimed, but a sample-level guarantee must assume a client may take "
                "part in every round."
            )
        )
    assert code is Code.REPLACEMENT_SENSITIVITY_IGNORED, code
    if c.level == "client":
        return (
            f"{expl}: fixed-size cohorts ({c.clients_per_round} of {c.total_clients} clients) "
            "were accounted with sensitivity C, but under add/remove of one client an added "
            "client can displace another from the fixed-size cohort, so the sum changes "
            "by up to 2C: a Gaussian of multiplier σ/2 per release."
        )
    return (
        f"{expl}: fixed-size batches were accounted with sensitivity C, but under add/remove "
        "of one example an added record can displace another from its fixed-size batch"
        + (
            " and shift every later batch of the pass by one position"
            if c.sampling == "shuffle"
            else ""
        )
        + ", so a step's sum changes by a replacement (up to 2C): a Gaussian of "
        "multiplier σ/2 per step."
    )


def _direct_rules(
    c: Claim, eps: _Eps, ref: _Mech, e_pld: float, understated: bool, findings: Findings
) -> None:
    """Mistakes read from what the claimant says they did (accounting, δ vs n)."""
    R, delta = c.rounds, c.delta
    weak = None if understated else Severity.WARNING
    if c.accounting == "per_round" and R > 1:
        e1 = eps(_Mech(ref.poisson, ref.q, ref.count // R, ref.sens), "pld")
        findings.add_once(
            Code.NO_COMPOSITION_ACROSS_ROUNDS,
            f"The claim says each round was accounted separately (accounting = per_round): one "
            f"round gives ε = {e1:.4g}, but the {R} rounds compose to ε = {e_pld:.4g} (PLD) "
            f"at δ = {delta:g}.",
            weak,
        )
    if c.accounting == "per_epoch" and c.level == "sample":
        findings.add_once(
            Code.PARTIAL_COMPOSITION,
            f"The claim says ε was accounted per epoch (accounting = per_epoch), but the "
            f"guarantee must compose all {R} × {c.steps_per_round} steps: ε = {e_pld:.4g} "
            f"(PLD) at δ = {delta:g}.",
            weak,
        )
    if c.level == "sample":
        n = c.dataset_size * (c.total_clients or 1) if c.dataset_size else None
        unit = "records"
    else:
        n, unit = c.total_clients, "clients"
    if n is not None and delta >= 1.0 / n:
        findings.add_once(
            Code.DELTA_TOO_LARGE,
            f"δ = {delta:g} is at least 1/n = {1.0 / n:.3g} (n = {n} {unit}): a mechanism that "
            f"publishes one random {unit[:-1]} in the clear satisfies such a δ.",
        )


def _noise_and_clipping(c: Claim, findings: Findings) -> None:
    if c.noise_source in ("seeded", "unknown"):
        findings.add_once(
            Code.NOISE_REPRODUCIBLE,
            (
                "The noise is drawn from a seeded generator (noise_source = seeded). "
                if c.noise_source == "seeded"
                else "The claim does not say where the noise comes from (noise_source = unknown). "
            )
            + "Noise drawn from a seeded generator can be regenerated from the seed and "
            "subtracted from the release: the DP guarantee then does not hold against anyone "
            "who knows or guesses the seed. Draw it from a CSPRNG (keyed with a secret key "
            "when runs must be reproducible).",
            None if c.noise_source == "seeded" else Severity.WARNING,
        )
    if c.clipping_norm is None:
        findings.add_once(
            Code.CLIPPING_NORM_MISSING,
            "The claim does not state the clipping norm C; σ is read as noise std / C "
            "(sensitivity 1 after clipping).",
        )


def _describe(c: Claim, ref: _Mech) -> str:
    unit = "Gaussian step(s)" if c.level == "sample" else "Gaussian release(s)"
    if ref.poisson and ref.q < 1:
        how = ""
        if c.level == "sample" and ref.q == opacus_sample_rate(c):
            how = f" (Opacus's 1/ceil({c.dataset_size}/{c.batch_size}))"
        return (
            f"{ref.count} Poisson-subsampled {unit} at q={ref.q:.4g}{how}, σ={c.noise_multiplier:g}"
        )
    if ref.sens == 2:
        what = "batches" if c.level == "sample" else "cohort"
        return (
            f"{ref.count} plain {unit} (no amplification) at multiplier σ/2 = "
            f"{c.noise_multiplier / 2:g} (fixed-size {what}: sensitivity 2C under "
            f"{NEIGHBOURING[c.level]}), σ={c.noise_multiplier:g}"
        )
    return f"{ref.count} plain {unit} (no amplification), σ={c.noise_multiplier:g}"
