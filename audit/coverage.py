"""No pass without a test: the four parts of a DP mechanism and what tested each.

An audit may say ``pass`` only when each part of the mechanism the claim rests on was
tested by some instrument:

* ``sampling`` — the batches (or cohorts) are drawn as the claim's accounting assumes;
* ``clipping`` — a record (or client) adds at most the declared sensitivity;
* ``noise`` — the noise added is the claimed N(0, σ²C²), fresh at every release;
* ``accounting`` — ε recomputed for the mechanism that ran is within the claim.

The instruments are the canaries (statistical: conformance, sampling and one-run tests),
the neighbour replay (deterministic: :mod:`audit.replay`), and the claim check (ε
recomputed). A part no instrument reached makes the verdict ``incomplete`` (exit code
:data:`EXIT_INCOMPLETE`), never ``pass``; an error finding makes it ``fail`` (exit 1)
whatever was tested. :class:`Coverage` collects who tested what; :func:`decide` gives the
verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "PARTS",
    "VERDICTS",
    "EXIT_CODES",
    "EXIT_INCOMPLETE",
    "Coverage",
    "decide",
    "exit_code",
]

#: the parts of a DP mechanism every audit must test before it can say ``pass``
PARTS = ("sampling", "clipping", "noise", "accounting")
#: the verdicts of a library, script or run audit, from the best
VERDICTS = ("pass", "incomplete", "fail")
#: exit code of an incomplete audit (0 pass, 1 fail, 2 bad input, 3 stopped by STOP)
EXIT_INCOMPLETE = 4
EXIT_CODES = {"pass": 0, "fail": 1, "incomplete": EXIT_INCOMPLETE}


def exit_code(verdict: str) -> int:
    """The CLI's exit code for ``verdict`` (``pass`` 0, ``fail`` 1, ``incomplete`` 4)."""
    try:
        return EXIT_CODES[verdict]
    except KeyError:
        raise ValueError(f"unknown verdict {verdict!r}; expected one of {VERDICTS}") from None


@dataclass
class Coverage:
    """Which instrument tested which part: ``tested[part]`` lists instrument names
    (``"canaries"``, ``"replay"``, ``"claim check"``, ...); ``why[part]`` says why a part
    was not tested (shown in the verdict). A part may be declared not applicable
    (``not_applicable[part]`` = reason), e.g. sampling for a run with full batches."""

    tested: dict[str, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)

    def add(self, part: str, instrument: str) -> Coverage:
        """Record that ``instrument`` tested ``part``."""
        _check_part(part)
        got = self.tested.setdefault(part, [])
        if instrument not in got:
            got.append(instrument)
        return self

    def skip(self, part: str, why: str) -> Coverage:
        """Record why ``part`` was not tested by some instrument (kept only while no
        instrument tested it)."""
        _check_part(part)
        self.why.setdefault(part, why)
        return self

    def inapplicable(self, part: str, why: str) -> Coverage:
        """``part`` does not exist in this mechanism (e.g. sampling at q = 1)."""
        _check_part(part)
        self.not_applicable[part] = why
        return self

    def merge(self, other: Coverage) -> Coverage:
        for part, insts in other.tested.items():
            for i in insts:
                self.add(part, i)
        for part, why in other.why.items():
            self.why.setdefault(part, why)
        for part, why in other.not_applicable.items():
            self.not_applicable.setdefault(part, why)
        return self

    def untested(self) -> list[str]:
        """The parts no instrument tested (in :data:`PARTS` order)."""
        return [p for p in PARTS if not self.tested.get(p) and p not in self.not_applicable]

    def describe(self) -> list[str]:
        """One line per untested part: ``"clipping untested: <why>"``."""
        return [
            f"{p} untested" + (f": {self.why[p]}" if p in self.why else "") for p in self.untested()
        ]

    def to_dict(self) -> dict:
        return {
            "tested": {p: list(self.tested.get(p, [])) for p in PARTS},
            "untested": self.untested(),
            "why": {p: self.why[p] for p in self.untested() if p in self.why},
            "not_applicable": dict(self.not_applicable),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Coverage:
        if not isinstance(d, dict):
            raise ValueError(f"coverage must be an object, got {type(d).__name__}")
        cov = cls()
        for part, insts in (d.get("tested") or {}).items():
            if not isinstance(insts, list):
                raise ValueError(f"coverage.tested[{part!r}] must be a list")
            for i in insts:
                cov.add(part, str(i))
        for part, why in (d.get("why") or {}).items():
            cov.skip(part, str(why))
        for part, why in (d.get("not_applicable") or {}).items():
            cov.inapplicable(part, str(why))
        return cov


def _check_part(part: str) -> None:
    if part not in PARTS:
        raise ValueError(f"unknown mechanism part {part!r}; expected one of {PARTS}")


def decide(errors: int | bool, coverage: Coverage) -> tuple[str, int]:
    """(verdict, exit code): ``fail`` on any error finding; otherwise ``incomplete`` while
    some part of :data:`PARTS` is untested; otherwise ``pass``."""
    if errors:
        return "fail", 1
    if coverage.untested():
        return "incomplete", EXIT_INCOMPLETE
    return "pass", 0
