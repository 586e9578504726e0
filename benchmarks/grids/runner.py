"""Measurement grids: many training runs (and attacks) in parallel worker processes.

``python -m benchmarks.grids.runner GRID [GRID...] --out DIR [--workers N] [--device D]
[--deadline SECONDS] [--base key=value ...] [--seeds 0,1,2]``

Grids (defined in :mod:`benchmarks.grids.jobs`; each a list of jobs; a job is one `fedlora train` configuration, plus attacks for
the ``attacks`` grid):

- ``recipe``   fedavg and ffa at ε=8 over candidate recipes (batch, local steps, lr);
- ``fedask``   FedASK, FFA-LoRA, FedAvg-LoRA at ε ∈ {1, 3, 8} and non-private;
- ``fedpower`` client-level DP, ε ∈ {3, 6, 9}: FedPower vs FedAvg-LoRA and FFA-LoRA, and
  PowerDP vs input vs output perturbation at ε = 6;
- ``hetero``   Fed-PLoRA, FLoRA, FlexLoRA, HETLoRA (ranks from {4, 8, 16}, R = 16) and
  FedAvg-LoRA at rank 4, IID and Dirichlet(0.5), non-private and ε = 8;
- ``attacks``  an overfit non-private run, a normal one, ε = 8 and ε = 1, each attacked by
  every attack with shadow models;
- ``dplearn``  the DP recipes of configs/ (issue 18): the DP linear probe, FedAvg-LoRA on
  the top two layers (mean pooling, zero head, LoRA lr 1e-3, head lr 3e-2, frozen-prefix
  cache) and on the top layer with the probe's schedule (joint clip, and 0.8 of C² kept for
  the head) at ε ∈ {1, 3, 8}; every run also reports its accuracy on the non-member pool
  (``val_*``), which chooses between candidates, never the test set.

Jobs are independent tasks (:func:`fl.distributed.run_tasks`): ``--workers N`` (N > 1)
jobs at once as Ray tasks, on a Ray instance started on this machine or on the cluster of
``--ray-address``; ``--workers 1`` or ``--ray-address none`` runs them here, one after
another (the same rows: a job's result depends on its configuration and its thread count,
``GRID_THREADS``, default 1, on both paths). A job that fails is reported and run again
(``--retries``, default 1) while the others go on; if it fails again its row holds the
error. Every finished job appends one JSON line to ``DIR/results.jsonl`` (a resumed call
skips jobs already there); ``DIR/summary.md`` holds mean ± std per group. With
``--deadline`` no job is started after that many seconds; ``--only TEXT`` keeps the jobs
whose group contains TEXT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.grids.jobs import GRIDS, RECIPE, best_recipe, parse_value
from fl.distributed import run_tasks


def job_key(job: dict) -> str:
    return json.dumps([job["grid"], job["group"], job["cfg"]], sort_keys=True)


def _last_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_job(job: dict, out: Path, device: str) -> dict:
    """One job in this process: train (and attack); a result row."""
    import torch

    from fl.run.config import TrainConfig
    from fl.run.engine import train

    name = f"{job['grid']}-{job['index']:04d}"
    run_dir = out / "runs" / name
    t0 = time.perf_counter()
    cfg = TrainConfig(**{**job["cfg"], "device": device, "progress": False})
    man = train(cfg, run_dir, quiet=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    row = {
        "grid": job["grid"],
        "group": job["group"],
        "index": job["index"],
        "run": name,
        "seed": job["cfg"].get("seed", 0),
        "seconds": time.perf_counter() - t0,
        "accuracy": man["metrics"]["final"].get("accuracy"),
        "balanced_accuracy": man["metrics"]["final"].get("balanced_accuracy"),
        "val_accuracy": man["metrics"]["final"].get("val_accuracy"),
        "val_balanced_accuracy": man["metrics"]["final"].get("val_balanced_accuracy"),
        "epsilon": man["privacy"]["epsilon"].get("pld"),
        "sigma": man["privacy"].get("noise_multiplier"),
    }
    rounds = _last_metrics(run_dir)
    per_round = [r for r in rounds if "round" in r]
    row["round_seconds"] = [r.get("seconds") for r in per_round]
    for key in ("a_rowspace_angle", "init_noise", "agg_noise", "subspace_error"):
        vals = [r[key] for r in per_round if r.get(key) is not None]
        if vals:
            row[key] = vals if key == "a_rowspace_angle" else sum(vals) / len(vals)
    if "attack" in job:
        from attacks.run import run_attacks

        ta = time.perf_counter()
        doc = run_attacks(
            run_dir,
            shadows=job["attack"]["shadows"],
            device=device,
            progress=False,
            shadow_dir=out / "shadows" / name,
            ray_address="none",  # this job is already one task of the grid
        )
        row["attack_seconds"] = time.perf_counter() - ta
        row["attacks"] = {
            k: {m: v.get(m) for m in ("auc", "tpr_at_fpr", "ci")} for k, v in doc["attacks"].items()
        }
        sh = doc.get("shadows") or {}
        each = sh.get("train_seconds_each") or []
        row["seconds_per_shadow"] = sum(each) / len(each) if each else None
    return row


def grid_task(task: tuple) -> dict:
    """One job as a task of :func:`fl.distributed.run_tasks` (here or on a Ray worker):
    ``(job, out, device)`` → its result row."""
    job, out, device = task
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    stale = Path(out) / "runs" / f"{job['grid']}-{job['index']:04d}"
    if stale.exists():  # a failed attempt of this job (indices are never reused)
        shutil.rmtree(stale)
    row = run_job(job, Path(out), device)
    row["worker"] = os.getpid()
    return row


def _row(outcome, job: dict) -> dict:
    """The results.jsonl line of a task's outcome (a result, an error or a skip)."""
    if outcome.skipped:
        row = {"index": job["index"], "skipped": outcome.skipped}
    elif outcome.error:
        row = {k: job[k] for k in ("grid", "group", "index")} | {"error": outcome.error}
    else:
        row = dict(outcome.value)
    row["attempts"] = outcome.attempts
    row["key"] = job["key"]
    return row


