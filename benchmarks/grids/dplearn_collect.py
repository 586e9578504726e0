"""The rows of results.jsonl from the runs' folders:
``python benchmarks/grids/dplearn_collect.py RUNS_DIR OUT.jsonl [GRID]``
(GRID: ``dplearn``, the default, or ``dplearn-m21k``, whose folders are named
``probe-m21k-eps<E>[-s<S>]`` and ``r1qv-m21k-eps<E>[-s<S>]``).

The runs were ``fedlora train`` calls in folders named ``<candidate>-eps<E>[-s<S>]``
or ``<candidate>-nodp[-s<S>]`` (no ``-s``: seed 0). Each finished run becomes one row in
the grid runner's format; its
``key`` is the grid job's (``benchmarks.grids.runner.job_key``) when the run's configuration
equals that job's on every field the job sets, so that
``python -m benchmarks.grids.runner dplearn --out <this folder>`` skips it; a run that matches
no job keeps its folder name as key and is reported.
"""

import json
import pathlib
import re
import sys

from benchmarks.grids.jobs import GRIDS
from benchmarks.grids.runner import job_key

GROUPS = {
    "cos": "lora1-cos-b500-s20-r10",
    "wu5cos": "lora1-wu5cos-b500-s20-r10",
    "cos-r2v": "lora1-cos-r2v-b500-s20-r10",
    "cos-r1qv": "lora1-cos-r1qv-b500-s20-r10",
    "probecos": "probe-cos-b500-s20-r10-lr5e-2",
    "probe": "probe-b500-s20-r10-lr5e-2",
    "probe-m21k": "probe-b500-s20-r10-lr5e-2",
    "r1qv-m21k": "lora1-cos-r1qv-b500-s20-r10",
}
KEEP = ("method", "members", "clients", "rounds", "local_steps", "batch_size", "lr", "head_lr",
        "lora_layers", "alpha", "rank", "target_modules", "lr_schedule", "head_warmup_rounds",
        "head_clip_share", "max_length", "epsilon", "seed", "clip")  # fmt: skip


def main(runs: str, out_path: str, grid: str = "dplearn") -> None:
    jobs = {}
    for job in GRIDS[grid]({}, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):
        jobs[(job["group"], job["cfg"]["seed"])] = job
    out = []
    for p in sorted(pathlib.Path(runs).iterdir()):
        m = re.fullmatch(r"(.+)-(?:eps(\d+)|nodp)(?:-s(\d))?", p.name)
        if not p.is_dir() or not m or m.group(1) not in GROUPS:
            continue
        if ("m21k" in m.group(1)) != (grid == "dplearn-m21k"):
            continue
        if not (p / "manifest.json").exists():
            continue
        rows = [json.loads(line) for line in open(p / "metrics.jsonl")]
        last = rows[-1]
        if "balanced_accuracy" not in last:
            continue
        man = json.load(open(p / "manifest.json"))
        cfg = json.load(open(p / "config.json"))
        group = f"{GROUPS[m.group(1)]}/" + (f"eps{m.group(2)}" if m.group(2) else "nodp")
        job = jobs.get((group, cfg.get("seed")))
        job = job | {"grid": grid, "group": group} if job else None
        if job and all(cfg.get(k) == v for k, v in job["cfg"].items()):
            key = job_key(job)
        else:
            key = p.name
            print(f"{p.name}: no {grid} job has this configuration; key = folder name")
        wall = man.get("wall_seconds") or man.get("wall_s")
        out.append({
            "grid": grid, "group": group, "run": p.name, "key": key,
            "seed": cfg.get("seed"), "seconds": wall,
            **{k: last.get(k) for k in ("accuracy", "balanced_accuracy", "val_accuracy",
                                        "val_balanced_accuracy", "loss")},
            "epsilon_pld": last.get("epsilon"),
            "sigma": man.get("privacy", {}).get("noise_multiplier"),
            "wall_s": wall,
            "train_loss_by_round": [round(r.get("train_loss", float("nan")), 4) for r in rows],
            "seconds_by_round": [round(r.get("seconds", 0), 1) for r in rows],
            "config": {k: cfg.get(k) for k in KEEP},
        })  # fmt: skip
    with open(out_path, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    for r in out:
        print(
            f"{r['group']:45s} s{r['seed']} {r['accuracy']:.4f} {r['balanced_accuracy']:.4f} "
            f"val {r['val_balanced_accuracy']:.4f}  wall {r['wall_s']}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
