"""The job's training progress, as it happens: a line per finished round of every run.

The job's trainings run elsewhere (Ray workers, or the job's own main thread); each
appends one row per finished round to ``RUN/metrics.jsonl`` (with the round's wall
time, ``seconds``). :class:`Progress` reads those rows as they come — from a thread
of the job's process (:meth:`Progress.watch`) — and writes, for each new round::

    [fedavg-eps8] round 2/3 · acc 0.812 · ε 5.21 · 41 s/round · ~41 s left (trainings: ~3 min left)

A run's time left is its mean round time so far × its rounds left. The trainings' time
left places the runs still queued on the slots (the runs at once) as they free up, each
expected to take the mean time of the runs done so far (before any is done: the running
runs' elapsed time + their time left). A queued run is reported as queued, a started one
with the runs running and queued, an ended one as ``done in N s`` or ``failed after N s:
ERROR``. Runs start in order as slots free up, as :func:`fl.distributed.run_tasks` starts
them, so the job tells :meth:`Progress.finished` and the next queued run starts.

Torn lines (a row half written when read) are left for the next read; a complete line
that is not a JSON object is skipped. The clock is injected (tests).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fl.run.rundir import METRICS


def fmt_seconds(s: float) -> str:
    """``45 s``, ``3 min``, ``1 h 05 min``."""
    s = max(0.0, float(s))
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    h, m = divmod(round(s / 60), 60)
    return f"{h} h {m:02d} min"


def _per_round(s: float) -> str:
    return f"{s:.1f} s/round" if s < 10 else f"{s:.0f} s/round"


@dataclass
class RunProgress:
    """What is known of one run: its rounds so far (from its metrics.jsonl) and state."""

    name: str
    dir: Path
    rounds: int
    state: str = "queued"  # queued | running | done | failed
    started: float | None = None
    ended: float | None = None
    round: int = 0  # the last round seen
    seen: float | None = None  # when it was seen (the clock's time)
    round_seconds: list[float] = field(default_factory=list)
    _offset: int = 0  # bytes of metrics.jsonl read (up to the last complete line)

    def mean_round(self) -> float | None:
        return sum(self.round_seconds) / len(self.round_seconds) if self.round_seconds else None

    def left(self, now: float | None = None) -> float | None:
        """Mean round time × rounds left, less the time since the last round was seen
        (at ``now``; None before the first round)."""
        m = self.mean_round()
        if m is None:
            return None
        since = 0.0 if now is None or self.seen is None else max(0.0, now - self.seen)
        return max(0.0, m * max(0, self.rounds - self.round) - since)

    def new_rows(self) -> list[dict]:
        """The complete rows appended to metrics.jsonl since the last call, of rounds not
        seen yet. A torn last line is left for the next call; a file rewritten shorter
        (a resume truncates it) is read again from its start."""
        path = self.dir / METRICS
        try:
            with open(path, "rb") as fh:
                fh.seek(0, 2)
                if fh.tell() < self._offset:
                    self._offset = 0
                fh.seek(self._offset)
                data = fh.read()
        except (FileNotFoundError, NotADirectoryError):
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        rows = []
        for line in data[: end + 1].splitlines():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(row, dict):
                continue
            try:
                rnd = int(row.get("round"))
            except (TypeError, ValueError):
                continue
            if rnd > self.round:
                rows.append(row)
        return rows


class Progress:
    """Round progress of the job's runs, written through ``emit`` (see the module doc).

    ``runs``: ``(name, run directory, rounds)`` in the order they are started;
    ``slots``: how many run at once. Call :meth:`start` once the runs are submitted,
    :meth:`poll` (or :meth:`watch`) while they run, :meth:`finished` as each ends."""

    def __init__(
        self,
        runs: list[tuple[str, str | Path, int]],
        slots: int,
        emit: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runs = [RunProgress(n, Path(d), int(r)) for n, d, r in runs]
        self.by_name = {r.name: r for r in self.runs}
        self.slots = max(1, int(slots))
        self.emit = emit
        self.clock = clock
        self._lock = threading.RLock()
        self._t0: float | None = None
        self._poll_error: str | None = None

    # ---- state --------------------------------------------------------------------
    def _of(self, state: str) -> list[RunProgress]:
        return [r for r in self.runs if r.state == state]

    def start(self) -> None:
        """The first ``slots`` runs start now (the others are queued)."""
        with self._lock:
            self._t0 = self.clock()
            for r in self.runs[: self.slots]:
                self._start(r, say=False)
            queued = self._of("queued")
            if queued:
                self.emit(
                    f"[trainings] {len(self.runs) - len(queued)} running, "
                    f"{len(queued)} queued ({', '.join(r.name for r in queued)})"
                )

    def _start(self, r: RunProgress, say: bool = True) -> None:
        r.state, r.started = "running", self.clock()
        if say:
            self.emit(
                f"[{r.name}] started · {len(self._of('running'))} running, "
                f"{len(self._of('queued'))} queued{self._job_part()}"
            )

    def poll(self) -> list[str]:
        """Read the running runs' new rounds; emit (and return) a line per round."""
        lines = []
        with self._lock:
            for r in self._of("running"):
                lines += self._poll_run(r)
        return lines

    def _poll_run(self, r: RunProgress) -> list[str]:
        lines = []
        for row in r.new_rows():
            r.round, r.seen = int(row["round"]), self.clock()
            sec = row.get("seconds")
            if isinstance(sec, int | float):
                r.round_seconds.append(float(sec))
            line = self._round_line(r, row)
            self.emit(line)
            lines.append(line)
        return lines

    def finished(self, name: str, ok: bool, value: dict | None = None, error: str | None = None):
        """Run ``name`` ended (``value``: its accuracy and ε, or ``error``): its last rounds,
        its end, and the next queued run's start."""
        with self._lock:
            r = self.by_name[name]
            if r.state == "queued":  # never seen starting (slots miscounted): it ran
                r.state, r.started = "running", self._t0 if self._t0 is not None else self.clock()
            self._poll_run(r)
            r.ended = self.clock()
            took = f"{r.ended - (r.started if r.started is not None else r.ended):.0f} s"
            r.state = "done" if ok else "failed"
            nxt = self._of("queued")
            if ok:
                tail = _result_part(value or {})
                self.emit(f"[{r.name}] done in {took}{tail}{self._job_part()}")
            else:
                first = (error or "unknown error").strip().splitlines() or ["unknown error"]
                self.emit(f"[{r.name}] failed after {took}: {first[0]}{self._job_part()}")
            if nxt:
                self._start(nxt[0])
            elif not self._of("running"):
                done, failed = len(self._of("done")), len(self._of("failed"))
                wall = self.clock() - (self._t0 if self._t0 is not None else self.clock())
                self.emit(
                    f"[trainings] all {len(self.runs)} ended in {wall:.0f} s: "
                    f"{done} done" + (f", {failed} failed" if failed else "")
                )

    # ---- estimates ----------------------------------------------------------------
    def expected_run(self) -> float | None:
        """A run's expected time: the mean of the ended runs', else of the running runs'
        elapsed + left (those with a round done), else None."""
        now = self.clock()
        ended = [
            r.ended - r.started for r in self.runs if r.ended is not None and r.started is not None
        ]
        if ended:
            return sum(ended) / len(ended)
        guesses = [
            (now - r.started) + r.left(now)
            for r in self._of("running")
            if r.left(now) is not None and r.started is not None
        ]
        return sum(guesses) / len(guesses) if guesses else None

    def job_left(self) -> float | None:
        """Time until every run has ended: the running runs' time left, then the queued
        runs placed on the slots as they free up (None when not yet known)."""
        now = self.clock()
        exp = self.expected_run()
        free = []
        for r in self._of("running"):
            left = r.left(now)
            if left is None:
                if exp is None:
                    return None
                left = max(0.0, exp - (now - (r.started if r.started is not None else now)))
            free.append(left)
        queued = self._of("queued")
        if queued and exp is None:
            return None
        free += [0.0] * max(0, self.slots - len(free))
        for _ in queued:
            free.sort()
            free[0] += exp
        return max(free) if free else 0.0

    def _job_part(self) -> str:
        if not self._of("running") and not self._of("queued"):
            return ""
        left = self.job_left()
        return "" if left is None else f" (trainings: ~{fmt_seconds(left)} left)"

    def _round_line(self, r: RunProgress, row: dict) -> str:
        parts = [f"[{r.name}] round {r.round}/{r.rounds}"]
        parts += _metric_parts(row)
        m = r.mean_round()
        if m is not None:
            parts.append(_per_round(m))
        if r.round < r.rounds and m is not None:
            parts.append(f"~{fmt_seconds(r.left())} left")
        elif r.round >= r.rounds:
            parts.append("last round")
        return " · ".join(parts) + self._job_part()

    # ---- the polling thread -------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, interval: float = 1.0) -> Iterator[Progress]:
        """Poll every ``interval`` seconds from a thread while the block runs."""
        stop = threading.Event()

        def loop():
            while not stop.wait(interval):
                try:
                    self.poll()
                except Exception as exc:  # noqa: BLE001 - progress must not stop the job
                    msg = f"{type(exc).__name__}: {exc}"
                    if msg != self._poll_error:
                        self._poll_error = msg
                        self.emit(f"[trainings] progress not read: {msg}")

        t = threading.Thread(target=loop, name="fedlora-progress", daemon=True)
        t.start()
        try:
            yield self
        finally:
            stop.set()
            t.join()


