"""A run's ε recomputed twice, from its ledger and from its configuration, and the checks
that tie the two to the privacy block (see :mod:`audit.bundle.audit` for the method).

Each step is a small function returning a typed record and the findings it makes:
:class:`~audit.bundle.participation.Stated` (what the privacy block says) →
:class:`~audit.bundle.participation.Participation` (who took part, at which rate, how often;
:mod:`audit.bundle.participation`) → :class:`ConfigEpsilon` (ε from the configuration alone) →
consistency findings → :class:`PrivacyAudit` (the comparison, what the audit reports).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from audit.bundle.participation import (
    ACCOUNTANTS,
    Participation,
    Stated,
    bundle_participation,
    client_releases,
    run_participation,
)
from audit.claims.check import UNDERSTATE_TOLERANCE
from audit.findings import Code, Finding
from fl.privacy.accounting import Event, client_level_event, epsilon_of_events
from fl.privacy.ledger import Ledger

__all__ = ["audit_privacy", "PrivacyAudit", "ConfigEpsilon"]


def fmt_eps(x) -> str:
    if x is None:
        return "none"
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _eps_pair(events: list[Event], delta: float) -> dict:
    return {a: epsilon_of_events(events, delta, a) for a in ACCOUNTANTS}


@dataclass(frozen=True)
class ConfigEpsilon:
    """ε recomputed from the configuration alone, and what it implies for the ledger."""

    epsilon: dict  # accountant -> ε
    implied: dict  # accounting unit -> composed step count
    event_sigma: float  # the multiplier the ledger's events must carry
    population: int  # n of δ < 1/n
    unit_name: str  # what n counts
    # per accounting unit, where it differs by unit (sample level: σ_k of client k)
    unit_sigmas: dict = field(default_factory=dict)


def sample_level_epsilon(stated: Stated, cfg: dict, part: Participation) -> ConfigEpsilon:
    """Per client c: steps_c × rounds_c Poisson-subsampled Gaussian steps at q_c; ε = max."""
    per_unit_eps: list[dict] = []
    implied: dict[str, int] = {}
    memo: dict[tuple, dict] = {}
    for c, (q, steps) in sorted(part.units.items()):
        count = steps * part.rounds_in[c]
        implied[f"client:{c}"] = count
        if count:
            kind = "poisson_gaussian" if q < 1 else "gaussian"
            ev = Event(kind, stated.sigma_of(c), q, count, unit=f"client:{c}")
            # clients with equal mechanisms: one computation
            key = (ev.kind, ev.noise_multiplier, q, count)
            if key not in memo:
                memo[key] = _eps_pair([ev], stated.delta)
            per_unit_eps.append(memo[key])
    eps = {a: max((e[a] for e in per_unit_eps), default=0.0) for a in ACCOUNTANTS}
    units = {f"client:{c}": stated.sigma_of(c) for c in part.units}
    return ConfigEpsilon(eps, implied, stated.sigma, int(cfg["members"]), "records", units)


def client_level_epsilon(
    stated: Stated, p: dict, method: str, cfg: dict, part: Participation
) -> tuple[ConfigEpsilon, list[Finding]]:
    """``releases × rounds`` Gaussian releases of the aggregate, accounted as the engine
    does (:func:`fl.privacy.accounting.client_level_event`): Poisson with amplification;
    every client every round; or a fixed count drawn without replacement, sensitivity 2C
    under add/remove (multiplier σ/2)."""
    found: list[Finding] = []
    cs = p["client_sampling"]
    K = int(cs["total_clients"])
    m_cl = float(cs["clients_per_round"])
    if cs["scheme"] == "poisson":
        scheme = "poisson" if m_cl < K else "all"
    else:
        scheme = "uniform" if round(m_cl) < K else "all"
    releases = client_releases(method, cfg)
    if releases is None:
        by_round: dict[int, int] = {}
        for e in stated.ledger.events:
            by_round[e.round] = by_round.get(e.round, 0) + e.count
        releases = max(by_round.values(), default=1)
        found.append(
            Finding(
                Code.RELEASES_FROM_LEDGER,
                f"Method {method!r} is unknown here; {releases} release(s) per round were "
                f"read from the ledger.",
            )
        )
    # The server releases every round, an empty cohort included (skipping would
    # reveal that no client was sampled), so every completed round counts.
    count = releases * part.rounds_done
    m_eff = K if scheme == "all" else (round(m_cl) if scheme == "uniform" else m_cl)
    ev = client_level_event(scheme, m_eff, K, stated.sigma, max(count, 0))
    eps = _eps_pair([ev] if count else [], stated.delta)
    return ConfigEpsilon(eps, {"federation": count}, ev.noise_multiplier, K, "clients"), found


def consistency_findings(stated: Stated, cfg: dict, ce: ConfigEpsilon) -> list[Finding]:
    """σ of the configuration, the block and the ledger agree; σ > 0 for a finite ε; the
    ledger has the steps the rounds and participants imply; δ < 1/n."""
    found: list[Finding] = []
    sigma, ledger = stated.sigma, stated.ledger
    cfg_sigma = cfg.get("noise_multiplier")
    if (
        not (cfg.get("epsilon") or 0) > 0
        and isinstance(cfg_sigma, int | float)
        and abs(float(cfg_sigma) - sigma) > 1e-12
    ):
        found.append(
            Finding(
                Code.SIGMA_MISMATCH,
                f"The configuration sets σ = {cfg_sigma:g}, but the privacy block records "
                f"σ = {sigma:g}.",
            )
        )
    ev_sigmas = sorted({e.noise_multiplier for e in ledger.events})
    if stated.client_sigmas and abs(max(stated.client_sigmas.values()) - sigma) > 1e-12:
        found.append(
            Finding(
                Code.SIGMA_MISMATCH,
                f"The privacy block records σ = {sigma:g}, but the largest per-client σ is "
                f"{max(stated.client_sigmas.values()):g}.",
            )
        )
    if ce.unit_sigmas:
        wrong = sorted(
            {
                (e.unit, e.noise_multiplier)
                for e in ledger.events
                if abs(e.noise_multiplier - ce.unit_sigmas.get(e.unit, ce.event_sigma)) > 1e-12
            }
        )
        if wrong:
            found.append(
                Finding(
                    Code.SIGMA_MISMATCH,
                    "The ledger's events use σ "
                    + ", ".join(
                        f"{s:g} for {u} (recorded σ {ce.unit_sigmas.get(u, ce.event_sigma):g})"
                        for u, s in wrong[:5]
                    )
                    + ".",
                )
            )
    elif ev_sigmas and any(abs(s - ce.event_sigma) > 1e-12 for s in ev_sigmas):
        expected = ce.event_sigma
        found.append(
            Finding(
                Code.SIGMA_MISMATCH,
                f"The ledger's events use σ = {', '.join(f'{s:g}' for s in ev_sigmas)}, but the "
                f"privacy block records σ = {sigma:g}"
                + (f" (events of multiplier {expected:g} expected)" if expected != sigma else "")
                + ".",
            )
        )
    stated_pld = stated.epsilon["pld"]
    if (sigma == 0.0 or 0.0 in ev_sigmas) and any(
        isinstance(s, int | float) and math.isfinite(s) for s in stated.epsilon.values()
    ):
        found.append(
            Finding(
                Code.NOISE_NOT_APPLIED,
                f"A noise multiplier of 0 is recorded (privacy block σ = {sigma:g}; ledger σ "
                f"{', '.join(f'{s:g}' for s in ev_sigmas) or 'none'}) yet the run states a "
                f"finite ε = {fmt_eps(stated_pld)}: without noise the release is not private "
                "(ε = inf).",
            )
        )
    found += _ledger_count_findings(ledger, ce.implied)
    if stated.delta >= 1.0 / ce.population:
        found.append(
            Finding(
                Code.DELTA_TOO_LARGE,
                f"δ = {stated.delta:g} is at least 1/n = {1.0 / ce.population:.3g} "
                f"(n = {ce.population} {ce.unit_name}).",
            )
        )
    return found


def _ledger_count_findings(ledger: Ledger, implied: dict) -> list[Finding]:
    found: list[Finding] = []
    counts: dict[str, int] = {}
    for e in ledger.events:
        counts[e.unit] = counts.get(e.unit, 0) + e.count
    short = {u: (counts.get(u, 0), n) for u, n in implied.items() if counts.get(u, 0) < n}
    if short:
        desc = "; ".join(f"{u}: {have} of {need}" for u, (have, need) in sorted(short.items()))
        found.append(
            Finding(
                Code.LEDGER_INCOMPLETE,
                "The ledger records fewer DP steps than the rounds and participants imply "
                f"({desc}).",
            )
        )
    extra = {u: n for u, n in counts.items() if n > implied.get(u, 0)}
    if extra:
        found.append(
            Finding(
                Code.LEDGER_EXTRA_EVENTS,
                "The ledger records more DP steps than one training call per round implies ("
                + "; ".join(f"{u}: {n} vs {implied.get(u, 0)}" for u, n in sorted(extra.items()))
                + "); they are included in the ledger ε.",
            )
        )
    return found


@dataclass(frozen=True)
class PrivacyAudit:
    """The outcome: stated vs recomputed ε (the larger of ledger and config per accountant)."""

    stated: Stated
    ledger_eps: dict
    config_eps: dict
    recomputed: dict
    understated: bool
    findings: tuple = ()
    skipped: tuple = field(default=())

    def fields(self) -> dict:
        """The fields of :func:`audit.bundle.audit.audit_run`'s result this audit fills."""
        s_pld = self.stated.epsilon["pld"]
        return dict(
            claimed_epsilon=s_pld,
            delta=self.stated.delta,
            epsilon_pld=self.recomputed["pld"],
            epsilon_rdp=self.recomputed["rdp"],
            understated=self.understated,
            ratio=(
                self.recomputed["pld"] / s_pld
                if isinstance(s_pld, int | float) and s_pld > 0
                else None
            ),
            stored=dict(self.stated.epsilon),
            recomputed={"ledger": self.ledger_eps, "config": self.config_eps},
            sigma=self.stated.sigma,
        )


