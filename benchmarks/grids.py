"""Measurement grids: many training runs (and attacks) in parallel worker processes.

``python -m benchmarks.grids GRID [GRID...] --out DIR [--workers N] [--device D]
[--deadline SECONDS] [--base key=value ...] [--seeds 0,1,2]``

Grids (each a list of jobs; a job is one `fedlora train` configuration, plus attacks for
the ``attacks`` grid):

- ``recipe``   fedavg and ffa at ε=8 over candidate recipes (batch, local steps, lr);
- ``fedask``   FedASK, FFA-LoRA, FedAvg-LoRA at ε ∈ {1, 3, 8} and non-private;
- ``fedpower`` client-level DP, ε ∈ {3, 6, 9}: FedPower vs FedAvg-LoRA and FFA-LoRA, and
  PowerDP vs input vs output perturbation at ε = 6;
- ``hetero``   Fed-PLoRA, FLoRA, FlexLoRA, HETLoRA (ranks from {4, 8, 16}, R = 16) and
  FedAvg-LoRA at rank 4, IID and Dirichlet(0.5), non-private and ε = 8;
- ``attacks``  an overfit non-private run, a normal one, ε = 8 and ε = 1, each attacked by
  every attack with shadow models;
- ``dplearn``  the DP recipes of configs/ (issue 18): the DP linear probe and FedAvg-LoRA on
  the top two layers (mean pooling, zero head, LoRA lr 1e-3, head lr 3e-2, frozen-prefix
  cache) at ε ∈ {1, 3, 8}; every run also reports its accuracy on the non-member pool
  (``val_*``), which chooses between candidates, never the test set.

Each worker imports torch once and runs its jobs in-process; CUDA needs the ``spawn``
start method, which is used everywhere. Every finished job appends one JSON line to
``DIR/results.jsonl`` (a resumed call skips jobs already there); ``DIR/summary.md`` holds
mean ± std per group. With ``--deadline`` no job is started after that many seconds;
``--only TEXT`` keeps the jobs whose group contains TEXT.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

# The recipe chosen for minilm/tweets (issue 2): 10 000 members over 5 clients, batch 64,
# 5 rounds × 20 local steps.
RECIPE = dict(members=10000, nonmembers=1000, test=1000, batch_size=64, rounds=5, local_steps=20)


def _coerce(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _privacy(eps) -> dict:
    return {"dp_level": "none"} if eps is None else {"dp_level": "sample", "epsilon": eps}


# Candidate recipes for minilm/tweets at ε = 8; each processes at most ~20 000 training
# examples in total (rounds × local steps × batch × 5 clients), about 10 minutes on 2 cores.
RECIPE_CANDIDATES = {
    "m10k-b64-s10-adamw5e-3": dict(batch_size=64, local_steps=10, lr=5e-3),
    "m10k-b64-s10-adamw2e-2": dict(batch_size=64, local_steps=10, lr=2e-2),
    "m10k-b128-s5-adamw1e-2": dict(batch_size=128, local_steps=5, lr=1e-2),
    "m10k-b128-s5-adamw3e-2": dict(batch_size=128, local_steps=5, lr=3e-2),
    "m20k-b128-s5-adamw1e-2": dict(batch_size=128, local_steps=5, lr=1e-2, members=20000),
    "m10k-b64-s10-sgd0.5": dict(batch_size=64, local_steps=10, lr=0.5, optimizer="sgd"),
    "m10k-b64-s10-sgd2": dict(batch_size=64, local_steps=10, lr=2.0, optimizer="sgd"),
    "m10k-b256-r3-s5-adamw2e-2": dict(batch_size=256, local_steps=5, rounds=3, lr=2e-2),
}


def jobs_recipe(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    out = []
    for name, over in RECIPE_CANDIDATES.items():
        for method in ("fedavg", "ffa"):
            cfg = {**base, **over, "method": method, "seed": seeds[0], **_privacy(8.0)}
            out.append({"grid": "recipe", "group": f"{name}/{method}", "cfg": cfg})
    return out


def best_recipe(rows: list[dict]) -> tuple[str, dict]:
    """The candidate with the highest mean accuracy of fedavg and ffa (both must have run)."""
    acc: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("grid") == "recipe" and r.get("accuracy") is not None:
            name, method = r["group"].split("/")
            acc.setdefault(name, {})[method] = r["accuracy"]
    scored = {n: sum(a.values()) / 2 for n, a in acc.items() if len(a) == 2}
    if not scored:
        raise RuntimeError("no recipe candidate finished for both fedavg and ffa")
    name = max(scored, key=scored.get)
    return name, RECIPE_CANDIDATES[name]


def jobs_fedask(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    out = []
    for eps in (None, 1.0, 3.0, 8.0):
        for method in ("fedask", "ffa", "fedavg"):
            for seed in seeds:
                cfg = {**base, "method": method, "seed": seed, **_privacy(eps)}
                tag = "nodp" if eps is None else f"eps{eps:g}"
                out.append({"grid": "fedask", "group": f"{method}/{tag}", "cfg": cfg})
    return out


# Client-level DP needs many clients per round: the Gaussian noise on the average has
# norm ≈ σ·C·√d / K for d released coordinates and K clients in the round. What 2 cores
# can train in 4.5–10 minutes per run (measured): 500 clients of 16 examples each (8 000 members),
# Poisson client sampling q = 0.2 (about 100 clients per round, amplification used),
# 8 rounds of one local SGD step (lr 2, batch 16 = the client's data), LoRA r = 8 on the
# last layer's query and value only (d ≈ 12 300 LoRA + 770 head parameters; the lower
# layers need no backward pass), C = 1, δ = 1e-5, evaluation at the end.
CLIENT_LEVEL = dict(
    members=8000,
    clients=500,
    clients_per_round=0.2,
    client_sampling="poisson",
    rounds=8,
    local_steps=1,
    batch_size=16,
    optimizer="sgd",
    lr=2.0,
    rank=8,
    alpha=16.0,
    target_modules="layer.5.attention.self.query,layer.5.attention.self.value",
    clip=1.0,
    delta=1e-5,
    eval_every=8,
)


def jobs_fedpower(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    """Client-level ε ∈ {3, 6, 9} for FedPower (PowerDP), FedAvg-LoRA and FFA-LoRA (the
    server-side Gaussian baseline); input and output perturbation at ε = 6; and the
    non-private ceiling of the same set-up (first seed only). ``CLIENT_LEVEL`` replaces
    the recipe's fields; ``--base`` overrides (``overrides``) replace both."""
    client = {**base, **CLIENT_LEVEL, **(overrides or {})}
    out = []
    for eps in (3.0, 6.0, 9.0):
        for method in ("fedpower", "fedavg", "ffa"):
            for seed in seeds:
                cfg = {**client, "dp_level": "client", "method": method, "seed": seed}
                cfg["epsilon"] = eps
                out.append({"grid": "fedpower", "group": f"{method}/eps{eps:g}", "cfg": cfg})
    for pert in ("input", "output"):
        for seed in seeds:
            cfg = {
                **client,
                "dp_level": "client",
                "method": "fedpower",
                "seed": seed,
                "epsilon": 6.0,
                "opts": {"perturbation": pert},
            }
            out.append({"grid": "fedpower", "group": f"fedpower-{pert}/eps6", "cfg": cfg})
    for method in ("fedpower", "fedavg", "ffa"):
        cfg = {**client, "dp_level": "none", "method": method, "seed": seeds[0]}
        out.append({"grid": "fedpower", "group": f"{method}/nodp", "cfg": cfg})
    return out


