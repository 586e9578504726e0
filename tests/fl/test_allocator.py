"""glibc's allocator thresholds (fl.allocator) and their benchmark's arithmetic
(benchmarks.perf.malloc; the measurement itself: benchmarks/results/malloc/)."""

import subprocess
import sys

import pytest

from benchmarks.perf import malloc as bench
from fl.allocator import ENV, THRESHOLD, tune_malloc
from fl.run.config import TrainConfig


def test_thresholds_are_set_here_and_for_children_but_never_over_the_users():
    env = {}
    assert tune_malloc(env) is (sys.platform == "linux")  # glibc's mallopt took them
    assert env == {k: str(THRESHOLD) for k in ENV}
    mine = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    tune_malloc(mine)
    assert mine == {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD)}
    # a child started with the environment reads it (Ray workers, subprocesses)
    code = "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(THRESHOLD)


def test_the_benchmark_reports_ratios_of_each_pair():
    pairs = [
        {"tuned": {"cpu": 8.0, "sys": 1.0, "wall": 9.0}, "default": {"cpu": 10.0, "sys": 2.0, "wall": 10.0}},
        {"tuned": {"cpu": 9.0, "sys": 1.0, "wall": 9.0}, "default": {"cpu": 10.0, "sys": 4.0, "wall": 12.0}},
        {"tuned": {"cpu": 6.0, "sys": 1.0, "wall": 6.0}, "default": {"cpu": 10.0, "sys": 1.0, "wall": 6.0}},
    ]  # fmt: skip
    s = bench.summarise(pairs)
    assert s["cpu"] == {"median": 0.8, "min": 0.6, "max": 0.9}
    assert s["sys"]["median"] == 0.5 and s["wall"]["max"] == 1.0
    doc = {"workload": "tiny", "pairs": pairs, "summary": s, "meta": {"date": "2026-12-05"}}
    md = bench.table(doc)
    assert "| 1 | 8.0 | 10.0 | 0.800 |" in md and "median **0.800** (range 0.600–0.900)" in md
    for w in bench.WORKLOADS:
        TrainConfig(**bench.workload_config(w)).validate()
    with pytest.raises(SystemExit, match="unknown workload"):
        bench.workload_config("huge")
    from pipeline.job import PRESETS

    assert bench.MINILM == PRESETS["default"].base and bench.TINY == PRESETS["quick"].base
