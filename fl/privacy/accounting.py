"""Privacy accounting: DP events, ε by PLD (headline) and RDP, noise calibration.

Every noisy release made by the engine is recorded as one :class:`Event` in the run's
persistent ledger (:class:`fl.privacy.ledger.Ledger`). An event
belongs to an *accounting unit*: for sample-level DP the unit is the client whose
examples were used (an example lives on exactly one client, so the guarantee for an
example is the composition of the events of its client); for client-level DP the
unit is the whole federation (every round's release touches every client).
The ledger's ε is the maximum over units of the composed ε — the guarantee that
holds for every example (sample level) or every client (client level).

ε is derived from the events, never stored as the truth: :func:`epsilon_of_events`
recomputes it with `dp_accounting` each time it is asked for.

Neighbouring relation (:data:`NEIGHBOURING`): every ε here is for *add/remove* —
datasets D and D ∪ {x} are neighbours, where x is ONE example at sample level and ONE
client (with all of its data) at client level. The mechanisms are accounted under that
relation: the Poisson-subsampled Gaussian is the standard add/remove analysis; a plain
Gaussian of multiplier σ assumes that adding x changes the released sum by at most one
clipped contribution C. Where adding x can also *displace* another contribution (a cohort
or batch of a fixed size), the sum changes by up to 2C, and the event carries the
multiplier σ/2 (see :func:`client_level_event`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import dp_accounting
from dp_accounting import pld, rdp

from fl.errors import UsageError

# dp_accounting's RDP code warns (via absl) for every order whose series does not
# converge and is then excluded — expected and harmless, but floods the terminal.
logging.getLogger("absl").setLevel(logging.ERROR)

ACCOUNTANTS = ("pld", "rdp")
EVENT_KINDS = ("poisson_gaussian", "gaussian")

#: The neighbouring relation every ε of a ledger of that level is stated under.
NEIGHBOURING = {"sample": "add/remove one example", "client": "add/remove one client"}

#: Client sampling schemes of :func:`client_level_event`: ``all`` = every client every
#: round; ``poisson`` = each client independently with probability q; ``uniform`` = a
#: cohort of a fixed count m drawn uniformly without replacement.
CLIENT_SCHEMES = ("all", "poisson", "uniform")
FIXED_COUNT_NOTE = "fixed-count cohort: sensitivity 2C under add/remove, no amplification"

# PLD discretization: the estimate is pessimistic (an upper bound), the interval
# trades speed for tightness. 1e-4 is dp_accounting's default.
_PLD_DISCRETIZATION = 1e-4


class PrivacyError(UsageError):
    """Invalid privacy parameters or a request that would break the budget."""


def check_delta(delta: float) -> None:
    """PrivacyError unless δ is a number in (0, 1)."""
    if not (isinstance(delta, int | float) and math.isfinite(delta) and 0.0 < delta < 1.0):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")


#: the largest noise multiplier an event may carry: beyond it ε is ~0 for any count the
#: accountants can compose, and the accountants overflow long before σ reaches a float's
#: range (σ = 1e300 raised OverflowError in dp_accounting)
MAX_NOISE_MULTIPLIER = 1e6


def _check_sigma(sigma: float) -> None:
    if not (
        isinstance(sigma, int | float)
        and not isinstance(sigma, bool)
        and math.isfinite(sigma)
        and 0.0 <= sigma <= MAX_NOISE_MULTIPLIER
    ):
        raise PrivacyError(
            f"noise multiplier must be a number in [0, {MAX_NOISE_MULTIPLIER:g}], got {sigma!r}"
        )


def _check_rate(q: float) -> None:
    if not (isinstance(q, int | float) and math.isfinite(q) and 0.0 < q <= 1.0):
        raise PrivacyError(f"sample rate must be in (0, 1], got {q!r}")


@dataclass(frozen=True)
class Event:
    """One (possibly self-composed) DP release.

    kind: ``poisson_gaussian`` — the subsampled Gaussian mechanism of DP-SGD: each
      record is included independently with probability ``sample_rate``, the sum of
      clipped contributions gets N(0, (σC)²) noise; ``gaussian`` — the plain Gaussian
      mechanism (no subsampling amplification, ``sample_rate`` must be 1).
    noise_multiplier: σ = noise std / ℓ2 sensitivity (unitless).
    count: number of identical releases composed (e.g. local DP-SGD steps).
    unit: accounting unit (client id for sample-level DP, ``federation`` for client level).
    """

    kind: str
    noise_multiplier: float
    sample_rate: float
    count: int
    unit: str
    round: int = -1
    stage: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise PrivacyError(f"unknown event kind {self.kind!r}; expected one of {EVENT_KINDS}")
        _check_sigma(self.noise_multiplier)
        _check_rate(self.sample_rate)
        if self.kind == "gaussian" and self.sample_rate != 1.0:
            raise PrivacyError("a 'gaussian' event has no subsampling: sample_rate must be 1")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise PrivacyError(f"event count must be a non-negative int, got {self.count!r}")
        if not isinstance(self.unit, str):
            raise PrivacyError(f"event unit must be a string, got {self.unit!r}")
        if not isinstance(self.round, int) or isinstance(self.round, bool):
            raise PrivacyError(f"event round must be an int, got {self.round!r}")
        if not isinstance(self.stage, str) or not isinstance(self.note, str):
            raise PrivacyError("event stage and note must be strings")

    def to_dp_event(self) -> dp_accounting.DpEvent:
        if self.count == 0:
            return dp_accounting.NoOpDpEvent()
        if self.noise_multiplier == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        inner: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.kind == "poisson_gaussian" and self.sample_rate < 1.0:
            inner = dp_accounting.PoissonSampledDpEvent(self.sample_rate, inner)
        return dp_accounting.SelfComposedDpEvent(inner, self.count)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Event:
        if not isinstance(d, dict):
            raise PrivacyError(f"ledger event must be an object, got {type(d).__name__}")
        missing = {"kind", "noise_multiplier", "sample_rate", "count", "unit"} - set(d)
        if missing:
            raise PrivacyError(f"ledger event is missing field(s): {sorted(missing)}")
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as exc:  # pragma: no cover - defensive
            raise PrivacyError(f"bad ledger event: {exc}") from exc


def _make_accountant(accountant: str, discretization: float = _PLD_DISCRETIZATION):
    if accountant == "pld":
        return pld.PLDAccountant(value_discretization_interval=discretization)
    if accountant == "rdp":
        return rdp.RdpAccountant()  # dp_accounting's default orders
    raise PrivacyError(f"unknown accountant {accountant!r}; expected one of {ACCOUNTANTS}")


def compact(events: Iterable[Event]) -> list[tuple[Event, int]]:
    """Merge identical mechanisms (kind, σ, q) by summing counts: composition is
    commutative, so this is exact and keeps PLD fast for long runs."""
    counts: Counter = Counter()
    for e in events:
        if e.count:
            counts[(e.kind, e.noise_multiplier, e.sample_rate)] += e.count
    return [
        (Event(kind=k, noise_multiplier=s, sample_rate=q, count=c, unit="_"), c)
        for (k, s, q), c in sorted(counts.items())
    ]


def epsilon_of_events(
    events: Iterable[Event],
    delta: float,
    accountant: str = "pld",
    discretization: float = _PLD_DISCRETIZATION,
) -> float:
    """ε(δ) of the composition of ``events`` (one accounting unit). inf if any is non-private."""
    check_delta(delta)
    merged = compact(events)
    if not merged:
        return 0.0
    if any(e.noise_multiplier == 0.0 for e, _ in merged):
        return math.inf
    key = tuple((e.kind, e.noise_multiplier, e.sample_rate, c) for e, c in merged)
    return _epsilon_of_mechanisms(key, float(delta), accountant, float(discretization))


@functools.lru_cache(maxsize=4096)
def _epsilon_of_mechanisms(
    mechs: tuple, delta: float, accountant: str, discretization: float
) -> float:
    """ε(δ) of merged mechanisms ((kind, σ, q, count), ...): a pure function, memoized
    (the clients of a round usually share one mechanism, and every round's report and
    budget check recompose the same history)."""
    acc = _make_accountant(accountant, discretization)
    acc.compose(
        dp_accounting.ComposedDpEvent(
            [Event(k, s, q, c, unit="_").to_dp_event() for k, s, q, c in mechs]
        )
    )
    eps = float(acc.get_epsilon(delta))
    if accountant == "pld" and not eps > 0.0:
        # PLD's grid rounds a tiny privacy loss (σ ≳ 1e5) to ε = 0; a positive σ is never
        # perfectly private, so report RDP's figure (an upper bound) rather than understate
        return _epsilon_of_mechanisms(mechs, delta, "rdp", discretization)
    return max(eps, 0.0)


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    discretization: float = _PLD_DISCRETIZATION,
) -> float:
    """ε(δ) of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism.

    sample_rate = 1 means no subsampling (plain Gaussian mechanism per step).
    """
    _check_sigma(noise_multiplier)
    _check_rate(sample_rate)
    if not isinstance(steps, int) or steps < 0:
        raise PrivacyError(f"steps must be a non-negative int, got {steps!r}")
    kind = "poisson_gaussian" if sample_rate < 1.0 else "gaussian"
    ev = Event(kind, float(noise_multiplier), float(sample_rate), steps, unit="_")
    return epsilon_of_events([ev], delta, accountant, discretization)


def calibrate_noise(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    tol: float = 1e-3,
) -> float:
    """Smallest σ (to relative tolerance ``tol``) with ε(σ) <= target_epsilon.

    Binary search on σ; the returned σ is always the upper end of the bracket, so the
    achieved ε never exceeds the target (ε is decreasing in σ). The search runs on a
    coarser PLD grid for speed; the result is then verified with the reporting grid
    and nudged up until it passes, so the guarantee holds for the reported figure.
    """
    if not (
        isinstance(target_epsilon, int | float)
        and math.isfinite(target_epsilon)
        and target_epsilon > 0
    ):
        raise PrivacyError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    check_delta(delta)
    _check_rate(sample_rate)
    if not isinstance(steps, int) or steps <= 0:
        raise PrivacyError(f"steps must be a positive int, got {steps!r}")

    def eps(s: float) -> float:
        return epsilon(s, sample_rate, steps, delta, accountant, discretization=1e-3)

    hi = 1.0
    while eps(hi) > target_epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise PrivacyError("could not calibrate noise: target epsilon unreachable")
    lo = hi / 2.0
    while lo > 1e-4 and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    while (hi - lo) / hi > tol:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    while epsilon(hi, sample_rate, steps, delta, accountant) > target_epsilon:
        hi *= 1.0 + tol
    return hi


def _client_scheme(scheme: str, clients_per_round: float, total_clients: int) -> tuple[str, float]:
    """Validate a client-sampling description; return (mechanism, q).

    mechanism: ``poisson`` (Poisson-subsampled at q < 1), ``plain`` (every client every
    round: one Gaussian at sensitivity C) or ``fixed`` (a fixed-count cohort m < K:
    sensitivity 2C).
    """
    if scheme not in CLIENT_SCHEMES:
        raise PrivacyError(
            f"unknown client sampling scheme {scheme!r}; expected one of {CLIENT_SCHEMES}"
        )
    if isinstance(total_clients, bool) or not isinstance(total_clients, int) or total_clients < 1:
        raise PrivacyError(f"total_clients must be an int >= 1, got {total_clients!r}")
    if scheme == "all":
        return "plain", 1.0
    m = clients_per_round
    if (
        isinstance(m, bool)
        or not isinstance(m, int | float)
        or not math.isfinite(m)
        or not 0 < m <= total_clients
    ):
        raise PrivacyError(
            f"clients_per_round must be in (0, total_clients = {total_clients}], got {m!r}"
        )
    if scheme == "poisson":
        q = m / total_clients
        return ("poisson", q) if q < 1.0 else ("plain", 1.0)
    if not float(m).is_integer():
        raise PrivacyError(
            f"a 'uniform' cohort has a whole number of clients, got clients_per_round = {m!r}"
        )
    return ("fixed", 1.0) if m < total_clients else ("plain", 1.0)


def client_level_event(
    scheme: str,
    clients_per_round: float,
    total_clients: int,
    sigma: float,
    count: int,
    *,
    round: int = -1,
    stage: str = "",
    note: str = "",
) -> Event:
    """The ledger event of ``count`` client-level Gaussian releases of one round.

    A release is Σ_{i ∈ cohort} clip_C(u_i) + N(0, (σC)² I), every client update clipped to
    ℓ2 norm C. Neighbouring relation: add/remove ONE client (:data:`NEIGHBOURING`):
    D and D' = D ∪ {x}, where D holds K = ``total_clients`` clients.

    Args:
        scheme: how the round's cohort is drawn (:data:`CLIENT_SCHEMES`):

          * ``"poisson"`` — each client independently with probability
            q = clients_per_round / total_clients. For q < 1 the event is the
            Poisson-subsampled Gaussian at σ (the standard add/remove analysis: x is in
            the cohort with probability q and then adds one clipped update). q = 1 is
            ``"all"``.
          * ``"all"`` — every client every round: a plain Gaussian of multiplier σ (adding
            x adds exactly one clipped update, sensitivity C). ``clients_per_round`` is
            not used.
          * ``"uniform"`` — a cohort of a fixed count m = ``clients_per_round`` (a whole
            number) drawn uniformly without replacement. For m < K the event is a plain
            Gaussian of multiplier **σ/2**: sensitivity 2C, no amplification —
            derivation below. m = K is read as ``"all"``: the cohort is then taken to be
            the whole federation whatever its size, so an added client is added, not
            swapped in (a count that stayed K on a federation of K + 1 would be the
            fixed-count case; callers for whom that can happen should account it so).
        clients_per_round: m (``uniform``) or the expected cohort size (``poisson``), in
            (0, total_clients].
        total_clients: K >= 1.
        sigma: the multiplier the noise is drawn with (noise std / C), >= 0.
        count: Gaussian releases composed in this round (>= 0).
        round, stage, note: recorded on the event (the fixed-count note is appended).

    Returns:
        An :class:`Event` with ``unit="federation"``.

    Raises:
        PrivacyError: unknown scheme, σ < 0 or NaN, a cohort outside (0, K], a non-whole
            ``uniform`` count, a negative count.

    Why σ/2 for a fixed-count cohort (m < K). Under add/remove an added client can
    *displace* another from the fixed-size cohort, so the released sum can change by a
    replacement. Couple the cohorts S of D and S' of D ∪ {x}: draw S uniformly among the
    m-subsets of D and B ~ Bernoulli(m / (K + 1)); if B = 0 let S' = S (given x ∉ S',
    the cohort of D ∪ {x} is a uniform m-subset of D: the two coincide in distribution);
    if B = 1 let S' = S − {y} ∪ {x} with y uniform in S (given x ∈ S', the rest is a
    uniform (m − 1)-subset of D, which S − {y} is). S' then has exactly the distribution
    of the cohort of D ∪ {x}, and under the coupling the two sums differ by 0 or by
    clip(u_x) − clip(u_y), of norm at most 2C. Both outputs are mixtures over the same
    coupling — M(D) = E[N(f(S), σ²C²)], M(D ∪ {x}) = E[N(f(S'), σ²C²)] — and the
    hockey-stick divergence H_α(P‖Q) = sup_A P(A) − α Q(A) is jointly convex in (P, Q),
    so for every α ≥ 1 and in both directions
    H_α(M(D)‖M(D ∪ {x})) ≤ E[H_α(N(f(S))‖N(f(S')))] ≤ H_α(N(0, σ²C²)‖N(2C, σ²C²)),
    which is the privacy profile of a Gaussian of multiplier σC / 2C = σ/2. The Gaussian
    pair is therefore a dominating pair of each round and adaptive composition over
    rounds composes those pairs. The bound grants no amplification (the mixture weight
    of B = 0 would give some; it is not claimed). dp_accounting's
    ``SampledWithoutReplacementDpEvent`` is not used: its RDP analysis assumes the
    REPLACE_ONE relation (the RDP accountant refuses it under ADD_OR_REMOVE_ONE, and the
    PLD accountant does not support it), so it does not give the add/remove headline.
    """
    mech, q = _client_scheme(scheme, clients_per_round, total_clients)
    _check_sigma(sigma)
    if mech == "poisson":
        return Event("poisson_gaussian", float(sigma), q, count, "federation", round, stage, note)
    if mech == "plain":
        return Event("gaussian", float(sigma), 1.0, count, "federation", round, stage, note)
    full = f"{note}; {FIXED_COUNT_NOTE}" if note else FIXED_COUNT_NOTE
    return Event("gaussian", float(sigma) / 2.0, 1.0, count, "federation", round, stage, full)


def calibrate_client_level(
    target_epsilon: float,
    scheme: str,
    clients_per_round: float,
    total_clients: int,
    releases: int,
    delta: float,
    accountant: str = "pld",
    tol: float = 1e-3,
) -> float:
    """Smallest σ (to relative tolerance ``tol``) whose ``releases`` client-level releases,
    accounted as :func:`client_level_event` does, give ε <= ``target_epsilon``.

    ``releases`` is the total over the run (releases per round × rounds). Poisson at
    q < 1: :func:`calibrate_noise` at q. ``all`` (and a ``uniform`` cohort of every
    client): :func:`calibrate_noise` of the plain Gaussian. A fixed-count cohort m < K is
    accounted at σ/2, so σ = 2 × the calibrated plain-Gaussian multiplier (the event's
    σ/2 is then exactly that multiplier, so the verified ε carries over).

    Raises:
        PrivacyError: as :func:`client_level_event` and :func:`calibrate_noise`.
    """
    mech, q = _client_scheme(scheme, clients_per_round, total_clients)
    s = calibrate_noise(target_epsilon, q, releases, delta, accountant, tol)
    return 2.0 * s if mech == "fixed" else s
