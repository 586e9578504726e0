"""The journal of a round in flight (``RUN/checkpoint/inflight.json``).

A round is journaled before anything of it is sent and the journal is removed once its
checkpoint is written. A journal found on resume means the round may have released (a
Flower message, a log line) before the run stopped. What resume then does:

- the round can be replayed bit for bit (the CPU, in process, in the CPU environment
  that journaled it): it is re-run with the same noise streams, which release nothing
  new, and nothing is charged;
- otherwise its planned ledger events are charged now, and it is re-run as the next
  *attempt*: every round stream gets ``("attempt", a)`` appended
  (:meth:`fl.privacy.rng.RunRandomness.round_stream`). Re-using the first attempt's
  noise over a computation that may differ would release a noiseless difference
  S₁ − S₂, which a double charge does not cover.

The journal of a re-run carries the events already charged for the round's earlier
attempts (``charged``). They live only in memory until the round's checkpoint, so a run
stopped again inside the same round would otherwise lose them: each resume charges them
again, with the new attempt's, until a checkpoint holds them.

The engine calls :func:`write`, :func:`clear` and :func:`resume`; this module holds the
decision and the CPU environment it compares.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fl.errors import UsageError
from fl.io import atomic_write_json, read_json
from fl.privacy.accounting import Event

FILE = "inflight.json"
#: the ledger note of a charged attempt (parsed back by :func:`attempts_from_ledger`)
NOTE = "round started before a stop (attempt {a}); its noise may have been observed"
_NOTE_RE = re.compile(r"^round started before a stop \(attempt (\d+)\)")


def cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_environment() -> dict:
    """What a CPU computation's float results depend on besides its inputs: the torch
    build, the instruction set its kernels dispatch to, the thread count (a reduction
    split over other threads rounds differently) and the processor."""
    import torch

    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": cpu_model(),
    }


def path(out: str | Path) -> Path:
    return Path(out) / "checkpoint" / FILE


def write(
    out: str | Path,
    r: int,
    attempt: int,
    device: str,
    transport: str,
    planned: list[Event],
    charged: Sequence[Event] = (),
) -> None:
    """Journal round ``r`` (0-based) before anything of it is sent. ``charged``: the
    events already charged for its earlier attempts (not yet in a checkpoint)."""
    p = path(out)
    p.parent.mkdir(exist_ok=True)
    doc = {
        "round": r,
        "attempt": attempt,
        "device": device,
        "transport": transport,
        "environment": cpu_environment(),
        "planned": [e.to_dict() for e in planned],
        "charged": [e.to_dict() for e in charged],
    }
    atomic_write_json(p, doc)


def clear(out: str | Path) -> None:
    path(out).unlink(missing_ok=True)


@dataclass(frozen=True)
class Resume:
    """What resume does with a journaled round: re-run it as ``attempt`` and charge
    ``charged``: the earlier attempts' charges (``earlier`` of them) and, unless the round
    is replayed bit for bit, the journaled attempt's planned events."""

    round: int
    attempt: int
    charged: list[Event]
    replay: bool
    env_differs: bool
    earlier: int = 0

    def message(self) -> str:
        before = (
            f"; the {self.earlier} event(s) charged for its earlier attempts are charged again "
            "(no checkpoint held them)"
            if self.earlier
            else ""
        )
        if self.replay:
            return (
                f"round {self.round + 1} was started before the run stopped; it is re-run with "
                "the same noise streams (bit-exact on CPU), so its releases are not charged "
                f"twice{before}"
            )
        why = " (the CPU environment differs from the journal's)" if self.env_differs else ""
        return (
            f"round {self.round + 1} was started before the run stopped and cannot be replayed "
            f"bit-exactly here{why}; its {len(self.charged) - self.earlier} planned event(s) "
            f"are charged, and it is re-run as attempt {self.attempt} with fresh noise "
            f"streams{before}"
        )


def decide(doc: dict, bit_exact_here: bool, environment: dict, dp_level: str) -> Resume:
    """The decision for a journal ``doc``. ``bit_exact_here``: this engine replays rounds
    bit for bit (CPU, in process); ``environment``: its :func:`cpu_environment`. A journal
    written before the environment was recorded is judged by device and transport alone.
    A non-private run charges nothing and keeps its streams."""
    r = int(doc.get("round", -1))
    attempt = int(doc.get("attempt", 0))
    same = doc.get("device") == "cpu" and doc.get("transport") == "inprocess"
    env = doc.get("environment")
    same_env = env is None or env == environment
    earlier = [Event.from_dict(e) for e in doc.get("charged", [])]
    if dp_level == "none":
        return Resume(r, attempt, [], True, not same_env)
    if same and same_env and bit_exact_here:
        return Resume(r, attempt, earlier, True, False, len(earlier))
    charged = list(earlier)
    for e in doc.get("planned", []):
        ev = Event.from_dict(e)
        charged.append(
            Event(
                ev.kind,
                ev.noise_multiplier,
                ev.sample_rate,
                ev.count,
                unit=ev.unit,
                round=ev.round,
                stage="interrupted",
                note=NOTE.format(a=attempt),
            )
        )
    return Resume(r, attempt + 1, charged, False, not same_env, len(earlier))


def resume(out: str | Path, start_round: int, bit_exact_here: bool, dp_level: str) -> Resume | None:
    """Read the journal under ``out``: None when there is none, or when it belongs to a
    round the checkpoint already completed (then it is removed), else the
    :class:`Resume` decision. The journal is kept: the re-run overwrites it, so a stop
    before then still finds the charges."""
    p = path(out)
    if not p.is_file():
        return None
    doc = read_json(p)
    if int(doc.get("round", -1)) < start_round:
        p.unlink(missing_ok=True)
        return None
    return decide(doc, bit_exact_here, cpu_environment(), dp_level)


def attempts_from_ledger(events) -> dict[int, list]:
    """Round → its ``interrupted`` events, in ledger order, for the rounds that were re-run
    (a replay re-enacts them: :meth:`fl.run.engine.Engine.reenact`). Events are ledger event
    dicts or :class:`Event` objects."""
    out: dict[int, list] = {}
    for i, e in enumerate(events):
        if isinstance(e, dict) and e.get("stage") != "interrupted":
            continue
        try:
            ev = e if isinstance(e, Event) else Event.from_dict(e)
        except (TypeError, ValueError, KeyError, UsageError) as exc:  # PrivacyError too
            raise UsageError(f"ledger event {i} cannot be read: {exc}") from None
        if ev.stage == "interrupted":
            out.setdefault(int(ev.round), []).append(ev)
    for evs in out.values():
        final_attempt(evs)  # every note names its attempt
    return out


def final_attempt(charged: Sequence[Event]) -> int:
    """The attempt a round was completed as, from the charges of its earlier attempts:
    one more than the last charged attempt (each charge re-runs as the next attempt; a
    bit-exact replay of that attempt adds no charge)."""
    seen = [int(m.group(1)) for ev in charged if (m := _NOTE_RE.match(ev.note or ""))]
    if len(seen) != len(charged):
        raise UsageError(
            "an interrupted ledger event does not name its attempt in its note "
            f"({NOTE.format(a='N')!r} expected)"
        )
    return max(seen) + 1 if seen else 0
