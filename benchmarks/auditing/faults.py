"""Over 500 lines on purpose: one harness, whose settings, grids and runner share the cell records; the summaries and tables are faults_table.py.

Planted-fault suite: the power of the run audit at the sampling rates DP-SGD uses (issue 42,
item 3; the q = 1 suite of issue 35, item 4, extended).

``python -m benchmarks.auditing.faults --grid full [--out DIR] [--budget-min 68]``

Trains the real engine once per (cell, seed) with ``--inject-fault NAME[=VALUE]`` (a test-only
switch that plants the fault at its code path and leaves the ledger unchanged: such a run is
never released), σ calibrated by the engine from the claimed ε, and audits every run with
``audit.bundle.audit.audit_run(run, one_run=True)``. The audit never reads the fault: it finds
it from the privatized step sums of the white-box gradient canaries (or, at client level, from
the canary clients). Two findings count, each recorded on its own:

- ``mechanism_mismatch``: a conformance test (``audit/bounds/conformance.py``: the noise's
  scale, its freshness, the canaries' clipping; per parameter group A / B / head / "B
  (W-space)", Holm-corrected at α = 0.05) rejects the claimed mechanism;
- ``empirical_exceeds_claim``: the one-run ε lower bound (certified at 95 %) is above the
  recomputed ε.

A run is *flagged* when either is raised. Correct runs (no fault; seeds from the OS's secret
randomness) give the false-alarm rate. Every run gets a fresh secret noise key.

Settings (:data:`SETTINGS`; q = batch / members per client):

- tiny-bert on synthetic text (``fl.testing.TINY``: max_length 24, lr 0.02, LoRA rank 16 on
  every layer, random head), 3 clients: ``q1`` 80 members, batch 80, 2 rounds × 4 steps;
  ``q025`` 80 members, batch 20, 2 × 4; ``q005`` 160 members, batch 8, 2 × 50 (100 steps);
  ``q001`` 300 members, batch 3, 2 × 50 (100 steps; the synthetic set has 1 200 examples,
  so 3 × 300 members is as large as it goes). 2 000 gradient canaries (5 000 before issue
  42: the conformance tests need far fewer), δ = 1e-5. 400 sampler canaries per client (what
  the default job's DP runs carry) in the correct runs, ``fixed_batches`` and every minilm
  run; the noise faults' runs go without them (:data:`SAMPLER_CANARIES`).
- ``client``: client-level FedAvg-LoRA (tiny-bert), server noise, 3 clients of 20, every
  client every round, 3 rounds of 1 local step, C = 0.5, rank 64, 4 000 canary clients.
- ``minilm``: the default preset of ``fedlora run`` (``pipeline.job.PRESETS["default"]``:
  all-MiniLM-L6-v2 on tweets, 5 clients × 400, batches of 128, q = 0.32, 3 rounds × 6
  steps, LoRA rank 8 on the top layer, zero head) at sample level with 5 000 gradient
  canaries and the preset's δ (1/(10·400)); ``minilm-q005``: the same with batches of 20
  (q = 0.05) and 2 rounds × 50 steps (5 000 gradient canaries, 400 sampler canaries per
  client).

Grids (``--grid``; :data:`GRIDS`): ``full`` the committed table; ``minilm-power`` the power
curve at the default preset (10 seeds per factor; its own ``--out``); ``quick`` one short run
per new setting (the harness test); ``timing`` one run of each setting (prints train_s and
audit_s). ``--budget-min`` stops launching cells once the wall time passes it (what was
skipped is listed in results.json); the grid is ordered so that the stated targets come first.
The tables (``faults_table.py``): per cell the flag rate with its Clopper–Pearson 95 %
interval, each finding's count, ε_lb, the noise-implied ε, the per-group observed/claimed
noise ratios and the audit's wall time; the false alarms over every correct run; the power
curve (the largest noise factor f < 1 flagged in ≥ 9/10 seeds at each q).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: tiny-bert settings (TrainConfig overrides on top of fl.testing.TINY); ``q`` is nominal
TINY_COMMON = dict(rank=16, canaries=2000, canary_kind="gradient", delta=1e-5)
#: sampler canaries per client (as the default job's DP runs carry, #42 item 4) in the runs
#: whose sampling is audited: the correct runs, ``fixed_batches`` and every minilm run. The
#: noise faults' runs go without them (their permutation test costs seconds per run at small
#: q and tests the sampling, which those faults leave as claimed): their power is the
#: gradient canaries' tests'
SAMPLER_CANARIES = 400
SAMPLER_FAULTS = ("", "fixed_batches")
SETTINGS: dict[str, dict] = {
    "q1": dict(TINY_COMMON, members=240, batch_size=80, rounds=2, local_steps=4),
    "q025": dict(TINY_COMMON, members=240, batch_size=20, rounds=2, local_steps=4),
    "q005": dict(TINY_COMMON, members=480, batch_size=8, rounds=2, local_steps=50),
    "q001": dict(TINY_COMMON, members=900, batch_size=3, rounds=2, local_steps=50),
    # client level: FedAvg-LoRA, server noise, M canary clients (docs/audit.md, "Canary
    # clients"): every client every round, 3 rounds of 1 local step, C = 0.5, rank 64
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
        delta=1e-5,
    ),
    # the default preset (pipeline.job.PRESETS["default"].base is added in config())
    "minilm": dict(dp_level="sample", canaries=5000, canary_kind="gradient"),
    "minilm-q005": dict(
        dp_level="sample",
        canaries=5000,
        canary_kind="gradient",
        batch_size=20,
        rounds=2,
        local_steps=50,
    ),
}
#: the model each setting trains (minilm: the default preset's base)
MINILM = ("minilm", "minilm-q005")
#: nominal sampling rate of each setting (batch / members per client)
Q = {
    "q1": 1.0,
    "q025": 0.25,
    "q005": 0.05,
    "q001": 0.01,
    "client": 1.0,
    "minilm": 0.32,
    "minilm-q005": 0.05,
}
#: per-method overrides (FedASK keeps its default clip_space=w: W-space slots)
METHOD_OPTS: dict[str, dict] = {
    "plora": dict(client_ranks="8,16"),
    "fedask-b": dict(method="fedask", opts={"clip_space": "b"}),
}
#: the faults whose targets issue 42 states (flagged in >= 9/10 seeds at every q)
TARGET_FAULTS = (
    "noise_scale=0.25",
    "noise_scale=0.5",
    "head_unnoised",
    "factor_unnoised=A",
    "noise_reuse",
    "no_clip",
)
#: kept in the table with its measured power: the gradient canaries cannot see it (the auditor
#: draws their coins), the sampler canaries' permutation test can
OTHER_FAULTS = ("fixed_batches",)
TINY_QS = ("q1", "q025", "q005", "q001")
#: the power curve's noise factors, tried from the largest down until one is flagged in >= 9/10
POWER_FS = (0.99, 0.98, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6)


def config(
    setting: str,
    eps: float,
    method: str,
    partition: str,
    fault: str,
    seed: int,
    quick: bool = False,
):
    """The TrainConfig of one run."""
    from fl.run.config import TrainConfig
    from fl.testing import tiny_config

    over = dict(SETTINGS[setting])
    over.update({"method": method, **METHOD_OPTS.get(method, {})})
    over.update(epsilon=eps, seed=seed, inject_fault=fault, partition=partition)
    if over.get("dp_level", "sample") == "sample" and (
        fault in SAMPLER_FAULTS or setting in MINILM
    ):
        over["sampler_canaries"] = SAMPLER_CANARIES
    if quick:  # the harness test: short trainings, few canaries
        over["local_steps"] = min(over.get("local_steps", 4), 3)
        if over.get("canaries"):
            over["canaries"] = 500
        if over.get("canary_clients"):
            over["canary_clients"] = 1000
        if over.get("sampler_canaries"):
            over["sampler_canaries"] = 100
    if setting in MINILM:
        from pipeline.job import PRESETS

        base = dict(PRESETS["default"].base)
        base.update(over)
        return TrainConfig(**base, progress=False, device="cpu")
    return tiny_config(**over)


def _conformance(one: dict) -> dict | None:
    c = one.get("conformance")
    if not isinstance(c, dict):
        return None
    tests = [
        {
            k: t.get(k)
            for k in (
                "group",
                "test",
                "terms",
                "observed_over_claimed",
                "ratio_ci",
                "ratio_upper",
                "log10_p",
                "rejected",
            )
            if k in t
        }
        for t in c.get("tests", [])
    ]
    return {
        "passed": c.get("passed"),
        "rejected": c.get("rejected"),
        "tests": tests,
        "implied_factor": c.get("implied_factor"),
        "implied_factor_group": c.get("implied_factor_group"),
        "implied_epsilon": c.get("implied_epsilon"),
        "implied_epsilon_at_least": c.get("implied_epsilon_at_least"),
        "coins": c.get("coins"),
        "skipped": c.get("skipped"),
        "tested": c.get("tested", True),  # False: FedPower at client level (its note says why)
        "note": c.get("note"),
        "sampling": c.get("sampling"),  # the sampler canaries' permutation test
    }


def one_run(cell: dict, seed: int, work: Path, quick: bool = False) -> dict:
    """Train one run (a fresh secret key) of ``cell`` and audit it; the row."""
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    fault = cell["fault"] if cell["fault"] != "none" else ""
    cfg = config(
        cell["setting"], cell["eps"], cell["method"], cell["partition"], fault, seed, quick
    )
    out = work / f"run-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    m = train(cfg, out, quiet=True)
    t1 = time.perf_counter()
    res = audit_run(out, one_run=True)
    t2 = time.perf_counter()
    one = res["one_run"]
    codes = sorted({f["code"] for f in res["findings"]})
    conf = _conformance(one)
    level = cfg.dp_level
    priv = m["privacy"]
    rates = [float(v) for v in (priv.get("sample_rates") or {}).values()]
    row = {
        **{k: cell[k] for k in ("fault", "setting", "eps", "method", "partition", "stage")},
        "model": cfg.model,
        "level": level,
        "seed": seed,
        "q": Q[cell["setting"]],
        "q_clients": [min(rates), max(rates)] if rates else None,
        "steps": cfg.rounds * cfg.local_steps,
        "canaries": cfg.canaries,
        "sampler_canaries": cfg.sampler_canaries,
        "canary_clients": cfg.canary_clients,
        "epsilon_claimed": res["epsilon_pld"],
        "delta": priv.get("delta"),
        "sigma": priv["noise_multiplier"],
        "epsilon_lb": one.get("epsilon_lb"),  # Steinke et al. at α
        "epsilon_lb_fdp": one.get("fdp", {}).get("epsilon_lb", one.get("epsilon_lb_fdp")),
        "epsilon_lb_claim_check": (one.get("claim_check") or {}).get("epsilon_lb"),
        "empirical_exceeds_claim": "empirical_exceeds_claim" in codes,
        "mechanism_mismatch": "mechanism_mismatch" in codes,
        "conformance": conf if conf is not None else "pending",
        # which tests rejected: the noise's (scale, fresh, clip of the gradient canaries or
        # canary clients) or the sampler canaries' (sampling)
        "mismatch_noise": any(
            not x.endswith(":sampling") for x in ((conf or {}).get("rejected") or [])
        ),
        "mismatch_sampler": any(
            x.endswith(":sampling") for x in ((conf or {}).get("rejected") or [])
        ),
        "implied_epsilon": one.get("implied_epsilon"),
        "findings": codes,
        "released": (out / "release").exists(),
        "train_s": round(t1 - t0, 2),
        "audit_s": round(t2 - t1, 3),
    }
    row["flagged"] = row["empirical_exceeds_claim"] or row["mechanism_mismatch"]
    shutil.rmtree(out, ignore_errors=True)
    return row


def cell(
    fault="none", setting="q1", eps=3.0, method="fedavg", partition="iid", seeds=10, stage="target"
) -> dict:
    """One cell of a grid: ``seeds`` runs (fault seeds 0..n-1; correct runs: secret seeds)."""
    return dict(
        fault=fault,
        setting=setting,
        eps=eps,
        method=method,
        partition=partition,
        seeds=seeds,
        stage=stage,
    )


def power(setting: str, eps: float = 3.0, seeds: int = 10, fs=POWER_FS) -> dict:
    """A power-curve item: noise_scale=f for f in ``fs`` (largest first) until one is flagged
    in >= 90 % of ``seeds``."""
    return dict(power=True, setting=setting, eps=eps, seeds=seeds, fs=tuple(fs))


def grid_full() -> list[dict]:
    """The committed grid, in priority order (the stated targets first; ``--budget-min``
    skips what is left when time runs out)."""
    g: list[dict] = []
    # 1. the targets: each fault at each q, ε = 3, 10 seeds (fedavg, IID)
    for s in TINY_QS:
        for f in TARGET_FAULTS + OTHER_FAULTS:
            g.append(cell(f, s, 3.0, seeds=10))
    # 2. correct runs (false alarms): methods × partitions × q × ε, sample level (tiny)
    methods = ("fedavg", "ffa", "fedask", "fedpower", "plora")
    k = 0
    for s in TINY_QS:
        for eps in (1.0, 3.0, 8.0):
            for part in ("iid", "dirichlet"):
                g.append(cell("none", s, eps, methods[k % len(methods)], part, 1, "correct"))
                k += 1
    for s in ("q005", "q001"):  # W-space slots and FedPower at the small rates
        for m in methods:
            g.append(cell("none", s, 3.0, m, "dirichlet", 1, "correct"))
    for s in ("q1", "q025"):
        for m in methods:
            g.append(cell("none", s, 3.0, m, "iid", 1, "correct"))
    # client level (canary clients; FedPower's factored space is not conformance-tested)
    for m in ("fedavg", "ffa", "fedpower"):
        for part in ("iid", "dirichlet"):
            g.append(cell("none", "client", 3.0, m, part, 1, "correct"))
    for eps in (1.0, 8.0):
        for m, part in (
            ("fedavg", "iid"),
            ("fedavg", "dirichlet"),
            ("ffa", "iid"),
            ("fedpower", "iid"),
        ):
            g.append(cell("none", "client", eps, m, part, 1, "correct"))
    # 3. the power curve at each q (ε = 3, 10 seeds per noise factor)
    for s in TINY_QS:
        g.append(power(s, 3.0, 10))
    # 4. the default preset (minilm/tweets, ε = 3; 2 seeds per cell: a run costs 1.5 min)
    # and one small-q minilm setting (1 seed per cell)
    g.append(cell("none", "minilm", 3.0, seeds=2, stage="minilm"))
    for f in ("noise_scale=0.5", "noise_scale=0.8", "head_unnoised"):
        g.append(cell(f, "minilm", 3.0, seeds=2, stage="minilm"))
    for f in ("none", "noise_scale=0.8", "noise_scale=0.5"):
        g.append(cell(f, "minilm-q005", 3.0, seeds=1, stage="minilm"))
    # 5. FedPower and FedASK (W-space) faults at q = 0.05, client-level faults
    for f in ("noise_scale=0.5", "head_unnoised", "no_clip", "noise_reuse"):
        g.append(cell(f, "q005", 3.0, "fedpower", seeds=3, stage="fedpower"))
    for f in ("noise_scale=0.5", "fedask_stage1_unnoised"):
        g.append(cell(f, "q005", 3.0, "fedask", seeds=3, stage="fedask"))
    for f in ("server_noise_omitted", "noise_scale=0.25", "noise_scale=0.5"):
        g.append(cell(f, "client", 3.0, seeds=3, stage="client"))
    # 6. the other ε: every noise fault at every q, 3 seeds (2 at q <= 0.05, where a run
    # costs 5-10 s)
    for f in TARGET_FAULTS:
        for s in TINY_QS:
            for eps in (1.0, 8.0):
                n = 2 if Q[s] <= 0.05 else 3
                g.append(cell(f, s, eps, seeds=n, stage="other-eps"))
    return g


def grid_quick() -> list[dict]:
    """The harness test: one short run per new setting with a blatant fault, one correct.
    At ε = 0.25, not the grids' 3: σ is larger (2.3 and 1.08 instead of 0.75 and 0.56),
    and the PLDs that calibrate, check and imply ε, most of the test's time, cost less (a
    PLD's grid grows as σ falls: 11 s of CPU for the three runs instead of 20); what the
    test checks (the fault flagged, the noise ratios near 1/4, the correct run passing) does
    not depend on σ."""
    return [
        cell("noise_scale=0.25", "q005", 0.25, seeds=1, stage="quick"),
        cell("noise_scale=0.25", "q001", 0.25, seeds=1, stage="quick"),
        cell("none", "q001", 0.25, "fedask", "dirichlet", 1, "quick"),
    ]


def grid_timing() -> list[dict]:
    """One run of each setting (and of the slower methods), to size the full grid."""
    g = [cell("none", s, 3.0, seeds=1, stage="timing") for s in (*TINY_QS, "client", *MINILM)]
    g += [cell("none", "q001", 3.0, m, "dirichlet", 1, "timing") for m in ("fedask", "fedpower")]
    return g


def grid_minilm_power() -> list[dict]:
    """The power curve at the default preset (minilm/tweets, q = 0.32, ε = 3), 10 seeds per
    noise factor, from 0.95 down until one is flagged in >= 9/10 (about 1 min a run)."""
    return [power("minilm", 3.0, 10, fs=(0.95, 0.9, 0.8))]


def grid_sampler() -> list[dict]:
    """The sampler test at the verdict's α = 0.001 (window scan, sequential p): the planted
    fault fixed_batches at each q (10 seeds at q = 0.05, 3 elsewhere) and correct runs with
    sampler canaries (5 per q: false alarms)."""
    g = [
        cell("fixed_batches", s, 3.0, seeds=10 if s == "q005" else 3, stage="sampler")
        for s in TINY_QS
    ]
    g += [cell("none", s, 3.0, "fedavg", "iid", 5, "sampler") for s in TINY_QS]
    return g


GRIDS = {
    "full": grid_full,
    "sampler": grid_sampler,
    "quick": grid_quick,
    "timing": grid_timing,
    "minilm-power": grid_minilm_power,
}


def _meta(argv: list[str], grid: str) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout
        except Exception:  # noqa: BLE001 - not a checkout
            return ""

    return {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.auditing.faults " + " ".join(argv),
        "grid": grid,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        # run from a clean export (git archive) of a commit, the checkout is not a repo:
        # FAULTS_COMMIT names the commit
        "commit": git("rev-parse", "HEAD").strip() or os.environ.get("FAULTS_COMMIT", "?"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
        "source": "git checkout"
        if git("rev-parse", "HEAD").strip()
        else "clean export (git archive) of the commit",
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (one process, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), Python {platform.python_version()}",
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.auditing import faults_table as FT

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.auditing.faults", description=__doc__)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--out", default="benchmarks/results/faults")
    ap.add_argument(
        "--budget-min",
        type=float,
        default=0.0,
        help="stop launching cells after this many minutes (0 = run everything)",
    )
    ap.add_argument("--stages", default="", help="comma-separated stages to run (default all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    quick = args.grid == "quick"
    plan = GRIDS[args.grid]()
    if args.stages:
        keep = set(args.stages.split(","))
        plan = [p for p in plan if p.get("stage", "power") in keep]
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    meta = _meta(argv, args.grid)
    rows: list[dict] = []
    skipped: list[dict] = []
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="fedlora-faults-"))

    def over_budget() -> bool:
        return bool(args.budget_min) and time.time() - t_start > 60 * args.budget_min

    def run_cell(c: dict) -> list[dict]:
        got = []
        for i in range(c["seeds"]):
            seed = secrets.randbelow(2**31) if c["fault"] == "none" else i
            r = one_run(c, seed, work, quick)
            rows.append(r)
            got.append(r)
            print(
                json.dumps(
                    {
                        k: r[k]
                        for k in (
                            "fault",
                            "setting",
                            "eps",
                            "method",
                            "partition",
                            "seed",
                            "flagged",
                            "mechanism_mismatch",
                            "empirical_exceeds_claim",
                            "train_s",
                            "audit_s",
                        )
                    }
                ),
                flush=True,
            )
            save()
        return got

    def save() -> None:
        doc = FT.document(rows, meta, skipped, round(time.time() - t_start, 1), SETTINGS)
        (outdir / "results.json").write_text(FT.dumps(doc))
        (outdir / "table.md").write_text(FT.markdown(doc))

    try:
        for item in plan:
            if over_budget():
                skipped.append(item)
                continue
            if item.get("power"):
                for f in item["fs"]:
                    c = cell(
                        f"noise_scale={f}",
                        item["setting"],
                        item["eps"],
                        seeds=item["seeds"],
                        stage="power",
                    )
                    got = run_cell(c)
                    if sum(r["flagged"] for r in got) >= 0.9 * len(got) or over_budget():
                        break
            else:
                run_cell(item)
        save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write((outdir / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
