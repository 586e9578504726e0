"""The mechanism a claim describes and the common accounting mistakes, as models whose ε can be
recomputed (:mod:`audit.claims.check` compares them with the claimed ε).

:class:`Mech` is a self-composed Gaussian step (Poisson-subsampled or plain, sensitivity C
or 2C); :class:`Eps` its memoized ε(δ) by PLD and RDP. :func:`reference` is the mechanism as
described (the rules are in :mod:`audit.claims.check`'s docstring); ``_mistakes`` lists the
mechanisms each mistake (or combination) would account instead, and
:func:`explain_shortfall` adds the findings of the simplest one whose ε reproduces the
claimed figure, with the text that says why. :func:`opacus_sample_rate` is Opacus's
sampling-rate convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.schema import Claim
from audit.findings import Code, Findings
from fl.privacy.accounting import Event, epsilon_of_events

__all__ = ["Eps", "Mech", "explain_shortfall", "opacus_sample_rate", "reference"]


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
class Mech:
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


class Eps:
    """Memoized ε(δ) of a mechanism with both accountants."""

    def __init__(self, sigma: float, delta: float):
        self.sigma, self.delta = sigma, delta
        self._memo: dict = {}

    def __call__(self, m: Mech, accountant: str, discretization: float = 1e-4) -> float:
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

    def matches(self, m: Mech, target: float, tol: float) -> list[tuple[str, float]]:
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


def reference(c: Claim) -> Mech:
    """The mechanism as actually described (see the module docstring)."""
    R, S = c.rounds, c.steps_per_round
    models = _plain_models(c)
    if not models:  # Poisson-subsampled
        if c.level == "client":
            return Mech(True, c.clients_per_round / c.total_clients, R * S)
        return Mech(True, c.record_rate, R * S)
    _, per_round, _, sens, _ = models[0]
    return Mech(False, 1.0, R * per_round, sens)


def _mistakes(c: Claim) -> list[tuple[frozenset, Mech, str]]:
    """Mechanisms that common accounting mistakes would use instead of the reference.

    Returns (codes, mechanism, how) triples; ``how`` describes the mistaken computation.
    """
    R, S = c.rounds, c.steps_per_round
    out: list[tuple[frozenset, Mech, str]] = []
    if c.level == "client":
        K, m = c.total_clients, c.clients_per_round
        p = m / K
        comps = [(frozenset(), R, f"{R} rounds × {S}")]
        if R > 1:
            comps.append((frozenset({"no_composition_across_rounds"}), 1, f"one round ({S})"))
        for cc, rounds, chow in comps:
            if c.sampling == "poisson" and p < 1:
                out.append(
                    (cc, Mech(True, p, rounds * S), f"{chow} Gaussian release(s), "
                     f"Poisson-subsampled at q={p:.4g}")
                )  # fmt: skip
            for mc, per_round, _, sens, what in _plain_models(c):
                out.append((cc | mc, Mech(False, 1.0, rounds * per_round, sens), f"{chow} {what}"))
            if c.sampling != "poisson" and p < 1:
                out.append(
                    (
                        cc | {"client_sampling_ignored"},
                        Mech(True, p, rounds * S),
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
            out.append((codes, Mech(True, q, count), f"{chow}, Poisson-subsampled at {rhow}"))
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
            out.append((cc | mc, Mech(False, 1.0, n, sens), f"{chow}: {n} {what}"))
    return out


def _close(a: float, b: float, tol: float) -> bool:
    """``a`` is within relative distance ``tol`` of ``b`` (equal when either is infinite)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return abs(a - b) <= tol * max(abs(b), 1e-12)


# --------------------------------------------------------------------------- explaining a shortfall


def explain_shortfall(
    c: Claim, eps: Eps, ref: Mech, e_pld: float, tol: float, findings: Findings
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
