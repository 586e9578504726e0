"""`fedlora bench [NAME...] [--quick] [--json] [--out DIR] [--device D] [--note TEXT]`.

Runs the benchmarks (all when no NAME is given), each in this one process, and prints
a Markdown table (or, with ``--json``, the JSON document: ``meta`` — machine, torch,
device, date, load, ``--note`` conditions —, ``ratios`` — every ratio measured, flat,
with its spread, and the issue's unmeasured ones with the reason — and ``results``, the
benchmarks' records). ``--out DIR`` also writes ``DIR/bench.json`` and ``DIR/bench.md``. Every row states its workload, its baseline,
its candidate and the ratio (``time``: candidate/baseline, lower is better;
``speedup``: baseline/candidate, higher is better).
"""

from __future__ import annotations

import importlib
import json
import math
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from fl.errors import UsageError

BENCHMARKS = (
    "dp_overhead",
    "length_buckets",
    "noise_source",
    "fedask_clip",
    "engine_overhead",
    "aggregation",
    "attacks",
    "shadow_cost",
    "accounting",
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run performance benchmarks (ratios measured in one process)",
        description=(
            "Run performance benchmarks; each reports a ratio of a candidate against a "
            f"baseline timed interleaved in this process. Names: {', '.join(BENCHMARKS)}."
        ),
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    p.add_argument(
        "--quick", action="store_true", help="smoke-test workloads (same code paths, small sizes)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    p.add_argument("--out", default=None, help="folder for bench.json and bench.md")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument(
        "--note",
        default=None,
        help="conditions to record in the document's meta (e.g. 'machine shared with ...')",
    )
    p.set_defaults(func=main)


def resolve_names(names: list[str]) -> list[str]:
    if not names:
        return list(BENCHMARKS)
    bad = [n for n in names if n not in BENCHMARKS]
    if bad:
        raise UsageError(f"unknown benchmark(s) {bad}; choose from {list(BENCHMARKS)}")
    return list(dict.fromkeys(names))


def _device(dev: str) -> str:
    import torch

    if dev == "cpu":
        return dev
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda asked for, but no CUDA device is available")
        return dev
    raise UsageError(f"unknown device {dev!r}; use cpu or cuda")


def run_benchmarks(
    names: list[str], quick: bool, device: str = "cpu", log=None, note: str | None = None
) -> dict:
    """Run ``names`` in order; returns the JSON document {"meta", "ratios", "results"}:
    ``ratios`` is every ratio measured, flat (:func:`benchmarks.perf.ratios.ratio_list`)."""
    from benchmarks.perf.ratios import ratio_list

    meta = _meta(quick, device, note)
    t0 = time.perf_counter()
    results = []
    for name in resolve_names(names):
        mod = importlib.import_module(f"benchmarks.perf.{name}")
        if log:
            log(f"bench: {name}{' (quick)' if quick else ''} ...")
        t = time.perf_counter()
        res = mod.run(quick, device=device)
        res["seconds"] = time.perf_counter() - t
        if log:
            log(f"bench: {name}: {_ratio_text(res)} in {res['seconds']:.1f}s")
        results.append(res)
    meta["finished"] = datetime.now(UTC).isoformat()
    meta["seconds"] = time.perf_counter() - t0
    meta["load_average_end"] = _load()
    doc = {"meta": meta, "results": results}
    return clean({"meta": meta, "ratios": ratio_list(doc), "results": results})


def _load():
    import os

    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cpu_model() -> str | None:
    from fl.run.inflight import cpu_model

    return cpu_model() or None


def _meta(quick: bool, device: str, note: str | None = None) -> dict:
    import os

    import torch

    dev_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else _cpu_model()
    return {
        "created": datetime.now(UTC).isoformat(),
        "date": datetime.now(UTC).date().isoformat(),
        "quick": quick,
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "device_name": dev_name,
        "platform": platform.platform(),
        "load_average": _load(),
        "conditions": note,
        "note": "ratios come from interleaved repetitions in one process; absolute seconds "
        "depend on machine load",
    }


def _ratio_text(res: dict) -> str:
    if not res.get("available", True):
        return "not available"
    r = res.get("ratio")
    if r is None:
        return "n/a"
    kind = "x slower" if res["ratio_kind"] == "time" else "x faster"
    return f"{r:.3g}{kind}"


def clean(obj):
    """JSON-safe copy: non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str | int | bool):
        return obj
    return str(obj)


def _cell(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _spread_text(sp: dict | None) -> str:
    if not sp:
        return "point estimate"
    s = f"{sp['median']:.3g}"
    if "boot_lo" in sp:
        s += f" ({sp['boot_lo']:.3g}–{sp['boot_hi']:.3g}"
    else:
        s += " ("
    return s + f"; {sp['min']:.3g}–{sp['max']:.3g}, n={sp['n']})"


def markdown(doc: dict) -> str:
    """The Markdown table of a bench JSON document."""
    m = doc["meta"]
    lines = [
        f"# fedlora bench ({'quick' if m['quick'] else 'full'}, device {m['device']})",
        "",
        f"{m['created']} · torch {m['torch']} · {m['torch_threads']} threads · "
        f"load average {m.get('load_average')}. {m['note']}."
        + (f" Conditions: {m['conditions']}." if m.get("conditions") else ""),
        "",
        "| benchmark | workload | baseline | candidate | ratio | spread (min–max) | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        if not r.get("available", True):
            why = r["details"].get("reason", "")
            lines.append(f"| {r['name']} | not available: {_cell(why)} | | | | | | |")
            continue
        sp = r.get("spread") or {}
        spread = f"{sp['min']:.3g}–{sp['max']:.3g}" if "min" in sp else ""
        kind = "cand/base time" if r["ratio_kind"] == "time" else "speed-up base/cand"
        ratio = f"{r['ratio']:.3g} ({kind})" if r["ratio"] is not None else "n/a"
        met = {True: "yes", False: "**no**", None: "–"}[r["met"]]
        lines.append(
            f"| {r['name']} | {_cell(r['workload'])} | {_cell(r['baseline'])} | "
            f"{_cell(r['candidate'])} | {ratio} | {spread} | {_cell(r['target'] or '–')} | {met} |"
        )
    if doc.get("ratios"):
        lines += [
            "",
            "## Every ratio",
            "",
            "| id | what | ratio | median (90% bootstrap; min–max, n) | target | met |",
            "|---|---|---|---|---|---|",
        ]
        for e in doc["ratios"]:
            if not e["measured"]:
                lines.append(
                    f"| {e['id']} | {_cell(e['what'])} | not measured: {_cell(e['reason'])} "
                    f"| | {_cell(e['target'] or '–')} | – |"
                )
                continue
            kind = "time" if e["kind"] == "time" else "speed-up"
            lines.append(
                f"| {e['id']} | {_cell(e['what'])} | {e['value']:.3g} ({kind}) | "
                f"{_spread_text(e['spread'])} | {_cell(e['target'] or '–')} | "
                f"{ {True: 'yes', False: '**no**', None: '–'}[e['met']] } |"
            )
    return "\n".join(lines) + "\n"


def main(args) -> int:
    names = resolve_names(args.names)
    device = _device(args.device)
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
    doc = run_benchmarks(
        names, args.quick, device, log=lambda s: print(s, file=sys.stderr), note=args.note
    )
    md = markdown(doc)
    text = json.dumps(doc, indent=2, allow_nan=False)
    if out is not None:
        (out / "bench.json").write_text(text + "\n", encoding="utf-8")
        (out / "bench.md").write_text(md, encoding="utf-8")
    print(text if args.json else md)
    return 0