def compare(stated: Stated, ce: ConfigEpsilon, ledger_incomplete: bool):
    """Stated ε against the recomputation; returns (recomputed, understated, findings)."""
    found: list[Finding] = []
    ledger = stated.ledger
    if ledger.delta != stated.delta:
        # a larger ledger δ would lower the ledger's ε: recompute at the smaller δ
        found.append(
            Finding(
                Code.DELTA_MISMATCH,
                f"The ledger's δ ({ledger.delta:g}) differs from privacy.delta "
                f"({stated.delta:g}); its ε is recomputed at the smaller δ.",
            )
        )
        ledger = dataclasses.replace(ledger, delta=min(ledger.delta, stated.delta))
    ledger_eps = {a: ledger.epsilon(a) for a in ACCOUNTANTS}
    recomputed = {a: max(ledger_eps[a], ce.epsilon[a]) for a in ACCOUNTANTS}
    understated = False
    for a in ACCOUNTANTS:
        s = stated.epsilon[a]
        if s == "inf":  # written by fl.run.rundir.jsonable: claims no finite ε, understates nothing
            continue
        if isinstance(s, int | float) and not isinstance(s, bool) and not (s >= 0):
            understated = True  # NaN or negative: no claim a recomputation can be held to
            found.append(
                Finding(
                    Code.EPSILON_INVALID,
                    f"The run states ε = {s!r} ({a.upper()}, privacy.epsilon.{a}): not a number "
                    f">= 0, so it claims nothing that can be checked; its mechanism gives ε = "
                    f"{fmt_eps(recomputed[a])}.",
                )
            )
        elif not isinstance(s, int | float) or isinstance(s, bool):
            understated = True
            found.append(
                Finding(
                    Code.EPSILON_MISSING,
                    f"The run states no {a.upper()} ε (privacy.epsilon.{a}) for a DP run; it "
                    f"recomputes to ε = {fmt_eps(recomputed[a])}.",
                )
            )
        elif recomputed[a] > float(s) * (1.0 + UNDERSTATE_TOLERANCE):
            understated = True
            found.append(
                Finding(
                    Code.EPSILON_UNDERSTATED,
                    f"The run states ε = {fmt_eps(float(s))} ({a.upper()}), but its mechanism "
                    f"gives ε = {fmt_eps(recomputed[a])} (ledger {fmt_eps(ledger_eps[a])}, "
                    f"config {fmt_eps(ce.epsilon[a])}) at δ = {stated.delta:g}: understated "
                    f"by a factor {recomputed[a] / float(s) if s else math.inf:.3g}.",
                )
            )
    over = [
        a
        for a in ACCOUNTANTS
        if isinstance(stated.epsilon[a], int | float)
        and not isinstance(stated.epsilon[a], bool)
        and math.isfinite(stated.epsilon[a])
        and stated.epsilon[a] > recomputed[a] * (1.0 + UNDERSTATE_TOLERANCE) + 1e-12
    ]
    if over:
        found.append(
            Finding(
                Code.EPSILON_OVERSTATED,
                "The run states more ε than its mechanism gives ("
                + "; ".join(
                    f"{a.upper()}: stated {fmt_eps(stated.epsilon[a])}, recomputed "
                    f"{fmt_eps(recomputed[a])}"
                    for a in over
                )
                + "): a conservative claim, but not the one the run computed (the engine "
                "states the ledger's ε).",
            )
        )
    if ce.epsilon["pld"] > ledger_eps["pld"] * (1 + UNDERSTATE_TOLERANCE) and not ledger_incomplete:
        found.append(
            Finding(
                Code.LEDGER_BELOW_CONFIG,
                f"The configuration implies ε = {fmt_eps(ce.epsilon['pld'])} (PLD), more than "
                f"the ledger's {fmt_eps(ledger_eps['pld'])}.",
            )
        )
    return ledger_eps, recomputed, understated, found


def audit_privacy(
    run, m: dict, splits: dict | None, rows: list[dict] | None, bundle: bool
) -> PrivacyAudit:
    """Recompute a DP run's ε from its ledger and from its configuration; check both
    against the privacy block (σ, steps, δ) and the stated ε."""
    cfg, p = m["config"], m["privacy"]
    stated = Stated.read(p)
    found: list[Finding] = []
    skipped: list = []
    if bundle:
        part, skipped = bundle_participation(cfg, p, stated.ledger, rows)
    else:
        part, more = run_participation(run, cfg, p, splits, rows)
        found += more
    if stated.level == "sample":
        ce = sample_level_epsilon(stated, cfg, part)
    else:
        ce, more = client_level_epsilon(stated, p, m["method"], cfg, part)
        found += more
    found += consistency_findings(stated, cfg, ce)
    incomplete = any(f.code is Code.LEDGER_INCOMPLETE for f in found)
    ledger_eps, recomputed, understated, more = compare(stated, ce, incomplete)
    found += more
    return PrivacyAudit(
        stated, ledger_eps, ce.epsilon, recomputed, understated, tuple(found), tuple(skipped)
    )
