"""The benchmark harness: ratios and spreads against hand-computed values, the CLI, and
every benchmark in --quick mode producing a well-formed record (no timing asserts)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import cli
from benchmarks.perf import harness

KEYS = {"name", "workload", "baseline", "candidate", "ratio", "target", "met", "details"}


def test_paired_ratio_against_hand_values():
    base = [1.0, 2.0, 4.0]
    cand = [1.5, 2.0, 2.0]  # ratios 1.5, 1.0, 0.5
    r = harness.paired_ratio(base, cand)
    assert r["median"] == pytest.approx(1.0)
    assert r["min"] == pytest.approx(0.5) and r["max"] == pytest.approx(1.5)
    assert r["min"] <= r["boot_lo"] <= r["median"] <= r["boot_hi"] <= r["max"]
    assert r["n"] == 3
    with pytest.raises(ValueError):
        harness.paired_ratio([1.0], [1.0, 2.0])


def test_interleaved_rotates_order_and_counts():
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = harness.interleaved(fns, reps=3, warmup=1)
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    # warm-up a b c, then a b c / b c a / c a b: each side leads once.
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert all(t >= 0 for v in times.values() for t in v)


def test_summarize_divides_by_steps():
    s = harness.summarize([2.0, 4.0, 6.0], per=2.0)
    assert (s["median_s"], s["min_s"], s["max_s"], s["reps"]) == (2.0, 1.0, 3.0, 3)


def test_result_rejects_unknown_ratio_kind_and_nan():
    with pytest.raises(ValueError):
        harness.result("x", "w", "b", "c", 1.0, "faster")
    assert harness.result("x", "w", "b", "c", math.nan, "time")["ratio"] is None


def test_unknown_benchmark_is_a_usage_error(capsys):
    from pipeline.cli import main

    assert main(["bench", "nope", "--quick"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def _check_record(r: dict) -> None:
    assert KEYS <= set(r), r.keys()
    assert r["ratio_kind"] in ("time", "speedup")
    if not r["available"]:
        assert r["ratio"] is None and r["details"]["reason"]
        return
    assert isinstance(r["ratio"], float) and r["ratio"] > 0
    assert r["workload"] and r["baseline"] and r["candidate"]
    assert r["met"] in (True, False, None)
    sp = r["spread"]
    assert sp["min"] <= r["ratio"] <= sp["max"]


def _check_ratio(e: dict) -> None:
    assert {"id", "benchmark", "what", "kind", "value", "spread", "target", "met"} <= set(e)
    assert e["kind"] in ("time", "speedup")
    if not e["measured"]:
        assert e["value"] is None and e["met"] is None and e["reason"]
        return
    assert isinstance(e["value"], float) and e["value"] > 0
    sp = e["spread"]
    if sp is not None:
        assert sp["min"] <= e["value"] <= sp["max"] and sp["n"] >= 1


def _rec(name, ratio, spread, details, available=True):
    from benchmarks.perf import harness

    r = harness.result(name, "w", "b", "c", ratio, "time", details=details, spread=spread)
    r["available"] = available
    return r


def test_ratio_list_from_hand_records():
    """ratio_list lifts the sub-ratios out of the details, applies the issue's targets
    (not in --quick mode), and lists the unmeasured ones with a reason."""
    from benchmarks.perf import dp_overhead
    from benchmarks.perf.ratios import ratio_list

    sp = {"median": 1.02, "min": 0.9, "max": 1.3, "boot_lo": 1.0, "boot_hi": 1.1, "n": 5}
    step = {"median_s": 0.5, "min_s": 0.4, "max_s": 0.6, "reps": 5}
    per = {
        "minilm": {"ratio": 1.02, "spread": sp, "batch_size": 32, "seq_len": 64,
                   "nodp_step": step, "dp_step": step},
    }  # fmt: skip
    fed = {"model": "minilm", "wspace_over_bspace": sp, "bspace_over_none": sp}
    doc = {
        "meta": {"quick": False, "device": "cpu"},
        "results": [
            _rec("dp_overhead", 1.02, sp, {"per_model": per}),
            _rec("fedask_clip", 1.02, sp, fed),
            _rec("attacks", None, None, {"reason": "no attacks"}, available=False),
        ],
    }
    out = {e["id"]: e for e in ratio_list(doc)}
    e = out["dp_step_over_nodp_step/cpu/minilm"]
    assert e["measured"] and e["value"] == 1.02 and e["spread"] == sp
    assert e["target"] == f"<= {dp_overhead.TARGET:g}" and e["met"] is True
    assert out["wspace_over_bspace_clip"]["value"] == 1.02
    assert out["bspace_over_none_clip"]["met"] is None  # no target
    assert "wspace_over_none_clip" not in out  # not in the details: not invented
    assert out["shadow_over_plain_run"]["reason"] == "not available: no attacks"
    assert "not run" in out["powerdp_factored_speedup/4096/K10"]["reason"]
    assert "CUDA" in out["dp_step_over_nodp_step/cuda/bert-base/bf16"]["reason"]
    for v in out.values():
        _check_ratio(v)
    doc["meta"]["quick"] = True  # quick workloads are not the stated ones
    quick = {e["id"]: e for e in ratio_list(doc)}
    assert quick["dp_step_over_nodp_step/cpu/minilm"]["met"] is None


@pytest.mark.parametrize("name", cli.BENCHMARKS)
def test_each_benchmark_quick(name, tmp_path):
    """Each benchmark runs in --quick mode through the CLI and writes strict JSON with a
    ratio, plus a Markdown row naming it."""
    from pipeline.cli import main

    assert main(["bench", name, "--quick", "--json", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "bench.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert doc["meta"]["quick"] is True
    (r,) = doc["results"]
    assert r["name"] == name
    _check_record(r)
    md = (tmp_path / "bench.md").read_text()
    assert f"| {name} |" in md
    # The flat ratio list: this benchmark's ratios measured (each inside its spread), the
    # others listed as not run, never with a number.
    mine = [e for e in doc["ratios"] if e["benchmark"] == name and e["measured"]]
    assert mine, doc["ratios"]
    for e in doc["ratios"]:
        _check_ratio(e)
    assert all(not e["measured"] for e in doc["ratios"] if e["benchmark"] != name)
    assert "## Every ratio" in md
    if name == "aggregation":
        mem = next(e for e in mine if "peak_memory" in e)["peak_memory"]
        assert mem["measured"], mem
        assert mem["dense"]["peak_added_mib"] > 0 and mem["factored"]["peak_added_mib"] >= 0


def test_noise_source_quick_details():
    """noise_source: both generators' steps see Poisson batches of exactly the batch size,
    and the record carries the per-step draw costs of both and the noise coordinates."""
    from benchmarks.perf import noise_source
    from benchmarks.perf.dp_overhead import make_trainer
    from fl.privacy.rng import NoiseKey
    from fl.run.engine import poisson_masks

    for make in (noise_source.keyed_factory(NoiseKey.generate()), noise_source.seeded_factory(0)):
        name = noise_source.matched_name(make, ("t",), 160, 0.1, 2, 16)
        assert [int(m.sum()) for m in poisson_masks(make(*name)[1], 160, 0.1, 2)] == [16, 16]

    r = noise_source.run(quick=True)
    _check_record(r)
    assert r["name"] == "noise_source" and r["met"] is None  # the target is on minilm
    m = r["details"]["per_model"]["tiny-bert"]
    trainer = make_trainer("tiny-bert", m["batch_size"], m["seq_len"], m["examples"])[0]
    params = noise_source.trainable_params(trainer, {"A", "B", "head"})
    assert m["noise_coordinates_per_step"] == sum(p.numel() for p in params) > 0
    for side in ("seeded", "keyed"):
        d = m["draws"][side]
        assert d["noise_us"] > 0 and d["mask_us"] > 0 and d["two_streams_us"] > 0
        assert d["step_draw_us"] == pytest.approx(d["noise_us"] + d["mask_us"])
    assert m["ratio_from_draws"] > 0


def test_readme_performance_table_is_its_committed_file():
    """The README's Performance section names a committed bench.json and quotes the
    table that file renders (benchmarks.perf.readme), so its figures are measured ones."""
    import re
    from pathlib import Path

    from benchmarks.perf import readme

    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text(encoding="utf-8")
    section = text.split("## Performance", 1)[1].split("\n## ", 1)[0]
    (path,) = set(re.findall(r"`(benchmarks/results/[^`]+/bench\.json)`", section))
    doc = json.loads((root / path).read_text(encoding="utf-8"))
    assert readme.table(doc) in section
