"""The job's round progress (pipeline.progress): read from run directories that a thread
fills as a training would, with an injected clock (no timed assertion)."""

import json
import re
import threading

import pytest

from pipeline.progress import JobLog, Progress, fmt_seconds

#: a generous bound on waiting for the polling thread (a failure, never a measurement)
WAIT = 60


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _row(rnd: int, seconds: float, **kw) -> str:
    return json.dumps({"round": rnd, "clients": ["0", "1"], "seconds": seconds, **kw}) + "\n"


def _append(run, text: str) -> None:
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()


def _left(line: str, what: str) -> float | None:
    """Seconds of ``~N s left`` (``what``: the run's) or ``trainings: ~N s left``."""
    pat = r"trainings: ~(\d+) s left" if what == "job" else r"· ~(\d+) s left"
    m = re.search(pat, line)
    return float(m.group(1)) if m else None


def test_rounds_as_a_thread_writes_them(tmp_path):
    """Two slots, three runs of 3 rounds: a thread appends run a's rows (and one of b's)
    while the progress thread polls; each round gives one line, as it is written, with
    the run's time left and the trainings', which shrink; then done, failed, started."""
    runs = {n: tmp_path / n for n in "abc"}
    for d in runs.values():
        d.mkdir()
    clock = Clock(0.0)
    lines: list[str] = []
    said = threading.Condition()

    def emit(line):
        with said:
            lines.append(line)
            said.notify_all()

    def wait_for(prefix):
        with said:
            assert said.wait_for(lambda: any(x.startswith(prefix) for x in lines), WAIT), (
                prefix,
                lines,
            )

    p = Progress([(n, d, 3) for n, d in runs.items()], slots=2, emit=emit, clock=clock)
    p.start()
    assert lines == ["[trainings] 2 running, 1 queued (c)"]

    # a: rounds of 10 s after 2 s of set-up; b: its first after 4 s
    steps = [(12, "a", 1, 10), (14, "b", 1, 10), (22, "a", 2, 10), (32, "a", 3, 10)]
    failures = []

    def writer():
        try:
            for t, name, rnd, sec in steps:
                clock.t = t
                _append(runs[name], _row(rnd, sec, accuracy=0.5 + rnd / 10, epsilon=rnd * 1.5))
                wait_for(f"[{name}] round {rnd}/3")
        except AssertionError as exc:  # reported by the test body
            failures.append(exc)

    with p.watch(interval=0.01):
        w = threading.Thread(target=writer)
        w.start()
        w.join()
    assert not failures, failures
    a = [x for x in lines if x.startswith("[a] round")]
    assert [x.split(" · ")[0] for x in a] == ["[a] round 1/3", "[a] round 2/3", "[a] round 3/3"]
    assert a[0] == (
        "[a] round 1/3 · acc 0.600 · ε 1.50 · 10 s/round · ~20 s left (trainings: ~52 s left)"
    )
    # a's time left: 20 s, 10 s, then its last round; the trainings' shrink with the clock
    assert [_left(x, "run") for x in a] == [20, 10, None]
    assert a[2].startswith("[a] round 3/3 · acc 0.800 · ε 4.50 · 10 s/round · last round")
    job = [_left(x, "job") for x in lines if " round " in x]
    assert all(v is not None for v in job)
    # the runs' times are as foreseen: each read ends the trainings at 64-65 s
    assert job == [52, 51, 43, 33], job
    b = next(x for x in lines if x.startswith("[b] round"))
    assert b.startswith("[b] round 1/3 · acc 0.600 · ε 1.50 · 10 s/round · ~20 s left")
    assert len([x for x in lines if " round " in x]) == 4  # one line per round, no repeat

    # a ends at 35 s: done, and the queued c starts on its slot
    clock.t = 35
    n = len(lines)
    p.finished("a", True, value={"accuracy": 0.8123, "epsilon": 4.5})
    done, started = lines[n:]
    assert done.startswith("[a] done in 35 s · acc 0.812 · ε 4.50 (trainings: ~")
    assert started.startswith("[c] started · 2 running, 0 queued (trainings: ~")
    # b fails: its error's first line, and c is the last one running
    clock.t = 50
    p.finished("b", False, error="RuntimeError: boom\nTraceback ...")
    assert lines[-1].startswith("[b] failed after 50 s: RuntimeError: boom")
    # c: its round and its end, read at its end even without a poll in between
    _append(runs["c"], _row(1, 5.0))
    clock.t = 70
    p.finished("c", True, value={"accuracy": 0.7, "epsilon": None})
    assert lines[-3].startswith("[c] round 1/3 · 5.0 s/round · ~10 s left")
    assert lines[-2] == "[c] done in 35 s · acc 0.700"
    assert lines[-1] == "[trainings] all 3 ended in 70 s: 2 done, 1 failed"


