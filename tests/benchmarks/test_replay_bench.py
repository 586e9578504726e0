"""benchmarks.auditing.replay: the table counts false alarms and detections from its rows
(synthetic rows; the benchmark itself trains, see benchmarks/results/replay/)."""

from benchmarks.auditing.replay import table


def _row(case, verdict, ratio, visible=None):
    r = {
        "case": case,
        "method": "fedavg",
        "level": "sample",
        "q": "q=0.2",
        "seed": 0,
        "verdict": verdict,
        "max_ratio": ratio,
        "compared": 16,
        "train_s": 1.0,
        "replay_s": 2.0,
    }
    if visible is not None:
        r["visible"] = visible
    return r


def test_table_counts_false_alarms_and_detections():
    rows = [
        _row("correct", "pass", 0.99),
        _row("correct", "fail", 1.2),
        _row("no_clip", "fail", 1.3, True),
        _row("no_clip", "pass", 0.9, True),
        _row("noise_reuse", "pass", 1.0, False),
    ]
    text = table(rows, 12.0, 1)
    assert "**False alarms: 1 / 2** correct runs" in text
    assert "largest ‖Δq‖/bound over them: 1.200000" in text
    assert "`no_clip` (must be seen): flagged 1 / 2" in text
    assert "`noise_reuse` (not the replay's to see (the canaries')): flagged 0 / 1" in text
    assert text.count("\n| correct |") == 2
