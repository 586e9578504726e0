"""The ledger of a run: the persistent, append-only record of its DP events
(:class:`fl.privacy.accounting.Event`), from which ε is recomputed whenever it is asked for
(the maximum over accounting units of the composed ε), with an optional budget that
:meth:`Ledger.would_exceed` checks before a release, and its versioned JSON form
(:meth:`Ledger.state_dict`, :meth:`Ledger.from_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fl.privacy.accounting import (
    NEIGHBOURING,
    Event,
    PrivacyError,
    check_delta,
    compact,
    epsilon_of_events,
)

__all__ = ["LEDGER_VERSION", "Ledger"]

#: ledger documents carry ``version: 1``; the optional ``neighbouring`` field was added
#: without a bump (a reader that ignores it computes the same ε from the same events)
LEDGER_VERSION = 1


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
        check_delta(self.delta)
        self._cache: dict = {}

    @property
    def neighbouring(self) -> str | None:
        """The neighbouring relation of this ledger's ε (None for level ``none``)."""
        return NEIGHBOURING.get(self.level)

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
                (e.kind, e.noise_multiplier, e.sample_rate, c) for e, c in compact(by_unit[u])
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
            "neighbouring": self.neighbouring,
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
        # ``neighbouring`` is optional (ledgers written before it existed lack it); when
        # present it must be the relation this code accounts that level under.
        level = d["level"]
        if "neighbouring" in d and isinstance(level, str):
            want = NEIGHBOURING.get(level)
            if d["neighbouring"] != want:
                raise PrivacyError(
                    f"ledger states the neighbouring relation {d['neighbouring']!r}, but a "
                    f"{level!r}-level ledger is accounted under {want!r}"
                )
        budget = d.get("budget")
        if budget is not None and not (isinstance(budget, int | float) and budget > 0):
            raise PrivacyError(f"ledger field 'budget' must be > 0 or null, got {budget!r}")
        return cls(
            level=d["level"],
            delta=d["delta"],
            events=[Event.from_dict(e) for e in d["events"]],
            budget=budget,
        )