def test_torn_and_bad_lines(tmp_path):
    """A row half written is read once it is whole; a complete line that is not a JSON
    object (or has no round) is skipped; a round already seen is not said again."""
    run = tmp_path / "r"
    run.mkdir()
    lines: list[str] = []
    p = Progress([("r", run, 4)], slots=1, emit=lines.append, clock=Clock(0.0))
    p.start()
    assert p.poll() == []  # no metrics.jsonl yet
    row = _row(1, 3.0, accuracy=0.9)
    _append(run, row[:17])  # torn
    assert p.poll() == []
    _append(run, row[17:])
    got = p.poll()
    assert len(got) == 1 and got[0].startswith("[r] round 1/4 · acc 0.900 · 3.0 s/round")
    assert p.poll() == []
    _append(run, "{not json\n" + "[1, 2]\n" + json.dumps({"note": "no round"}) + "\n")
    _append(run, _row(1, 3.0) + _row(2, 5.0)[:-1])  # a repeat, then a torn last line
    assert p.poll() == []
    _append(run, "\n")
    (line,) = p.poll()
    assert line.startswith("[r] round 2/4 · 4.0 s/round · ~8 s left")
    # a file rewritten shorter (a resume truncates it) is read again from its start
    (run / "metrics.jsonl").write_text(_row(1, 3.0))
    assert p.poll() == []
    _append(run, _row(3, 4.0))
    (line,) = p.poll()
    assert line.startswith("[r] round 3/4 · 4.0 s/round · ~4 s left")


def test_trainings_left_before_any_round(tmp_path):
    """Nothing is guessed before a round or a run has ended; after one run, the others
    (running or queued) are expected to take as long, placed on the free slots."""
    clock = Clock(0.0)
    lines: list[str] = []
    names = ["a", "b", "c", "d"]
    p = Progress([(n, tmp_path / n, 2) for n in names], slots=2, emit=lines.append, clock=clock)
    p.start()
    assert p.job_left() is None
    clock.t = 100
    p.finished("a", True, value={})
    # b has run 100 s of its expected 100 (0 s left); c and d take 100 s each, c on the
    # slot a freed, d on b's
    assert lines[-2] == "[a] done in 100 s (trainings: ~2 min left)"
    assert lines[-1] == "[c] started · 2 running, 1 queued (trainings: ~2 min left)"
    assert p.job_left() == pytest.approx(100)
    clock.t = 130  # b runs late: 0 s left; c 70 s; d after b: 100 s
    assert p.job_left() == pytest.approx(100)
    p.finished("b", True, value={})
    assert p.job_left() == pytest.approx(230 / 2)  # b's 130 s raise the expected time


def test_fmt_seconds():
    assert [fmt_seconds(s) for s in (-1, 0.4, 45, 89.4, 90, 185, 5399, 5400, 7500)] == [
        "0 s",
        "0 s",
        "45 s",
        "89 s",
        "2 min",
        "3 min",
        "90 min",
        "1 h 30 min",
        "2 h 05 min",
    ]


def test_job_log_writes_the_file_and_the_terminal(tmp_path, capsys):
    log = JobLog(tmp_path / "job.log", clock=lambda: 0.0)
    log("training a")
    log("[a] round 1/2", echo=False)
    log("two\nlines")
    text = (tmp_path / "job.log").read_text().splitlines()
    assert [x.split(" ", 1)[1] for x in text] == ["training a", "[a] round 1/2", "two", "lines"]
    assert all(re.match(r"\d\d:\d\d:\d\d ", x) for x in text)
    assert capsys.readouterr().err == "training a\ntwo\nlines\n"
