"""Planted-fault suite: the power of the one-run audit (issue 35, item 4).

``python -m benchmarks.auditing.faults [--seeds 10] [--correct 20] [--out DIR]``

Trains the real engine once per (fault, seed) with ``--inject-fault NAME[=VALUE]`` (a test-only
switch that plants the fault at its code path and leaves the ledger unchanged: such a run is
never released), at a claimed ε = 1 (σ calibrated by the engine from ``--epsilon 1``), and
audits every run with the one-run audit of its white-box gradient canaries
(``audit.bundle.audit.audit_run(run, one_run=True)``; the audit never reads the fault: it finds it
from the privatized step sums, or at client level from the canary clients' cosines). Detection = the audit's ``empirical_exceeds_claim`` finding
(the one-run ε lower bound, certified at 95 %, above the recomputed ε). Correct runs (no fault)
at seeds drawn from the OS's secret randomness give the false-alarm rate.

Per fault: detection rate over the seeds with a Clopper–Pearson 95 % interval, the ε_lb
distribution (median, min, max), wall time; ``results.json`` and ``table.md`` in ``--out``
(default ``benchmarks/results/faults``). Every run gets a fresh secret noise key.

Settings (where the gradient canaries are strong; docs/privacy.md "Gradient canaries"):
tiny-bert on synthetic text, rank 16 on every layer, 3 clients × 80 members, 2 rounds × 4
local steps, M = 5 000 gradient canaries (4 000 for FedASK), δ = 1e-5. ``q1``: batch 80 (q = 1, the plain
Gaussian); ``q025``: batch 20 (q = 0.25), for the two faults that change nothing at q = 1
(``fixed_batches``: at q = 1 the fixed batch is the whole client, exactly Poisson's;
``noise_reuse``: at q = 1 a canary is in every step, so one reused draw hides it as well as
fresh ones). ``fedask``: FedASK with ``--opt clip_space=b`` (the flat DP-SGD step; FedASK's
default W-space privatizer takes W-space gradient canaries too, tests/fl/test_wspace_canaries.py,
but refuses the flat step's faults). ``client``: client-level FedAvg-LoRA audited by its canary clients
(``--canary-clients 4000``, ``audit/canaries/clients.py``), for the server-noise faults.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: the settings (TrainConfig overrides on top of fl.testing.TINY)
SETTINGS: dict[str, dict] = {
    "q1": dict(batch_size=80, rank=16),
    "q025": dict(batch_size=20, rank=16),
    # FedASK trains B (and the head) only: 4 096 + 130 coordinates at rank 16
    "fedask": dict(
        batch_size=80, rank=16, method="fedask", opts={"clip_space": "b"}, canaries=4000
    ),  # client level: FedAvg-LoRA, server noise, M canary clients (docs/audit.md, "Canary
    # clients"): 3 clients of 20, every client every round, 3 rounds of 1 local step,
    # C = 0.5, rank 64 (32 898 clipped coordinates)
    "client": dict(
        dp_level="client",
        members=60,
        rounds=3,
        local_steps=1,
        clip=0.5,
        rank=64,
        canaries=0,
        canary_kind="mislabel",
        canary_clients=4000,
    ),
}
COMMON = dict(epsilon=1.0, delta=1e-5, canaries=5000, canary_kind="gradient")

#: (fault, setting): what is measured; the correct runs of every setting used are added
FAULTS: list[tuple[str, str]] = [
    ("noise_scale=0.25", "q1"),
    ("noise_scale=0.5", "q1"),
    ("no_clip", "q1"),
    ("head_unnoised", "q1"),
    ("factor_unnoised=A", "q1"),
    ("factor_unnoised=B", "q1"),
    ("noise_reuse", "q1"),
    ("fixed_batches", "q1"),
    ("noise_reuse", "q025"),
    ("fixed_batches", "q025"),
    ("head_unnoised", "q025"),
    ("fedask_stage1_unnoised", "fedask"),
    ("server_noise_omitted", "client"),
    ("noise_scale=0.25", "client"),
    ("noise_scale=0.5", "client"),
]


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The exact (Clopper–Pearson) 1 − alpha interval of a binomial proportion k/n."""
    from scipy.stats import beta

    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def one_run(fault: str, setting: str, seed: int, work: Path) -> dict:
    """Train one run (a fresh secret key) with ``fault`` ("" = correct) and audit it."""
    from audit.bundle.audit import audit_run
    from fl.run.engine import train
    from fl.testing import tiny_config

    out = work / f"run-{setting}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = tiny_config(**{**COMMON, **SETTINGS[setting]}, seed=seed, inject_fault=fault)
    t0 = time.perf_counter()
    m = train(cfg, out, quiet=True)
    t1 = time.perf_counter()
    res = audit_run(out, one_run=True)
    t2 = time.perf_counter()
    one = res["one_run"]
    codes = sorted({f["code"] for f in res["findings"]})
    fdp = one.get("fdp", {}).get("epsilon_lb", one.get("epsilon_lb_fdp"))
    row = {
        "fault": fault or "none",
        "setting": setting,
        "seed": seed,
        "epsilon_claimed": res["epsilon_pld"],
        "sigma": m["privacy"]["noise_multiplier"],
        "epsilon_lb": one["epsilon_lb"],  # Steinke et al. at α
        "epsilon_lb_fdp": fdp,  # audit.bounds.fdp, family (ε, δ), at α
        "claim_check": one.get("claim_check"),  # the bound the claim is tested with
        "detected": "empirical_exceeds_claim" in codes,
        "findings": codes,
        "noise_observed_over_claimed": {
            g: v["observed_over_claimed"]
            for g, v in ((one.get("observations") or {}).get("noise") or {}).items()
        },
        "released": (out / "release").exists(),
        "train_s": round(t1 - t0, 2),
        "audit_s": round(t2 - t1, 3),
    }
    shutil.rmtree(out, ignore_errors=True)
    return row