def summarize(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "group" in r and "error" not in r and "skipped" not in r:
            groups.setdefault((r["grid"], r["group"]), []).append(r)

    def ms(vals):
        vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if not vals:
            return "–"
        if len(vals) == 1:
            return f"{vals[0]:.4f}"
        return f"{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f}"

    lines = []
    for grid in dict.fromkeys(g for g, _ in groups):
        lines += [
            f"## {grid}",
            "",
            "| group | n | accuracy | balanced acc. | ε (PLD) | σ | s/run | extra |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (g, group), rs in groups.items():
            if g != grid:
                continue
            extra = []
            for key in ("val_balanced_accuracy", "init_noise", "agg_noise", "subspace_error"):
                if any(key in r for r in rs):
                    extra.append(f"{key} {ms([r.get(key) for r in rs])}")
            if any("a_rowspace_angle" in r for r in rs):
                mx = max(max(r["a_rowspace_angle"]) for r in rs if "a_rowspace_angle" in r)
                extra.append(f"max a_rowspace_angle {mx:.2e}")
            lines.append(
                f"| {group} | {len(rs)} | {ms([r['accuracy'] for r in rs])} | "
                f"{ms([r.get('balanced_accuracy') for r in rs])} | "
                f"{ms([r.get('epsilon') for r in rs])} | {ms([r.get('sigma') for r in rs])} | "
                f"{statistics.mean(r['seconds'] for r in rs):.1f} | {'; '.join(extra)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.grids.runner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("grids", nargs="+", choices=sorted(GRIDS))
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--workers", type=int, default=1, help="jobs at once (Ray tasks); 1 = here, in order"
    )
    ap.add_argument(
        "--ray-address",
        default="local",
        help="local (Ray on this machine), a cluster address (ray://HOST:10001, HOST:6379, "
        "auto) or none (here, in order)",
    )
    ap.add_argument("--retries", type=int, default=1, help="extra attempts of a failed job")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds; 0 = none")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--base",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides of the recipe for every job",
    )
    ap.add_argument(
        "--use-best-recipe",
        action="store_true",
        help="apply the best candidate of an earlier `recipe` grid in --out",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only the jobs whose group contains TEXT (repeatable)",
    )
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.retries < 0:
        ap.error("--retries must be >= 0")
    base = dict(RECIPE)
    overrides = {}
    for kv in args.base:
        if "=" not in kv:
            ap.error(f"--base expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        overrides[k] = parse_value(v)
    base.update(overrides)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.jsonl"
    done_rows = (
        [json.loads(x) for x in res_path.read_text().splitlines()] if res_path.exists() else []
    )
    if args.use_best_recipe:
        name, over = best_recipe(done_rows)
        base.update(over)
        print(f"grids: recipe {name}: {over}", flush=True)
    done = {r["key"] for r in done_rows if "key" in r and "error" not in r and "skipped" not in r}
    jobs = []
    for g in args.grids:
        for job in GRIDS[g](base, seeds, overrides):
            if args.only and not any(o in job["group"] for o in args.only):
                continue
            job["key"] = job_key(job)
            if job["key"] not in done:
                jobs.append(job)
    # new indices follow every earlier one (a killed call may leave gaps), so no job's
    # run directory is another's
    start = 1 + max((int(r.get("index", -1)) for r in done_rows), default=len(done_rows) - 1)
    for i, job in enumerate(jobs):
        job["index"] = start + i
    where = "here" if args.workers == 1 else f"Ray ({args.ray_address})"
    print(
        f"grids: {len(jobs)} jobs on {args.workers} worker(s) {where}, device {args.device}",
        flush=True,
    )
    deadline = time.time() + args.deadline if args.deadline > 0 else math.inf
    threads = max(1, int(os.environ.get("GRID_THREADS", "1")))
    cuda = args.device.startswith("cuda")
    rows = list(done_rows)
    t0 = time.time()
    tasks = [(job, str(out.resolve()), args.device) for job in jobs]
    outcomes = run_tasks(
        grid_task,
        tasks,
        workers=args.workers,
        address=args.ray_address,
        retries=args.retries,
        threads=threads,
        gpus_per_task=1.0 / args.workers if cuda else 0.0,
        deadline=deadline,
        report=lambda msg: print(f"grids: {msg}", flush=True),
    )
    with res_path.open("a") as fh:
        for n, o in enumerate(outcomes):
            row = _row(o, jobs[o.index])
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            rows.append(row)
            status = row.get("error") or row.get("skipped") or f"acc {row.get('accuracy')}"
            print(
                f"[{time.time() - t0:6.0f}s] {n + 1}/{len(jobs)} {row.get('group', '')} "
                f"seed {row.get('seed', '')}: {status}",
                flush=True,
            )
            (out / "summary.md").write_text(summarize(rows))
    (out / "summary.md").write_text(summarize(rows))
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