# The hetero grid uses half the local work of the recipe (batch 128, 5 local steps); under
# DP with the learning rate the recipe sweep found best at ε = 8.
HETERO_NODP = dict(batch_size=128, local_steps=5, lr=1e-2)
HETERO_DP = dict(batch_size=128, local_steps=5, lr=3e-2)


def jobs_hetero(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    out = []
    for eps in (None, 8.0):
        tag = "nodp" if eps is None else f"eps{eps:g}"
        for part in ("iid", "dirichlet"):
            for method in ("plora", "flora", "flexlora", "hetlora", "fedavg"):
                for seed in seeds:
                    cfg = {
                        **base,
                        **(HETERO_DP if eps is not None else HETERO_NODP),
                        "method": method,
                        "seed": seed,
                        "partition": part,
                        "dirichlet_alpha": 0.5,
                        **_privacy(eps),
                    }
                    if method == "fedavg":
                        cfg.update(rank=4, alpha=8.0)
                    else:
                        cfg.update(rank=16, alpha=32.0, client_ranks="4,8,16")
                    out.append({"grid": "hetero", "group": f"{method}/{part}/{tag}", "cfg": cfg})
    return out


def jobs_attacks(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    runs = {
        "overfit": {
            **base,
            "members": 500,
            "local_steps": 0,
            "local_epochs": 10.0,
            "dp_level": "none",
        },
        "normal": {**base, "dp_level": "none"},
        "eps8": {**base, **_privacy(8.0)},
        "eps1": {**base, **_privacy(1.0)},
    }
    return [
        {
            "grid": "attacks",
            "group": f"fedavg/{name}",
            "cfg": {**cfg, "method": "fedavg", "seed": seeds[0]},
            "attack": {"shadows": 4},
        }
        for name, cfg in runs.items()
    ]


# Candidates of the DP recipes (issue 18), each at ε ∈ {1, 3, 8}. 10 000 members over 5
# IID clients; the model defaults (pooling auto = mean for minilm, zero head) apply.
DPLEARN_BASE = dict(
    members=10000, nonmembers=1000, test=1000, clients=5, eval_nonmembers=True, head_lr=0.0
)
_LORA2 = dict(method="fedavg", lora_layers=2, local_steps=10, lr=1e-3, head_lr=3e-2)
DPLEARN_CANDIDATES = {
    "probe-b500-s20-r10-lr5e-2": dict(
        method="probe", batch_size=500, local_steps=20, rounds=10, lr=0.05, eval_every=10
    ),
    "lora2-b256-s10-r5": dict(_LORA2, batch_size=256, rounds=5, eval_every=5),
    "lora2-b512-s10-r8": dict(_LORA2, batch_size=512, rounds=8, eval_every=8),
}


def jobs_dplearn(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    out = []
    for eps in (8.0, 3.0, 1.0):
        for name, over in DPLEARN_CANDIDATES.items():
            for seed in seeds:
                cfg = {**DPLEARN_BASE, **over, **(overrides or {}), "seed": seed, **_privacy(eps)}
                out.append({"grid": "dplearn", "group": f"{name}/eps{eps:g}", "cfg": cfg})
    return out


def best_dplearn(rows: list[dict]) -> dict[tuple[str, str], str]:
    """Per (family, ε): the candidate with the highest mean balanced accuracy on the
    non-member pool (``val_balanced_accuracy``), never on the test set."""
    score: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if r.get("grid") == "dplearn" and r.get("val_balanced_accuracy") is not None:
            name, eps = r["group"].split("/")
            score.setdefault((name.split("-", 1)[0], eps, name), []).append(
                r["val_balanced_accuracy"]
            )
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for (fam, eps, name), vals in score.items():
        m = sum(vals) / len(vals)
        if (fam, eps) not in best or m > best[(fam, eps)][0]:
            best[(fam, eps)] = (m, name)
    return {k: v[1] for k, v in best.items()}


GRIDS = {
    "recipe": jobs_recipe,
    "fedask": jobs_fedask,
    "fedpower": jobs_fedpower,
    "hetero": jobs_hetero,
    "attacks": jobs_attacks,
    "dplearn": jobs_dplearn,
}


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

    from fl.config import TrainConfig
    from fl.engine import train

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
        )
        row["attack_seconds"] = time.perf_counter() - ta
        row["attacks"] = {
            k: {m: v.get(m) for m in ("auc", "tpr_at_fpr", "ci")} for k, v in doc["attacks"].items()
        }
        sh = doc.get("shadows") or {}
        each = sh.get("train_seconds_each") or []
        row["seconds_per_shadow"] = sum(each) / len(each) if each else None
    return row


def _worker(wid: int, queue, results, out: str, device: str, deadline: float) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("GRID_THREADS", "1"))))
    while True:
        job = queue.get()
        if job is None:
            return
        if time.time() > deadline:
            results.put({"index": job["index"], "skipped": "deadline"})
            continue
        try:
            row = run_job(job, Path(out), device)
        except Exception as exc:  # noqa: BLE001 - recorded in the results; others go on
            traceback.print_exc()
            row = {
                "grid": job["grid"],
                "group": job["group"],
                "index": job["index"],
                "error": f"{type(exc).__name__}: {exc}",
            }
        row["worker"] = wid
        results.put(row)


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
        prog="python -m benchmarks.grids",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("grids", nargs="+", choices=sorted(GRIDS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=1)
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
    base = dict(RECIPE)
    overrides = {}
    for kv in args.base:
        if "=" not in kv:
            ap.error(f"--base expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        overrides[k] = _coerce(v)
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
    for i, job in enumerate(jobs):
        job["index"] = len(done_rows) + i
    print(f"grids: {len(jobs)} jobs on {args.workers} worker(s), device {args.device}", flush=True)
    deadline = time.time() + args.deadline if args.deadline > 0 else math.inf
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    for job in jobs:
        queue.put(job)
    for _ in range(args.workers):
        queue.put(None)
    procs = [
        ctx.Process(target=_worker, args=(w, queue, results, str(out), args.device, deadline))
        for w in range(args.workers)
    ]
    for p in procs:
        p.start()
    keys = {job["index"]: job["key"] for job in jobs}
    rows = list(done_rows)
    t0 = time.time()
    with res_path.open("a") as fh:
        for n in range(len(jobs)):
            row = results.get()
            row["key"] = keys.get(row["index"])
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
    for p in procs:
        p.join()
    (out / "summary.md").write_text(summarize(rows))
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