def _dist(vals: list) -> dict | None:
    vals = [v for v in vals if isinstance(v, int | float)]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    k = sum(r["detected"] for r in rows)
    lbs = [r["epsilon_lb"] for r in rows]
    lo, hi = clopper_pearson(k, n)
    return {
        "runs": n,
        "detected": k,
        "rate": k / n if n else float("nan"),
        "ci95": [lo, hi],
        "epsilon_lb": {
            "median": statistics.median(lbs),
            "min": min(lbs),
            "max": max(lbs),
        },
        "epsilon_lb_fdp": _dist([r["epsilon_lb_fdp"] for r in rows]),
        "epsilon_lb_claim_check": _dist([(r["claim_check"] or {}).get("epsilon_lb") for r in rows]),
        "sigma": rows[0]["sigma"],
        "epsilon_claimed": statistics.median(r["epsilon_claimed"] for r in rows),
        "released_any": any(r["released"] for r in rows),
        "wall_s": round(sum(r["train_s"] + r["audit_s"] for r in rows), 1),
    }


def table(summary: dict) -> str:
    lines = [
        "| fault | setting | detected / runs | rate (95 % CP) | ε_lb Steinke median [min, max] "
        "| ε_lb f-DP median [min, max] | σ | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        if "runs" not in s:
            lines.append(f"| {key} | – | not measured | {s['why']} | | | | |")
            continue
        fault, setting = key.split(" @ ")
        e, f = s["epsilon_lb"], s.get("epsilon_lb_fdp")
        fcol = f"{f['median']:.2f} [{f['min']:.2f}, {f['max']:.2f}]" if f else "–"
        lines.append(
            f"| {fault} | {setting} | {s['detected']} / {s['runs']} | {s['rate']:.2f} "
            f"[{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] | {e['median']:.2f} "
            f"[{e['min']:.2f}, {e['max']:.2f}] | {fcol} | {s['sigma']:.3g} | {s['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.auditing.faults", description=__doc__)
    ap.add_argument("--seeds", type=int, default=10, help="runs per fault (fresh keys)")
    ap.add_argument("--correct", type=int, default=20, help="correct runs per setting")
    ap.add_argument("--out", default="benchmarks/results/faults")
    ap.add_argument("--only", default="", help="comma-separated faults to measure (default all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    only = {f for f in args.only.split(",") if f}
    todo = [(f, s) for f, s in FAULTS if not only or f in only]
    settings = sorted({s for _, s in todo}, key=list(SETTINGS).index)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="fedlora-faults-"))

    def save() -> dict:
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(f"{r['fault']} @ {r['setting']}", []).append(r)
        summary = {k: summarize(v) for k, v in groups.items()}
        doc = {
            "settings": {
                "common": {**COMMON, "model": "tiny-bert", "dataset": "synthetic"},
                "tiny": "fl.testing.TINY (3 clients × 80 members, 2 rounds × 4 local steps, "
                "max_length 24, lr 0.02, LoRA on every layer)",
                "per_setting": SETTINGS,
                "alpha": 0.05,
                "detection": "audit finding empirical_exceeds_claim: the claim check's certified "
                "bound (the larger of Steinke et al.'s and the f-DP one, each at α/2) above the "
                "recomputed ε",
                "correct_run_seeds": "drawn with secrets.randbelow(2**31) (hidden until run)",
            },
            "summary": summary,
            "runs": rows,
            "wall_s": round(time.time() - t_start, 1),
            "fdp_available": importlib.util.find_spec("audit.bounds.fdp") is not None,
        }
        (outdir / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (outdir / "table.md").write_text(table(summary))
        return summary

    try:
        for setting in settings:
            for _ in range(args.correct):
                seed = secrets.randbelow(2**31)
                rows.append(one_run("", setting, seed, work))
                print(json.dumps(rows[-1]), flush=True)
                save()
        for fault, setting in todo:
            for seed in range(args.seeds):
                rows.append(one_run(fault, setting, seed, work))
                print(json.dumps(rows[-1]), flush=True)
                save()
        summary = save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write(table(summary))
    fa = [s for k, s in summary.items() if k.startswith("none @")]
    bad = sum(s["detected"] for s in fa)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
