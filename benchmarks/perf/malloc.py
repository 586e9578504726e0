"""What glibc's allocator thresholds (:mod:`fl.allocator`) change in a training's cost:
``python -m benchmarks.perf.malloc [--pairs N] [--workload minilm|tiny] [--out DIR]``.

Each pair runs the same training twice in fresh child processes, once with the thresholds
raised (``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at 1 GiB, what
``fedlora`` and the test suite set) and once with glibc's defaults, in alternating order
(tuned first in even pairs). Measured per child: CPU seconds (user + system, from
``wait4``: on a shared machine they count this training's work, not the neighbours') and
wall seconds; per pair the ratio tuned / default of each. The workloads: ``minilm``, one
DP-SGD training of the default job's set-up (all-MiniLM-L6-v2 on tweets, LoRA on the top
layer, 5 clients, Poisson batches of 128, gradient and sampler canaries), one round of 3
steps on 1 000 members; ``tiny``, the quick job's set-up (tiny-bert, synthetic). Writes
``results.json`` and ``table.md`` to ``benchmarks/results/malloc/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from benchmarks.paths import RESULTS
from fl.allocator import ENV, THRESHOLD

OUT = RESULTS / "malloc"
WORKLOADS = ("minilm", "tiny")


#: the jobs' training set-ups (pipeline/job.py's presets, which this layer may not import:
#: benchmarks sit below pipeline); tests/fl/test_allocator.py checks they still agree
MINILM = dict(
    model="minilm", dataset="tweets", members=2000, nonmembers=500, test=500, max_length=48,
    clients=5, rounds=3, eval_every=3, local_steps=6, batch_size=128, lr=1e-3, head_lr=3e-2,
    lora_layers=1, pooling="auto", head_init="zero", rank=8, alpha=16.0, dropout="off",
)  # fmt: skip
TINY = dict(
    model="tiny-bert", dataset="synthetic", members=300, nonmembers=120, test=100,
    max_length=24, clients=3, rounds=2, local_steps=20, batch_size=32, lr=0.03, rank=4,
    alpha=8.0, head_init="random", head_lr=0.0, lora_layers=0, dropout="off",
)  # fmt: skip


def workload_config(name: str) -> dict:
    """The TrainConfig fields of a workload (module doc)."""
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; choose one of {WORKLOADS}")
    if name == "tiny":
        return TINY | dict(
            method="fedavg", dp_level="sample", epsilon=8.0, canaries=500,
            canary_kind="gradient", sampler_canaries=400, progress=False,
        )  # fmt: skip
    return MINILM | dict(
        method="fedavg", dp_level="sample", epsilon=8.0, rounds=1, eval_every=1,
        local_steps=3, members=1000, test=200, canaries=5000, canary_kind="gradient",
        sampler_canaries=400, progress=False,
    )  # fmt: skip


def _child(config: str, out: str) -> None:
    """One training (the child process's whole work)."""
    import torch

    from fl.run.config import TrainConfig
    from fl.run.engine import train

    torch.set_num_threads(1)
    train(TrainConfig(**json.loads(config)), Path(out), quiet=True)


def run_child(config: dict, tuned: bool, work: Path) -> dict:
    """One training in a fresh process, tuned or with glibc's defaults: its CPU and wall
    seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if tuned:
        env |= {k: str(THRESHOLD) for k in ENV}
    out = tempfile.mkdtemp(dir=work)
    code = "import sys; from benchmarks.perf.malloc import _child; _child(sys.argv[1], sys.argv[2])"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(config), out + "/run"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the {'tuned' if tuned else 'default'} training failed ({status})")
    return {"cpu": usage.ru_utime + usage.ru_stime, "sys": usage.ru_stime, "wall": wall}


def summarise(pairs: list[dict]) -> dict:
    """Median and range of the pairs' tuned / default ratios (CPU, wall)."""
    out = {}
    for k in ("cpu", "wall", "sys"):
        r = np.array([p["tuned"][k] / p["default"][k] for p in pairs])
        out[k] = {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}
    return out


def table(doc: dict) -> str:
    s = doc["summary"]
    rows = [
        f"# glibc allocator thresholds: tuned / default ({doc['workload']}, {doc['meta']['date']})",
        "",
        f"{len(doc['pairs'])} pairs, alternating order, fresh processes, one torch thread "
        f"(`python -m benchmarks.perf.malloc --workload {doc['workload']}`).",
        "",
        "| pair | tuned CPU s | default CPU s | CPU ratio | tuned wall s | default wall s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(doc["pairs"]):
        t, d = p["tuned"], p["default"]
        rows.append(
            f"| {i + 1} | {t['cpu']:.1f} | {d['cpu']:.1f} | {t['cpu'] / d['cpu']:.3f} "
            f"| {t['wall']:.1f} | {d['wall']:.1f} |"
        )
    rows += [
        "",
        f"CPU ratio (user + system) median **{s['cpu']['median']:.3f}** "
        f"(range {s['cpu']['min']:.3f}–{s['cpu']['max']:.3f}); system time alone "
        f"{s['sys']['median']:.3f}; wall {s['wall']['median']:.3f} "
        f"({s['wall']['min']:.3f}–{s['wall']['max']:.3f}).",
    ]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.perf.malloc", description=__doc__)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--workload", choices=WORKLOADS, default="minilm")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    if a.pairs < 1:
        ap.error("--pairs must be >= 1")
    config = workload_config(a.workload)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="fedlora-malloc-") as tmp:
        for i in range(a.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {tuned: run_child(config, tuned, Path(tmp)) for tuned in order}
            pairs.append({"tuned": got[True], "default": got[False], "tuned_first": order[0]})
            r = got[True]["cpu"] / got[False]["cpu"]
            print(f"pair {i + 1}/{a.pairs}: CPU tuned/default {r:.3f}", flush=True)
    doc = {
        "workload": a.workload,
        "config": config,
        "threshold_bytes": THRESHOLD,
        "pairs": pairs,
        "summary": summarise(pairs),
        "meta": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "table.md").write_text(table(doc), encoding="utf-8")
    print(table(doc), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
