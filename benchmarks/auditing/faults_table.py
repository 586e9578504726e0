"""Over 500 lines on purpose: one table, whose summaries (flag rates, false alarms, power curve) and Markdown rendering read the same cell records.

The planted-fault suite's summaries and tables (``benchmarks.auditing.faults``): per cell
the flag rate with its Clopper–Pearson interval and each finding's count, the false alarms
over every correct run, the power curve, the audits' wall times."""

from __future__ import annotations

import math
import statistics

ALPHA = 0.05
#: a fault counts as detected at a q when flagged in at least this share of its seeds
TARGET_RATE = 0.9


def _conformance_alpha() -> float:
    """The conformance family's verdict level the runs were audited at (runs before it was
    recorded were audited at 0.05, the default :func:`markdown` assumes)."""
    from audit.bounds.conformance import ALPHA as CONFORMANCE_ALPHA

    return CONFORMANCE_ALPHA


def clopper_pearson(k: int, n: int, alpha: float = ALPHA) -> tuple[float, float]:
    """The exact (Clopper–Pearson) 1 − alpha interval of a binomial proportion k/n."""
    from scipy.stats import beta

    if n == 0:
        return 0.0, 1.0
    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def _num(v) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _dist(vals) -> dict | None:
    vals = [v for v in map(_num, vals) if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def cell_key(r: dict) -> str:
    return f"{r['fault']} @ {r['setting']} ε={r['eps']:g} {r['method']}/{r['partition']}"


def _ratios(rows: list[dict]) -> dict:
    """Per group and test: the median observed/claimed ratio and the median upper bound."""
    acc: dict[str, dict[str, list]] = {}
    for r in rows:
        c = r.get("conformance")
        if not isinstance(c, dict):
            continue
        for t in c["tests"]:
            if t.get("observed_over_claimed") is None:
                continue
            a = acc.setdefault(f"{t['group']}:{t['test']}", {"ratio": [], "upper": []})
            a["ratio"].append(t["observed_over_claimed"])
            a["upper"].append(t.get("ratio_upper"))
    return {k: {"ratio": _dist(v["ratio"]), "upper": _dist(v["upper"])} for k, v in acc.items()}


def _rejected(rows: list[dict]) -> dict:
    out: dict[str, int] = {}
    for r in rows:
        c = r.get("conformance")
        for name in c.get("rejected") or [] if isinstance(c, dict) else []:
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    k = sum(r["flagged"] for r in rows)
    lo, hi = clopper_pearson(k, n)
    conf = [r["conformance"] for r in rows]
    implied = [(c or {}).get("implied_epsilon") if isinstance(c, dict) else None for c in conf]
    first = rows[0]
    return {
        **{
            x: first[x]
            for x in (
                "fault",
                "setting",
                "eps",
                "method",
                "partition",
                "model",
                "level",
                "q",
                "steps",
                "stage",
            )
        },
        "runs": n,
        "flagged": k,
        "rate": k / n if n else math.nan,
        "ci95": [lo, hi],
        "mechanism_mismatch": sum(r["mechanism_mismatch"] for r in rows),
        "mismatch_noise": sum(r.get("mismatch_noise", False) for r in rows),
        "mismatch_sampler": sum(r.get("mismatch_sampler", False) for r in rows),
        "empirical_exceeds_claim": sum(r["empirical_exceeds_claim"] for r in rows),
        "conformance": "pending"
        if all(c == "pending" for c in conf)
        else "not tested"
        if all(isinstance(c, dict) and c.get("tested") is False for c in conf)
        else "available",
        "sampling_z": {
            "window": _dist(
                ((c or {}).get("sampling") or {}).get("z_window") if isinstance(c, dict) else None
                for c in conf
            ),
            "phase": _dist(
                ((c or {}).get("sampling") or {}).get("z_phase") if isinstance(c, dict) else None
                for c in conf
            ),
        },
        "rejected_tests": _rejected(rows),
        "epsilon_claimed": statistics.median(r["epsilon_claimed"] for r in rows),
        "sigma": statistics.median(r["sigma"] for r in rows),
        "q_clients": [min(r["q_clients"][0] for r in rows), max(r["q_clients"][1] for r in rows)]
        if all(r.get("q_clients") for r in rows)
        else None,
        "epsilon_lb": _dist(r["epsilon_lb"] for r in rows),
        "epsilon_lb_claim_check": _dist(r["epsilon_lb_claim_check"] for r in rows),
        "implied_epsilon": _dist(implied),
        "implied_epsilon_at_least": any(
            isinstance(c, dict) and c.get("implied_epsilon_at_least") for c in conf
        ),
        "implied_epsilon_infinite": sum(1 for v in implied if v == math.inf),
        "ratios": _ratios(rows),
        "audit_s": _dist(r["audit_s"] for r in rows),
        "train_s": _dist(r["train_s"] for r in rows),
        "released_any": any(r["released"] for r in rows),
    }


def false_alarms(rows: list[dict]) -> dict:
    """Every correct run, and its breakdowns (method, level, partition, model, setting)."""
    ok = [r for r in rows if r["fault"] == "none"]

    def part(rs):
        k = sum(r["flagged"] for r in rs)
        return {
            "runs": len(rs),
            "flagged": k,
            "mechanism_mismatch": sum(r["mechanism_mismatch"] for r in rs),
            "mismatch_noise": sum(r.get("mismatch_noise", False) for r in rs),
            "mismatch_sampler": sum(r.get("mismatch_sampler", False) for r in rs),
            "empirical_exceeds_claim": sum(r["empirical_exceeds_claim"] for r in rs),
            "ci95": list(clopper_pearson(k, len(rs))),
        }

    out = {"all": part(ok)}
    for field in ("method", "level", "partition", "model", "setting", "eps"):
        vals = sorted({str(r[field]) for r in ok})
        out[field] = {v: part([r for r in ok if str(r[field]) == v]) for v in vals}
    out["with_conformance"] = part([r for r in ok if isinstance(r["conformance"], dict)])
    return out


def power_curve(rows: list[dict]) -> dict:
    """Per setting (fedavg, IID, ε = 3): noise_scale=f → flagged/runs; the largest f < 1
    flagged in >= 9/10 (None when none was)."""
    out: dict[str, dict] = {}
    for r in rows:
        if not (
            r["fault"].startswith("noise_scale=")
            and r["method"] == "fedavg"
            and r["partition"] == "iid"
            and r["eps"] == 3.0
            and r["level"] == "sample"
        ):
            continue
        f = float(r["fault"].split("=", 1)[1])
        d = out.setdefault(r["setting"], {}).setdefault(f"{f:g}", [0, 0])
        d[0] += r["flagged"]
        d[1] += 1
    res = {}
    for s, d in out.items():
        # a point counts with >= 10 seeds; with fewer, the largest f flagged in every seed
        # is reported apart (not a 9/10 measurement)
        ok = [float(f) for f, (k, n) in d.items() if n >= 10 and k >= TARGET_RATE * n]
        few = [float(f) for f, (k, n) in d.items() if 0 < n < 10 and k == n]
        best = max(ok) if ok else None
        res[s] = {
            "points": {
                f: {"flagged": k, "runs": n, "ci95": list(clopper_pearson(k, n))}
                for f, (k, n) in sorted(d.items(), key=lambda x: -float(x[0]))
            },
            "largest_f_flagged_9_of_10": best,
            # True: no larger f was tried, so the largest detectable f is at least this
            "at_top_of_grid": best is not None and best >= max(float(f) for f in d),
            "largest_f_flagged_every_seed_fewer_than_10": max(few) if few else None,
        }
    return res


def document(rows, meta, skipped, wall_s, settings) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(cell_key(r), []).append(r)
    return {
        "meta": {**meta, "wall_s": wall_s},
        "settings": {
            "per_setting": settings,
            "tiny": "fl.testing.TINY (tiny-bert, synthetic, max_length 24, lr 0.02, LoRA on "
            "every layer, random head) with the per-setting overrides",
            "minilm": "pipeline.job.PRESETS['default'].base with the per-setting overrides",
            "alpha": ALPHA,
            "conformance_alpha": _conformance_alpha(),
            "flagged": "mechanism_mismatch (a conformance test rejects, Holm at α) OR "
            "empirical_exceeds_claim (the one-run certified ε lower bound above the "
            "recomputed ε); both are recorded per run",
            "fault_seeds": "0..n-1 (data, model and canary draws); every run has a fresh "
            "secret noise key",
            "correct_run_seeds": "secrets.randbelow(2**31)",
        },
        "summary": {k: summarize(v) for k, v in groups.items()},
        "false_alarms": false_alarms(rows),
        "power_curve": power_curve(rows),
        "skipped": skipped,
        "runs": rows,
    }


def dumps(doc: dict) -> str:
    """results.json: the summaries indented, one line per run (the file stays small)."""
    import json

    head = {k: v for k, v in doc.items() if k != "runs"}
    text = json.dumps(head, indent=1, ensure_ascii=False)

    def rnd(v):  # 6 significant digits per run (the summaries keep full precision)
        if isinstance(v, float) and math.isfinite(v):
            return float(f"{v:.6g}")
        if isinstance(v, dict):
            return {k: rnd(x) for k, x in v.items()}
        if isinstance(v, list):
            return [rnd(x) for x in v]
        return v

    runs = ",\n".join("  " + json.dumps(rnd(r), ensure_ascii=False) for r in doc.get("runs", []))
    return text[:-2] + ',\n "runs": [\n' + runs + "\n ]\n}\n"


def _f(v, nd=2) -> str:
    if v is None:
        return "–"
    if v == math.inf:
        return "∞"
    return f"{v:.{nd}f}"


def _d(d, nd=2) -> str:
    if not d:
        return "–"
    if d["min"] == d["max"]:
        return _f(d["median"], nd)
    return f"{_f(d['median'], nd)} [{_f(d['min'], nd)}, {_f(d['max'], nd)}]"


def _ratio_cell(s: dict) -> str:
    parts = []
    for k, v in s["ratios"].items():
        g, t = k.split(":")
        if t == "scale" and v["ratio"]:
            parts.append(f"{g} {v['ratio']['median']:.2f}")
    return ", ".join(parts) or "–"


HEAD = (
    "| fault | q | ε | method/partition | flagged / runs | rate (95 % CP) | mismatch (noise / sampler) | ε_lb>claim "
    "| ε_lb (Steinke) | implied ε | observed/claimed noise (scale test, median) | σ | audit s |"
)


def _row(s: dict) -> str:
    imp = _d(s["implied_epsilon"])
    if s["conformance"] in ("pending", "not tested"):
        imp = s["conformance"]
    elif s["implied_epsilon_at_least"]:
        imp = "≥ " + imp
    eps = s["eps"] if isinstance(s["eps"], str) else f"{s['eps']:g}"
    return (
        f"| {s['fault']} | {s['q']:g} | {eps} | {s['method']}/{s['partition']} "
        f"| {s['flagged']} / {s['runs']} | {s['rate']:.2f} [{s['ci95'][0]:.2f}, "
        f"{s['ci95'][1]:.2f}] | {s['mechanism_mismatch']} ({s['mismatch_noise']} / "
        f"{s['mismatch_sampler']}) | {s['empirical_exceeds_claim']} "
        f"| {_d(s['epsilon_lb'])} | {imp} | "
        f"{_ratio_cell(s) if s['conformance'] == 'available' else s['conformance']} "
        f"| {s['sigma']:.3g} "
        f"| {_d(s['audit_s'], 1)} |"
    )


def _section(title: str, cells: list[dict], note: str = "") -> list[str]:
    if not cells:
        return []
    out = [f"## {title}", ""]
    if note:
        out += [note, ""]
    out += [HEAD, _sep()]
    out += [_row(s) for s in cells]
    return out + [""]


def _sep() -> str:
    return "|" + "---|" * (HEAD.count("|") - 1)


#: what the full grid's table says beside its numbers (why each blind spot is blind)
NOTES = [
    "## Reading the table",
    "",
    "- **The default preset's power curve** with 10 seeds per factor is a run of its own: "
    "`python -m benchmarks.auditing.faults --grid minilm-power --out "
    "benchmarks/results/faults/minilm-power` (`minilm-power/table.md`); the minilm cells "
    "here have 2 seeds (1 at q = 0.05).",
    "- **fixed_batches is invisible to the gradient canaries**: the auditor draws their "
    "coins itself from the key (Poisson), while under the fault the trainer places each "
    "canary in a slot of the shuffle. The canary's real contributions then fall at steps the "
    "auditor does not subtract, which only adds variation to the innovations (the scale "
    "and freshness tests reject too *little* variation) and pulls the clipping statistic "
    "down; the noise is as claimed and every contribution is at most C. Only the sampler "
    "canaries' permutation test can see it, and only when a local training holds more than "
    "one epoch of L = round(1/q) steps: at q = 0.05 (50 steps, L = 20) the cycled batches "
    "show in the phase statistic; at q = 1 the fixed batch is the whole client, exactly "
    "Poisson's (no fault); at q = 0.25 a local training is 4 steps, one epoch, nothing "
    "cycles; at q = 0.01 it is 50 steps, half an epoch of L = 100: each record appears at "
    "most once, which Poisson sampling also does with probability 0.91.",
    "- **Noise factors close to 1**: the scale test resolves about sqrt(2/N) in the "
    "variance per group (N = steps × canaries of the group): with 8 steps per client "
    "(q = 1, 0.25) f = 0.98 is at the edge; with 100 steps (q ≤ 0.05) f = 0.99 is flagged.",
    "- **no_clip's implied ε equals the claim**: the implied ε reads the noise only (the "
    "noise is as claimed); the clipping test flags the run.",
    "- **empirical_exceeds_claim** (the one-run bound) alone misses most faults at ε ≥ 3 "
    "and at q < 1 (counts per cell in the ε_lb>claim column): the conformance tests carry "
    "the detection.",
    "- **Client level**: FedPower's release is a noisy power iteration, not a Gaussian on "
    "the clipped sum; its conformance is 'not tested' and its canary clients give the "
    "one-run bound only. Noise reused *across clients* is not planted and cannot be seen "
    "(each canary lives in one client).",
]


def markdown(doc: dict) -> str:
    meta = doc["meta"]
    S = list(doc["summary"].values())
    order = {"q1": 0, "q025": 1, "q005": 2, "q001": 3}

    def pick(pred):
        return sorted(
            (s for s in S if pred(s)),
            key=lambda s: (order.get(s["setting"], 9), s["eps"], s["fault"]),
        )

    lines = [
        "# Planted faults: the run audit's power at q ∈ {1, 0.25, 0.05, 0.01}",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']}",
        f"- date: {meta['date']}; commit {meta['commit'][:12]}"
        + (" (with uncommitted changes by others in the checkout)" if meta.get("dirty") else ""),
        f"- source: {meta.get('source', 'git checkout')}",
        f"- wall time: {meta['wall_s'] / 60:.1f} min; runs: {len(doc['runs'])}",
        "- settings: tiny-bert/synthetic, 3 clients, LoRA rank 16 on every layer, 2 000 "
        "gradient canaries, δ = 1e-5; q = 1 and 0.25: 80 members per client, batches of 80 / "
        "20, 2 rounds × 4 steps; q = 0.05: 160 members, batches of 8, 2 × 50 steps; q = 0.01: "
        "300 members, batches of 3, 2 × 50 steps. 400 sampler canaries per client in the "
        "correct runs, `fixed_batches` and every minilm run; the noise faults' runs carry "
        "none (their power is the gradient canaries'). Client level: 3 clients of 20, 3 "
        "rounds, C = 0.5, rank 64, 4 000 canary clients. minilm: the default preset "
        "(`pipeline.job.PRESETS['default']`, 5 000 gradient canaries). Fault seeds 0..n−1, "
        "correct runs secret seeds, every run a fresh secret noise key.",
        "- flagged = `mechanism_mismatch` (conformance test rejected, Holm at α = "
        f"{doc['settings'].get('conformance_alpha', 0.05):g}) OR "
        "`empirical_exceeds_claim` (one-run certified ε_lb above the recomputed ε); both counted.",
        "- implied ε: the ledger's ε with σ times the worst group's upper confidence bound on "
        "the observed noise factor (conditional on Gaussian noise at that scale, not certified).",
        "",
    ]
    tiny_sample = lambda s: s["setting"] in order  # noqa: E731
    lines += _section(
        "Targets: each fault at each q, ε = 3 (FedAvg-LoRA, IID, tiny-bert/synthetic)",
        pick(lambda s: tiny_sample(s) and s["stage"] == "target"),
    )
    lines += _section(
        "Other ε (FedAvg-LoRA, IID, tiny-bert/synthetic)",
        pick(lambda s: tiny_sample(s) and s["stage"] == "other-eps"),
    )
    lines += _section(
        "minilm/tweets (the default preset, q = 0.32; and q = 0.05)",
        pick(lambda s: s["setting"].startswith("minilm")),
    )
    lines += _section(
        "FedPower (sample level)",
        pick(lambda s: s["method"] == "fedpower" and s["level"] == "sample"),
    )
    lines += _section(
        "FedASK (W-space slots, clip_space=w)",
        pick(lambda s: s["method"] == "fedask" and s["level"] == "sample"),
    )
    lines += _section("Client level (canary clients)", pick(lambda s: s["level"] == "client"))
    lines += _section(
        "Power curve runs (noise_scale = f, ε = 3)", pick(lambda s: s["stage"] == "power")
    )
    by_setting: dict[str, list] = {}
    for r in doc["runs"]:
        if r["fault"] == "none":
            by_setting.setdefault(r["setting"], []).append(r)
    pooled = []
    for st, rs in sorted(by_setting.items(), key=lambda x: order.get(x[0], 9)):
        s = summarize(rs)
        s.update(
            fault=f"none ({st})",
            method="+".join(sorted({r["method"] for r in rs})),
            partition="+".join(sorted({r["partition"] for r in rs})),
            eps=",".join(f"{e:g}" for e in sorted({r["eps"] for r in rs})),
        )
        pooled.append(s)
    lines += _section(
        "Correct runs, pooled per setting (every method, partition and ε)",
        pooled,
        "σ: the median over the pooled runs (it differs with ε).",
    )
    samp = [s for s in S if s["sampling_z"]["window"]]
    samp.sort(key=lambda s: (s["fault"] != "fixed_batches", order.get(s["setting"], 9), s["eps"]))
    if samp:
        lines += [
            "## The sampler canaries' permutation test (runs that carried them)",
            "",
            "| fault | q | ε | method/partition | sampler test rejected / runs | z window median "
            "[min, max] (negative: epochs) | z phase median [min, max] (positive: cycled) |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in samp:
            lines.append(
                f"| {s['fault']} | {s['q']:g} | {s['eps']:g} | {s['method']}/{s['partition']} "
                f"| {s['mismatch_sampler']} / {s['runs']} | {_d(s['sampling_z']['window'])} "
                f"| {_d(s['sampling_z']['phase'])} |"
            )
        lines.append("")
    fa = doc["false_alarms"]
    a = fa["all"]
    lines += [
        "## False alarms (correct runs)",
        "",
        f"**{a['flagged']} / {a['runs']}** correct runs flagged (95 % CP "
        f"[{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]); mechanism_mismatch "
        f"{a['mechanism_mismatch']} (noise tests {a['mismatch_noise']}, sampler test "
        f"{a['mismatch_sampler']}), empirical_exceeds_claim {a['empirical_exceeds_claim']}.",
        "",
        "| by | value | flagged / runs | 95 % CP |",
        "|---|---|---|---|",
    ]
    for field in ("method", "level", "partition", "model", "setting", "eps"):
        for v, p in fa[field].items():
            lines.append(
                f"| {field} | {v} | {p['flagged']} / {p['runs']} | "
                f"[{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}] |"
            )
    lines += [
        "",
        "## Power curve: largest noise factor f < 1 flagged in ≥ 9/10 seeds",
        "",
        "| q | setting | f → flagged/runs | largest f flagged ≥ 9/10 |",
        "|---|---|---|---|",
    ]
    for s, p in sorted(doc["power_curve"].items(), key=lambda x: order.get(x[0], 9)):
        pts = ", ".join(f"{f}: {v['flagged']}/{v['runs']}" for f, v in p["points"].items())
        best = p["largest_f_flagged_9_of_10"]
        if best is None:
            few = p.get("largest_f_flagged_every_seed_fewer_than_10")
            cell = "– (no f with 10 seeds)" + (
                f"; f = {few:g} flagged in every one of its < 10 seeds" if few else ""
            )
        else:
            cell = f"{best:g}" + (" (the largest f tried: ≥)" if p.get("at_top_of_grid") else "")
        lines.append(f"| {_q(S, s)} | {s} | {pts} | {cell} |")
    lines += [
        "",
        "## Wall time per setting (seconds per run)",
        "",
        "| setting | level | runs | train s median [min, max] | audit s median [min, max] |",
        "|---|---|---|---|---|",
    ]
    by: dict[str, list] = {}
    for r in doc["runs"]:
        by.setdefault(r["setting"], []).append(r)
    for s, rs in sorted(by.items(), key=lambda x: order.get(x[0], 9)):
        lines.append(
            f"| {s} | {rs[0]['level']} | {len(rs)} | "
            f"{_d(_dist(r['train_s'] for r in rs), 1)} | "
            f"{_d(_dist(r['audit_s'] for r in rs), 2)} |"
        )
    if meta.get("grid") == "full":
        lines += ["", *NOTES]
    if doc["skipped"]:
        lines += ["", f"Skipped (over the time budget): {len(doc['skipped'])} grid items:", ""]
        for it in doc["skipped"]:
            lines.append(f"- {it}")
    return "\n".join(lines) + "\n"


def _q(S, setting) -> str:
    for s in S:
        if s["setting"] == setting:
            return f"{s['q']:g}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.auditing.faults_table RESULTS.json``: recompute the summaries
    from the runs and write the table beside it (table.md)."""
    import json
    import sys
    from pathlib import Path

    path = Path((sys.argv[1:] if argv is None else argv)[0])
    old = json.loads(path.read_text())
    doc = document(
        old["runs"],
        old["meta"],
        old.get("skipped", []),
        old["meta"]["wall_s"],
        old["settings"]["per_setting"],
    )
    # the level the runs were audited at (recorded since 0.001; before that 0.05)
    doc["settings"]["conformance_alpha"] = old["settings"].get("conformance_alpha", 0.05)
    path.write_text(dumps(doc))
    (path.parent / "table.md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
