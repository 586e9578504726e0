"""Privacy accounting: a persistent ledger of DP events, ε by PLD (headline) and RDP.

Every noisy release made by the engine is recorded as one :class:`Event`. An event
belongs to an *accounting unit*: for sample-level DP the unit is the client whose
examples were used (an example lives on exactly one client, so the guarantee for an
example is the composition of the events of its client); for client-level DP the
unit is the whole federation (every round's release touches every client).
The ledger's ε is the maximum over units of the composed ε — the guarantee that
holds for every example (sample level) or every client (client level).

ε is derived from the events, never stored as the truth: :func:`epsilon_of_events`
recomputes it with `dp_accounting` each time it is asked for.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import dp_accounting
from dp_accounting import pld, rdp

from fl.errors import UsageError

# dp_accounting's RDP code warns (via absl) for every order whose series does not
# converge and is then excluded — expected and harmless, but floods the terminal.
logging.getLogger("absl").setLevel(logging.ERROR)

ACCOUNTANTS = ("pld", "rdp")
EVENT_KINDS = ("poisson_gaussian", "gaussian")
LEDGER_VERSION = 1

# PLD discretization: the estimate is pessimistic (an upper bound), the interval
# trades speed for tightness. 1e-4 is dp_accounting's default.
_PLD_DISCRETIZATION = 1e-4


class PrivacyError(UsageError):
    """Invalid privacy parameters or a request that would break the budget."""


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, int | float) and math.isfinite(delta) and 0.0 < delta < 1.0):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")


def _check_sigma(sigma: float) -> None:
    if not (isinstance(sigma, int | float) and not math.isnan(sigma) and sigma >= 0.0):
        raise PrivacyError(f"noise multiplier must be >= 0, got {sigma!r}")


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
        if not isinstance(self.count, int) or self.count < 0:
            raise PrivacyError(f"event count must be a non-negative int, got {self.count!r}")

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


def _compact(events: Iterable[Event]) -> list[tuple[Event, int]]:
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
    _check_delta(delta)
    merged = _compact(events)
    if not merged:
        return 0.0
    if any(e.noise_multiplier == 0.0 for e, _ in merged):
        return math.inf
    acc = _make_accountant(accountant, discretization)
    acc.compose(dp_accounting.ComposedDpEvent([e.to_dp_event() for e, _ in merged]))
    eps = float(acc.get_epsilon(delta))
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
    _check_delta(delta)
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


@dataclass
class Ledger:
    """Persistent, append-only record of every DP release of a run.

    ``level`` is ``sample`` or ``client``; ``delta`` the target δ. The ledger is the
    source of truth: ε is recomputed from the events (:meth:`epsilon`).
    """

    level: str
    delta: float
    events: list[Event] = field(default_factory=list)
    budget: float | None = None  # target ε; None = no budget enforced

    def __post_init__(self) -> None:
        if self.level not in ("sample", "client", "none"):
            raise PrivacyError(f"ledger level must be sample|client|none, got {self.level!r}")
        _check_delta(self.delta)
        self._cache: dict = {}

    def record(self, event: Event) -> None:
        self.events.append(event)
        self._cache.clear()

    def units(self) -> list[str]:
        return sorted({e.unit for e in self.events})

    def epsilon_by_unit(self, accountant: str = "pld", events=None) -> dict[str, float]:
        evs = self.events if events is None else events
        by_unit: dict[str, list[Event]] = {}
        for e in evs:
            by_unit.setdefault(e.unit, []).append(e)
        memo: dict[tuple, float] = {}
        out: dict[str, float] = {}
        for u in sorted(by_unit):
            # Units with identical mechanisms (after merging) have identical ε: compute once.
            sig = tuple(
                (e.kind, e.noise_multiplier, e.sample_rate, c) for e, c in _compact(by_unit[u])
            )
            if sig not in memo:
                memo[sig] = epsilon_of_events(by_unit[u], self.delta, accountant)
            out[u] = memo[sig]
        return out

    def epsilon(self, accountant: str = "pld") -> float:
        """max over accounting units of the composed ε (0.0 for an empty ledger)."""
        key = (accountant, len(self.events))
        if key not in self._cache:
            by_unit = self.epsilon_by_unit(accountant)
            self._cache[key] = max(by_unit.values(), default=0.0)
        return self._cache[key]

    def would_exceed(self, new_events: list[Event], accountant: str = "pld") -> bool:
        """True if adding ``new_events`` would push ε past the budget (non-mutating)."""
        if self.budget is None:
            return False
        units = {e.unit for e in new_events}
        for u in units:
            evs = [e for e in self.events if e.unit == u] + [e for e in new_events if e.unit == u]
            if epsilon_of_events(evs, self.delta, accountant) > self.budget * (1 + 1e-9):
                return True
        return False

    def state_dict(self) -> dict:
        return {
            "version": LEDGER_VERSION,
            "level": self.level,
            "delta": self.delta,
            "budget": self.budget,
            "events": [e.to_dict() for e in self.events],
        }

    @classmethod
    def from_state_dict(cls, d: dict) -> Ledger:
        if not isinstance(d, dict):
            raise PrivacyError("ledger must be a JSON object")
        if d.get("version") != LEDGER_VERSION:
            raise PrivacyError(f"unsupported ledger version {d.get('version')!r}")
        for k in ("level", "delta", "events"):
            if k not in d:
                raise PrivacyError(f"ledger is missing field {k!r}")
        if not isinstance(d["events"], list):
            raise PrivacyError("ledger field 'events' must be a list")
        budget = d.get("budget")
        if budget is not None and not (isinstance(budget, int | float) and budget > 0):
            raise PrivacyError(f"ledger field 'budget' must be > 0 or null, got {budget!r}")
        return cls(
            level=d["level"],
            delta=d["delta"],
            events=[Event.from_dict(e) for e in d["events"]],
            budget=budget,
        )
