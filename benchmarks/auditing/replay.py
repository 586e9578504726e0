"""Neighbour replay over many correct runs and planted faults (#47): false alarms and power.

``python -m benchmarks.auditing.replay [--seeds K] [--out DIR]`` trains tiny runs (tiny-bert
on synthetic text, the tests' configuration) of every method and DP level the engine has,
each correct, at three sampling rates, and replays each on two neighbours — the default
job's way (recorded while it trains, only the neighbour's client retrained:
:func:`audit.replay.engine.replay_recorded`) — then trains planted faults the replay
should see (``no_clip``) or cannot see (``noise_scale``, ``noise_reuse``: the noise is
the canaries' to test). Writes ``results.json`` and ``table.md`` (one row per run: the
replay's verdict, the largest ‖Δq‖/bound, releases compared, seconds).

The replay is deterministic, so its only source of a false alarm is the float tolerance
(10⁻⁴ of the bound plus 10⁻⁶ of the sums' size, :mod:`audit.replay.record`): a false
alarm here is a bug, not a rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.paths import RESULTS

OUT = RESULTS / "replay"

#: (method, dp level) pairs the engine supports with a tapped release
CORRECT = [
    ("fedavg", "sample"),
    ("ffa", "sample"),
    ("fedsa", "sample"),
    ("fedprox", "sample"),
    ("scaffold", "sample"),
    ("plora", "sample"),
    ("flora", "sample"),
    ("flexlora", "sample"),
    ("hetlora", "sample"),
    ("fedpower", "sample"),
    ("fedask", "sample"),
    ("fedavg", "client"),
    ("ffa", "client"),
    ("fedprox", "client"),
]
#: batch sizes over the tiny clients of 80 records: q = 1 (full batch), 0.2, 0.05
BATCHES = {"q=1": 80, "q=0.2": 16, "q=0.05": 4}
#: planted faults: (fault, whether the replay must see it)
FAULTS = [("no_clip", True), ("noise_scale=0.5", False), ("noise_reuse", False)]
KINDS = ("remove", "max-length")


#: the whole verdict (canaries + replay) over correct runs: methods carrying gradient and
#: sampler canaries at sample level (the default job's DP set-up, tiny)
WHOLE = ["fedavg", "ffa", "fedprox", "scaffold", "plora", "fedsa"]


def whole(method: str, seed: int, b: int, work: Path) -> dict:
    """A correct run with 500 gradient and 100-per-client sampler canaries, audited by the
    run audit (one-run bound, conformance, sampling) and replayed: a false alarm is any
    error finding of either instrument."""
    from audit.bundle.audit import audit_run

    kw = dict(
        method=method,
        dp_level="sample",
        batch_size=b,
        seed=seed,
        canaries=500,
        canary_kind="gradient",
        sampler_canaries=100,
        rounds=2,
        local_steps=8,
    )
    r = one(kw, work)
    a = audit_run(str(work), one_run=True)
    errors = sorted({f["code"] for f in a["findings"] if f["severity"] == "error"})
    conf = (a.get("one_run") or {}).get("conformance") or {}
    return {
        **r,
        "audit_errors": errors,
        "conformance_passed": conf.get("passed"),
        "understated": bool(a.get("understated")),
    }


def one(cfg_kw: dict, work: Path, kinds=KINDS) -> dict:
    from audit.replay.engine import replay_recorded
    from audit.replay.record import Recorder
    from fl.privacy.tap import tapped
    from fl.run.engine import train
    from fl.testing import tiny_config

    cfg = tiny_config(**{"noise_multiplier": 1.0, **cfg_kw})
    if cfg_kw.get("method") in ("plora", "flora", "flexlora", "hetlora"):
        cfg = tiny_config(**{"noise_multiplier": 1.0, "client_ranks": "2,4", **cfg_kw})
    rec = Recorder()
    rec.keep_deliveries = True
    t0 = time.time()
    with tapped(rec):
        train(cfg, work, quiet=True)
    t1 = time.time()
    res = replay_recorded(cfg, work, rec, kinds=kinds)
    ratios = [n["comparison"]["max_ratio"] for n in res["neighbours"]]
    ratios = [r for r in ratios if r is not None]
    return {
        "verdict": res["verdict"],
        "codes": sorted({f["code"] for f in res["findings"]}),
        "max_ratio": max(ratios) if ratios else None,
        "compared": sum(n["comparison"]["compared"] for n in res["neighbours"]),
        "train_s": round(t1 - t0, 2),
        "replay_s": round(time.time() - t1, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.auditing.replay", description=__doc__)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per (method, level, q)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--whole",
        type=int,
        default=0,
        metavar="N",
        help="instead: N correct runs with canaries, the whole verdict (canaries + replay) counted",
    )
    args = ap.parse_args(argv)
    if args.whole:
        return main_whole(args)
    import tempfile

    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        k = 0
        for method, level in CORRECT:
            for qname, b in BATCHES.items():
                for seed in range(args.seeds):
                    kw = dict(method=method, dp_level=level, batch_size=b, seed=seed)
                    k += 1
                    r = one(kw, Path(tmp) / f"r{k}")
                    rows.append(
                        {
                            "case": "correct",
                            "method": method,
                            "level": level,
                            "q": qname,
                            "seed": seed,
                            **r,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
        for fault, visible in FAULTS:
            for qname, b in BATCHES.items():
                for seed in range(args.seeds):
                    kw = dict(
                        method="fedavg",
                        dp_level="sample",
                        batch_size=b,
                        seed=seed,
                        inject_fault=fault,
                    )
                    k += 1
                    r = one(kw, Path(tmp) / f"r{k}")
                    rows.append(
                        {
                            "case": fault,
                            "visible": visible,
                            "method": "fedavg",
                            "level": "sample",
                            "q": qname,
                            "seed": seed,
                            **r,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    wall = time.time() - t0
    (out / "results.json").write_text(json.dumps({"wall_s": wall, "rows": rows}, indent=1))
    (out / "table.md").write_text(table(rows, wall, args.seeds))
    print(table(rows, wall, args.seeds))
    return 0


def main_whole(args) -> int:
    import tempfile

    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.whole):
            method = WHOLE[k % len(WHOLE)]
            b = (16, 4)[(k // len(WHOLE)) % 2]
            r = whole(method, k, b, Path(tmp) / f"w{k}")
            rows.append({"method": method, "q": f"{b}/80", "seed": k, **r})
            print(json.dumps(rows[-1]), flush=True)
    wall = time.time() - t0
    alarms = [r for r in rows if r["audit_errors"] or r["verdict"] == "fail"]
    text = (
        "# The whole verdict over correct runs (canaries + neighbour replay)\n\n"
        f"`python -m benchmarks.auditing.replay --whole {args.whole}`: tiny-bert runs with 500 "
        "gradient and 100-per-client sampler canaries, audited (one-run bound, conformance at "
        "Holm α = 0.001, sampling test) and replayed on remove and max-length; "
        f"{wall:.0f} s on one thread.\n\n"
        f"- **False alarms: {len(alarms)} / {len(rows)}** (any error finding of either instrument)\n"
        f"- replay: {sum(r['verdict'] == 'pass' for r in rows)} pass; conformance passed in "
        f"{sum(bool(r['conformance_passed']) for r in rows)}\n\n"
        "| method | q | seed | replay | largest ‖Δq‖/bound | audit errors |\n|---|---|---|---|---|---|\n"
        + "".join(
            f"| {r['method']} | {r['q']} | {r['seed']} | {r['verdict']} | "
            f"{(r['max_ratio'] or 0):.4f} | {', '.join(r['audit_errors']) or 'none'} |\n"
            for r in rows
        )
    )
    (out / "whole.json").write_text(json.dumps({"wall_s": wall, "rows": rows}, indent=1))
    (out / "whole.md").write_text(text)
    print(text)
    return 0


def table(rows: list[dict], wall: float, seeds: int) -> str:
    """The summary (false alarms, detections) and one line per (case, method, level, q)."""
    correct = [r for r in rows if r["case"] == "correct"]
    alarms = [r for r in correct if r["verdict"] == "fail"]
    lines = [
        "# Neighbour replay: correct runs and planted faults",
        "",
        f"`python -m benchmarks.auditing.replay --seeds {seeds}` (tiny-bert, synthetic text; "
        f"each run recorded while it trains, replayed on {', '.join(KINDS)}, only the "
        f"neighbour's client retrained); {len(rows)} runs, {wall:.0f} s on one thread.",
        "",
        f"- **False alarms: {len(alarms)} / {len(correct)}** correct runs "
        f"(largest ‖Δq‖/bound over them: {max(r['max_ratio'] or 0 for r in correct):.6f}).",
    ]
    for fault in sorted({r["case"] for r in rows} - {"correct"}):
        fr = [r for r in rows if r["case"] == fault]
        hit = sum(r["verdict"] == "fail" for r in fr)
        seen = "must be seen" if fr[0]["visible"] else "not the replay's to see (the canaries')"
        lines.append(f"- `{fault}` ({seen}): flagged {hit} / {len(fr)}")
    lines += [
        "",
        "| case | method | level | q | verdict | largest ‖Δq‖/bound | releases compared "
        "| train s | replay s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "–" if r["max_ratio"] is None else f"{r['max_ratio']:.4f}"
        lines.append(
            f"| {r['case']} | {r['method']} | {r['level']} | {r['q']} | {r['verdict']} | {ratio} "
            f"| {r['compared']} | {r['train_s']} | {r['replay_s']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
