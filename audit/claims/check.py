"""Check a privacy claim made elsewhere (a paper, another tool) against its own mechanism.

A *claim* describes a DP federated training mechanism and the (ε, δ) its author reports.
:func:`check_claim` recomputes ε for the mechanism *as described* with
:mod:`fl.privacy.accounting` (PLD is the headline figure, RDP is given beside it) and
then explains a shortfall: it recomputes the ε that each common accounting mistake
would produce and reports the mistake(s) whose ε reproduces the claimed figure (the
mechanisms and the mistakes' models: :mod:`audit.claims.mistakes`).

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

from audit.claims.mistakes import Eps, Mech, explain_shortfall, opacus_sample_rate, reference
from audit.claims.schema import Claim, load_claim, validate_claim
from audit.findings import Code, Findings, Severity
from audit.records import Record
from fl.privacy.accounting import NEIGHBOURING

__all__ = [
    "Claim",
    "check_claim",
    "ClaimCheck",
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


@dataclass(frozen=True, kw_only=True, eq=False)
class ClaimCheck(Record):
    """The result of :func:`check_claim`: the claim's ε recomputed from the mechanism it
    describes, and the findings that name its mistakes (a read-only dict too, see
    :mod:`audit.records`)."""

    #: the ε the claim states (nats)
    claimed_epsilon: float
    delta: float
    #: ε recomputed by the PLD and RDP accountants at ``delta`` (nats)
    epsilon_pld: float
    epsilon_rdp: float
    #: ``epsilon_pld`` exceeds the claim by more than 1%
    understated: bool
    #: epsilon_pld / claimed_epsilon (inf when σ = 0)
    ratio: float
    #: the add/remove relation ε is computed under
    neighbouring: str
    #: where the claim says its noise comes from
    noise_source: str
    #: :class:`audit.findings.Finding` dicts ``{"code", "severity", "message"}``
    findings: list[dict]
    #: the mechanism the ε is computed for, in words
    mechanism: str


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def check_claim(claim: Claim | dict, tol: float = MATCH_TOLERANCE) -> ClaimCheck:
    """Recompute ε for a claimed mechanism and name the mistakes that explain a shortfall.

    Args:
        claim: a :class:`Claim`, or claim fields (validated here, see :func:`validate_claim`).
        tol: relative tolerance for "the claimed ε matches the ε of a mistaken accounting".

    Returns:
        a :class:`ClaimCheck`, a read-only dict ``{"claimed_epsilon", "delta",
        "epsilon_pld", "epsilon_rdp", "understated", "ratio", "neighbouring",
        "noise_source", "findings": [{"code", "severity", "message"}], "mechanism"}``: ε in nats at the claimed δ, under the add/remove relation named by
        ``neighbouring``; ``understated`` is true when ``epsilon_pld`` exceeds the claim by
        more than 1%; ``ratio`` = epsilon_pld / claimed_epsilon (inf when σ = 0). Findings
        are :class:`audit.findings.Finding` dicts (a code once, its first explanation).
    """
    c = validate_claim(claim)
    sigma, delta, claimed = c.noise_multiplier, c.delta, c.claimed_epsilon
    eps = Eps(sigma, delta)
    ref = reference(c)
    e_pld, e_rdp = eps(ref, "pld"), eps(ref, "rdp")
    understated = e_pld > claimed * (1.0 + UNDERSTATE_TOLERANCE)
    findings = Findings()
    extra: list[dict] = []  # findings whose code audit.findings does not list yet
    q_op = opacus_sample_rate(c)
    if understated and sigma > 0 and q_op is not None:
        # Opacus's convention: the claim's q = batch/dataset is not the rate Opacus ran and
        # accounted; when that rate gives the claimed ε, the claim is right for the
        # mechanism that ran (Opacus's sampler), which becomes the reference.
        op = Mech(True, q_op, ref.count)
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
    matched = understated and sigma > 0 and explain_shortfall(c, eps, ref, e_pld, tol, findings)
    _direct_rules(c, eps, ref, e_pld, understated, findings)
    if understated and not matched and sigma > 0:
        findings.add_once(
            Code.UNEXPLAINED_UNDERSTATEMENT,
            f"The claimed ε = {claimed:g} is below the ε = {e_pld:.4g} (PLD; {e_rdp:.4g} by RDP) "
            f"of the mechanism as described, at δ = {delta:g}; no known accounting mistake "
            f"reproduces the claimed figure.",
        )
    _noise_and_clipping(c, findings)
    return ClaimCheck(
        claimed_epsilon=claimed,
        delta=delta,
        epsilon_pld=e_pld,
        epsilon_rdp=e_rdp,
        understated=bool(understated),
        ratio=e_pld / claimed,
        neighbouring=NEIGHBOURING[c.level],
        noise_source=c.noise_source,
        findings=extra + findings.to_dicts(),
        mechanism=_describe(c, ref),
    )


def _direct_rules(
    c: Claim, eps: Eps, ref: Mech, e_pld: float, understated: bool, findings: Findings
) -> None:
    """Mistakes read from what the claimant says they did (accounting, δ vs n)."""
    R, delta = c.rounds, c.delta
    weak = None if understated else Severity.WARNING
    if c.accounting == "per_round" and R > 1:
        e1 = eps(Mech(ref.poisson, ref.q, ref.count // R, ref.sens), "pld")
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


def _describe(c: Claim, ref: Mech) -> str:
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