def _num(x) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _metric_parts(row: dict) -> list[str]:
    parts = []
    if _num(row.get("perplexity")) is not None:
        parts.append(f"ppl {row['perplexity']:.2f}")
    elif _num(row.get("accuracy")) is not None:
        parts.append(f"acc {row['accuracy']:.3f}")
    if _num(row.get("epsilon")) is not None:
        parts.append(f"ε {row['epsilon']:.2f}")
    return parts


def _result_part(value: dict) -> str:
    parts = []
    if _num(value.get("accuracy")) is not None:
        parts.append(f"acc {value['accuracy']:.3f}")
    if _num(value.get("epsilon")) is not None:
        parts.append(f"ε {value['epsilon']:.2f}")
    return "".join(f" · {p}" for p in parts)


class JobLog:
    """The job's log: every line to ``path`` (``HH:MM:SS`` first) and, when ``echo``,
    to stderr, as it is written (thread-safe: the progress thread writes too)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.clock = clock
        self._lock = threading.Lock()

    def __call__(self, msg: str, echo: bool = True) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as fh:
                for line in str(msg).splitlines() or [""]:
                    fh.write(f"{stamp} {line}\n")
            if echo:
                print(msg, file=sys.stderr, flush=True)


__all__ = ["JobLog", "Progress", "RunProgress", "fmt_seconds"]
