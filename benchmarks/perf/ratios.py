"""Every ratio a `fedlora bench` document measured, as one flat list (the `ratios` key).

Each benchmark record (``benchmarks/<name>.py``) carries one headline ratio and more in
its ``details``; :func:`ratio_list` lifts all of them into entries of one shape:

    {"id", "benchmark", "what", "kind": "time" | "speedup", "value", "spread",
     "target", "met", "measured": true, ...}

``spread`` is the harness's paired-ratio summary (``median``, ``min``, ``max``,
``boot_lo``/``boot_hi`` of a bootstrap 90% interval of the median, ``n`` pairs) or, for
a ratio with one measurement per run, ``min``/``max`` over the runs; ``null`` for a
derived point estimate. ``target``/``met`` are issue 20's where it states one (``met``
is null in ``--quick`` mode, whose workloads are not the stated ones).

The ratios issue 20 asks for that this run did not measure are listed too, with
``"measured": false`` and the ``reason`` (a benchmark not selected, no CUDA device) —
never a number.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.perf import aggregation, dp_overhead, engine_overhead, noise_source

# The issues' targets (the benchmarks' own constants): id -> (text, test on the value).
TARGETS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "dp_step_over_nodp_step/cpu/minilm": (
        f"<= {dp_overhead.TARGET:g}",
        lambda v: v <= dp_overhead.TARGET,
    ),
    "engine_wall_over_local_compute": (
        f"<= {engine_overhead.TARGET:g}",
        lambda v: v <= engine_overhead.TARGET,
    ),
    "powerdp_factored_speedup/4096/K10": (
        f">= {aggregation.TARGET:g}",
        lambda v: v >= aggregation.TARGET,
    ),
    "keyed_over_seeded_step/cpu/minilm": (
        f"<= {noise_source.TARGET:g}",
        lambda v: v <= noise_source.TARGET,
    ),
    "dp_step_over_nodp_step/cuda/bert-base/bf16": ("<= 1.15", lambda v: v <= 1.15),
}

# The ratios the issue names, by the benchmark that measures them (for "not run" rows).
REQUIRED: dict[str, list[tuple[str, str, str]]] = {
    "dp_overhead": [
        ("dp_step_over_nodp_step/cpu/minilm", "time", "DP-SGD step / non-DP step, minilm"),
    ],
    "engine_overhead": [
        (
            "engine_wall_over_local_compute",
            "time",
            "engine wall (minus set-up) / Σ clients' local training",
        ),
    ],
    "aggregation": [
        (
            "powerdp_factored_speedup/4096/K10",
            "speedup",
            "PowerDP dense / factored time, 4096², r=16, K=10",
        ),
    ],
    "noise_source": [
        ("keyed_over_seeded_step/cpu/minilm", "time", "keyed CSPRNG DP step / seeded DP step"),
    ],
    "length_buckets": [
        ("length_buckets_over_single_pass", "time", "DP-SGD step, length buckets / one pass")
    ],
    "attacks": [("shadow_over_plain_run", "time", "one shadow model / one plain run")],
    "fedask_clip": [("wspace_over_bspace_clip", "time", "W-space / B-space clipping step")],
    "accounting": [("pld_over_rdp_calibration", "time", "PLD / RDP noise calibration")],
}

GPU_REQUIRED = [
    (f"dp_step_over_nodp_step/cuda/{m}/{p}", "time", f"DP-SGD step / non-DP step on CUDA, {m} {p}")
    for m in ("minilm", "bert-base")
    for p in ("fp32", "bf16")
]


def entry(
    id_: str,
    benchmark: str,
    what: str,
    kind: str,
    value: float | None,
    spread: dict | None,
    quick: bool,
    **extra,
) -> dict:
    """One measured ratio; target/met from :data:`TARGETS` (met null in quick mode)."""
    tgt = TARGETS.get(id_)
    met = None if (tgt is None or quick or value is None) else bool(tgt[1](value))
    return {
        "id": id_,
        "benchmark": benchmark,
        "what": what,
        "kind": kind,
        "value": value,
        "spread": spread,
        "target": tgt[0] if tgt else None,
        "met": met,
        "measured": value is not None,
        **extra,
    }


def unmeasured(id_: str, benchmark: str, what: str, kind: str, reason: str) -> dict:
    tgt = TARGETS.get(id_)
    return {
        "id": id_,
        "benchmark": benchmark,
        "what": what,
        "kind": kind,
        "value": None,
        "spread": None,
        "target": tgt[0] if tgt else None,
        "met": None,
        "measured": False,
        "reason": reason,
    }


def _dp_overhead(r: dict, q: bool, dev: str) -> list[dict]:
    out = []
    d = r["details"]
    cases = d.get("cases") or [{"model": k, **v} for k, v in d.get("per_model", {}).items()]
    for m in cases:
        name = m["model"].rstrip("/").rsplit("/", 1)[-1]
        name = "bert-base" if name.startswith("bert-base") else name  # the random BERT-base
        prec = m.get("precision", "fp32")
        tag = f"{dev}/{name}" + (f"/{prec}" if dev == "cuda" else "")
        shape = f"{name}{' ' + prec if dev == 'cuda' else ''} (batch {m['batch_size']}, seq {m['seq_len']})"
        rows = [
            ("dp_step_over_nodp_step", "DP-SGD step / non-DP step", m["spread"], "nodp_step", "dp_step"),
            ("dp_per_parameter_step_over_nodp_step", "DP-SGD step with the per-parameter clipping and noise (before the fused step) / non-DP step", m.get("per_parameter_over_nodp"), "nodp_step", "dp_per_parameter_step"),
            ("dp_fused_over_per_parameter_step", "DP-SGD step, fused / per-parameter clipping and noise", m.get("fused_over_per_parameter"), "dp_per_parameter_step", "dp_step"),
        ]  # fmt: skip
        for prefix, what, sp, base, cand in rows:
            if sp is None:
                continue
            extra = {"seconds": {"baseline": m[base], "candidate": m[cand]}}
            if prefix == "dp_step_over_nodp_step" and "noise_draw" in m:
                extra["noise_draw"] = m["noise_draw"]
            if prefix == "dp_step_over_nodp_step" and "host_syncs" in m:
                extra["host_syncs"] = m["host_syncs"]
            out.append(
                entry(
                    f"{prefix}/{tag}",
                    r["name"],
                    f"{what}, {shape}",
                    "time",
                    sp["median"],
                    sp,
                    q,
                    **extra,
                )
            )
    return out


def _noise_source(r: dict, q: bool, dev: str) -> list[dict]:
    out = []
    for model, m in r["details"].get("per_model", {}).items():
        out.append(
            entry(
                f"keyed_over_seeded_step/{dev}/{model}",
                r["name"],
                f"keyed CSPRNG DP step / seeded DP step, {model}",
                "time",
                m["ratio"],
                m["spread"],
                q,
                seconds={"baseline": m["seeded_step"], "candidate": m["keyed_step"]},
            )
        )
        out.append(
            entry(
                f"keyed_over_seeded_step_from_draws/{dev}/{model}",
                r["name"],
                f"1 + (keyed - seeded draw time) / seeded step, {model} (point estimate)",
                "time",
                m["ratio_from_draws"],
                None,
                q,
            )
        )
    return out


def _fedask_clip(r: dict, q: bool, dev: str) -> list[dict]:
    d = r["details"]
    return [
        entry(
            f"{key}_clip",
            r["name"],
            f"{what} per local step, {d.get('model')}",
            "time",
            d[key]["median"],
            d[key],
            q,
        )
        for key, what in (
            ("wspace_over_bspace", "W-space / B-space clipping"),
            ("bspace_over_none", "B-space DP / no DP"),
            ("wspace_over_none", "W-space DP / no DP"),
        )
        if key in d
    ]


def _engine_overhead(r: dict, q: bool, dev: str) -> list[dict]:
    out = [
        entry(
            "engine_wall_over_local_compute",
            r["name"],
            "engine wall / Σ clients' local training, both less the one-off set-up and "
            "frozen-prefix caches (one round, one run)",
            "time",
            r["ratio"],
            r["spread"],
            q,
        )
    ]
    incl = [x["ratio_incl_prefix_cache"] for x in r["details"].get("runs", [])]
    incl = [v for v in incl if v is not None]
    if incl:
        out.append(
            entry(
                "engine_wall_over_local_compute_incl_prefix_cache",
                r["name"],
                "(engine wall - set-up) / Σ clients' local training, the one-off frozen-prefix "
                "caches left in (the members' in local training, the test set's in the "
                "round's evaluation; the definition before 2026-12-01b)",
                "time",
                sorted(incl)[len(incl) // 2],
                {"median": sorted(incl)[len(incl) // 2], "min": min(incl), "max": max(incl),
                 "n": len(incl)},
                q,
            )
        )  # fmt: skip
    fl = r["details"].get("flower") or {}
    if "wall_over_inprocess" in fl:
        out.append(
            entry(
                "flower_wall_over_inprocess",
                r["name"],
                "the same run on Flower's simulation engine / in process (one run)",
                "time",
                fl["wall_over_inprocess"],
                None,
                q,
            )
        )
    return out


# aggregation's paired speed-ups per case: (details key, id prefix, what, seconds keys).
_AGG = (
    (
        "powerdp_speedup",
        "powerdp_factored_speedup",
        "PowerDP dense / factored time",
        ("powerdp_dense", "powerdp_factored"),
    ),
    (
        "powerdp_speedup_1thread",
        "powerdp_factored_speedup_1thread",
        "PowerDP dense / factored time, one intra-op thread on both sides",
        ("powerdp_dense_1thread", "powerdp_factored_1thread"),
    ),
    (
        "fedask_speedup",
        "fedask_sketch_speedup",
        "dense average + randomized SVD / FedASK sketch time",
        ("naive_svd", "fedask_sketch"),
    ),
    (
        "fedask_speedup_vs_full_svd",
        "fedask_sketch_speedup_vs_full_svd",
        "dense average + full SVD / FedASK sketch time",
        ("naive_full_svd", "fedask_sketch"),
    ),
    (
        "projection_stacked_speedup",
        "projection_stacked_speedup",
        "one projection W̄X: per-client loop / stacked factors",
        ("projection_loop", "projection_stacked"),
    ),
)


def _aggregation(r: dict, q: bool, dev: str) -> list[dict]:
    out = []
    for c in r["details"].get("cases", []):
        tag = f"{c['size']}/K{c['K']}"
        for key, prefix, what, (base, cand) in _AGG:
            if key not in c:
                continue
            extra = {"seconds": {"baseline": c.get(base), "candidate": c.get(cand)}}
            if key == "powerdp_speedup" and "peak_memory" in c:
                extra["peak_memory"] = c["peak_memory"]
            out.append(
                entry(
                    f"{prefix}/{tag}",
                    r["name"],
                    f"{what}, {c['size']}², r={c['rank']}, K={c['K']}",
                    "speedup",
                    c[key]["median"],
                    c[key],
                    q,
                    **extra,
                )
            )
    return out


def _attacks(r: dict, q: bool, dev: str) -> list[dict]:
    return [
        entry(
            "shadow_over_plain_run",
            r["name"],
            "one shadow model (attacks.reference.train_shadows) / one plain fl.run.engine run",
            "time",
            r["ratio"],
            r["spread"],
            q,
        )
    ]


def _shadow_cost(r: dict, q: bool, dev: str) -> list[dict]:
    return [
        entry(
            "shadow_shared_prefix_over_own",
            r["name"],
            f"one shadow model, the pool's frozen prefix encoded once / per shadow pair "
            f"(k = {r['details'].get('k')})",
            "time",
            r["ratio"],
            r["spread"],
            q,
        )
    ]


def _length_buckets(r: dict, q: bool, dev: str) -> list[dict]:
    d = r["details"]
    return [
        entry(
            "length_buckets_over_single_pass",
            r["name"],
            f"DP-SGD step with length buckets / one padded pass, {d.get('model')} on tweets",
            "time",
            r["ratio"],
            r["spread"],
            q,
        )
    ]


def _accounting(r: dict, q: bool, dev: str) -> list[dict]:
    return [
        entry(
            "pld_over_rdp_calibration",
            r["name"],
            f"PLD / RDP calibrate_noise time, {r['details'].get('steps')} steps",
            "time",
            r["ratio"],
            r["spread"],
            q,
        )
    ]


EXTRACT: dict[str, Callable[[dict, bool, str], list[dict]]] = {
    "dp_overhead": _dp_overhead,
    "length_buckets": _length_buckets,
    "noise_source": _noise_source,
    "fedask_clip": _fedask_clip,
    "engine_overhead": _engine_overhead,
    "aggregation": _aggregation,
    "attacks": _attacks,
    "shadow_cost": _shadow_cost,
    "accounting": _accounting,
}


def ratio_list(doc: dict) -> list[dict]:
    """The flat list of every ratio in a bench document ({"meta", "results"}), then the
    issue's ratios this run did not measure (``measured: false`` with the reason)."""
    quick = bool(doc["meta"].get("quick"))
    dev = "cuda" if str(doc["meta"].get("device", "cpu")).startswith("cuda") else "cpu"
    out: list[dict] = []
    ran = set()
    for r in doc["results"]:
        ran.add(r["name"])
        if not r.get("available", True):
            why = r.get("details", {}).get("reason", "not available")
            out += [
                unmeasured(i, r["name"], w, k, f"not available: {why}")
                for i, k, w in REQUIRED.get(r["name"], [])
            ]
            continue
        out += EXTRACT[r["name"]](r, quick, dev)
    have = {e["id"] for e in out}
    for bench, rows in REQUIRED.items():
        for id_, kind, what in rows:
            if id_ not in have and bench not in ran:
                out.append(
                    unmeasured(id_, bench, what, kind, f"benchmark {bench} not run in this call")
                )
            elif id_ not in have and bench in ran and dev == "cpu":
                out.append(
                    unmeasured(id_, bench, what, kind, "not in this mode's workload (--quick)")
                )
    why = (
        "needs a CUDA device; this run was on the CPU (benchmarks/gpu/gpu_dp_step.sh measures it "
        "in one call; an H200 run before the fused DP step: benchmarks/results/h200-2026-11-30/)"
        if dev != "cuda"
        else "not in this call (benchmarks/gpu/gpu_dp_step.sh runs dp_overhead with "
        "FEDLORA_BENCH_DP_MODELS=minilm,bert-base-random, fp32 and bf16)"
    )
    have = {e["id"] for e in out}
    out += [
        unmeasured(id_, "dp_overhead", what, kind, why)
        for id_, kind, what in GPU_REQUIRED
        if id_ not in have
    ]
    return out
