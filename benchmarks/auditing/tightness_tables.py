"""The tables of :mod:`benchmarks.auditing.tightness`: ``table.md`` from the runs' summary,
the utility cost of the canaries (:func:`utility_summary`), and the ideal-mechanism
simulation (:func:`ideal`, :func:`ideal_table`), with the settings they state (δ, α, the
utility setting) and the helpers the runs' summary shares (:func:`dist`, :func:`gdp_mu`).
"""

from __future__ import annotations

import math
import statistics

DELTA = 1e-5
ALPHA = 0.05
UTILITY_SETTING = "eps8_util"

__all__ = [
    "ALPHA",
    "DELTA",
    "IDEAL_CASES",
    "UTILITY_SETTING",
    "dist",
    "gdp_mu",
    "ideal",
    "ideal_table",
    "table",
    "utility_summary",
]


def gdp_mu(eps: float) -> float | None:
    """The μ whose μ-GDP curve gives ``eps`` at δ (the ledger's ε read as a Gaussian)."""
    from scipy.optimize import brentq

    from audit.bounds.hypothesis import gdp_epsilon

    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps > 0):
        return None
    return float(brentq(lambda m: gdp_epsilon(m, DELTA) - eps, 1e-6, 100.0))


def dist(vals: list) -> dict | None:
    """Median, min, max and count of the finite numbers in ``vals`` (None if there are none)."""
    vals = [v for v in vals if isinstance(v, int | float) and math.isfinite(v)]
    if not vals:
        return None
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def _fmt(d: dict | None, p: int = 2) -> str:
    if not d:
        return "–"
    return f"{d['median']:.{p}f} [{d['min']:.{p}f}, {d['max']:.{p}f}]"


def _met(s: dict) -> str:
    return {True: "yes", False: "**no**", None: "–"}[s.get("met")]


def table(summary: dict, rows: list[dict], utility: dict) -> str:
    out = [
        "Sample level (white-box gradient canaries, q = 1). Medians [min, max] over seeds; "
        "ε_lb certified at α = 0.05; μ̂: standardized separation of in/out scores "
        "(ideal: the ledger's μ).",
        "",
        "| dataset | setting | M | ledger ε (μ) | Steinke ε_lb | f-DP ε_lb | f-DP ε_lb (GDP family) "
        "| μ̂ | target | met | train s | audit s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        if "estimate" in s:
            continue
        ds, st = key.split(" @ ")
        M = next(r["canaries"] for r in rows if r["dataset"] == ds and r["setting"] == st)
        out.append(
            f"| {ds} | {st} | {M} | {s['epsilon_ledger']:.3f} ({s['mu_ledger']:.3f}) "
            f"| {_fmt(s['epsilon_lb'])} | {_fmt(s['epsilon_lb_fdp'])} "
            f"| {_fmt(s['epsilon_lb_gdp'])} | {_fmt(s['mu_hat'], 3)} | {s['target'] or '–'} "
            f"| {_met(s)} | {_fmt(s['train_s'], 1)} | {_fmt(s['audit_s'], 1)} |"
        )
    out += [
        "",
        "Client level (M canary clients, every client every round). Estimate: Gaussian fit of "
        "the all-iterates statistic (NOT a bound); certified: the one-run bounds from the same "
        "scores at α/2.",
        "",
        "| dataset | setting | M | ledger ε | estimate | estimate / ledger | within ±10 % "
        "| 95 % interval ∋ ledger | certified Steinke | certified f-DP | met | train s | audit s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        if "estimate" not in s:
            continue
        ds, st = key.split(" @ ")
        M = next(r["canary_clients"] for r in rows if r["dataset"] == ds and r["setting"] == st)
        out.append(
            f"| {ds} | {st} | {M} | {s['epsilon_ledger']:.3f} | {_fmt(s['estimate'])} "
            f"| {_fmt(s['estimate_over_ledger'], 3)} | {s['within_10pct']} / {s['runs']} "
            f"| {s['interval_contains_ledger']} / {s['runs']} "
            f"| {_fmt(s['certified_all_iterates'])} | {_fmt(s['certified_fdp_all_iterates'])} "
            f"| {_met(s)} | {_fmt(s['train_s'], 1)} | {_fmt(s['audit_s'], 1)} |"
        )
    out += ["", "Per seed:", ""]
    out.append(
        "| dataset | setting | seed | ledger ε | Steinke / estimate | f-DP / interval "
        "| acc | train s | audit s |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("audit_s") is None:
            continue
        if "estimate" in r:
            a = f"est {r['estimate']:.3f} ({r['estimate_over_ledger']:.3f}×)"
            lo, hi = r["estimate_interval"]
            b = f"[{lo:.3f}, {hi:.3f}]"
        else:
            a, b = f"{r['epsilon_lb']:.3f}", f"{r['epsilon_lb_fdp']:.3f}"
        out.append(
            f"| {r['dataset']} | {r['setting']} | {r['seed']} | {r['epsilon_ledger']:.3f} | {a} "
            f"| {b} | {r['accuracy']:.3f} | {r['train_s']:.1f} | {r['audit_s']:.1f} |"
        )
    if utility:
        out += [
            "",
            f"Utility cost of the gradient canaries ({UTILITY_SETTING}, same public seed, "
            "fresh noise keys): final test accuracy.",
            "",
            "| dataset | seeds | with canaries | without | mean difference (with − without) |",
            "|---|---|---|---|---|",
        ]
        for ds, u in utility.items():
            out.append(
                f"| {ds} | {u['seeds']} | {_fmt(u['with'], 3)} | {_fmt(u['without'], 3)} "
                f"| {u['mean_diff']:+.3f} |"
            )
    return "\n".join(out) + "\n"


def utility_summary(rows: list[dict]) -> dict:
    out = {}
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        base = {
            r["seed"]: r["accuracy"]
            for r in rows
            if r["dataset"] == ds and r["setting"] == UTILITY_SETTING and not r["canaries"]
        }
        with_ = {
            r["seed"]: r["accuracy"]
            for r in rows
            if r["dataset"] == ds and r["setting"] == UTILITY_SETTING and r["canaries"]
        }
        seeds = sorted(set(base) & set(with_))
        if not seeds:
            continue
        out[ds] = {
            "seeds": seeds,
            "with": dist([with_[s] for s in seeds]),
            "without": dist([base[s] for s in seeds]),
            "mean_diff": statistics.fmean(with_[s] - base[s] for s in seeds),
        }
    return out


#: (ε, M) pairs whose ideal ceiling ``--ideal`` simulates
IDEAL_CASES = ((4.0, 5000), (8.0, 5000), (8.0, 10000), (8.0, 20000))


def ideal(n: int, cases=IDEAL_CASES, seed: int = 0) -> dict:
    """The bounds of the ideal mechanism: at q = 1 with no data gradient at the canaries'
    coordinates an included canary's standardized score is N(μ, 1) and an excluded one's
    N(0, 1), μ the ledger's GDP μ at ε. ``n`` simulated audits per (ε, M) (public seeds):
    the distribution of Steinke et al.'s and the f-DP bound, and the probability that the
    median of 5 audits reaches the issue's target (resampled from the ``n``)."""
    import numpy as np

    from audit.bounds.fdp import fdp_one_run_bound
    from audit.bounds.one_run import epsilon_one_run

    out = {}
    for eps, m in cases:
        mu = gdp_mu(eps)
        st, fd = [], []
        for i in range(n):
            rng = np.random.default_rng([seed, int(eps * 1000), m, i])
            y = rng.random(m) < 0.5
            x = rng.normal(size=m) + mu * y
            st.append(float(epsilon_one_run(x, y, DELTA, alpha=ALPHA)["epsilon_lb"]))
            fd.append(float(fdp_one_run_bound(x, y, DELTA, alpha=ALPHA, family="dp")["epsilon_lb"]))
        rng = np.random.default_rng([seed, 1])
        pick = rng.integers(0, n, (20000, 5))
        med5 = {
            "steinke": np.median(np.asarray(st)[pick], axis=1),
            "fdp": np.median(np.asarray(fd)[pick], axis=1),
        }
        out[f"eps{eps:g}_m{m}"] = {
            "epsilon": eps,
            "m": m,
            "mu": mu,
            "n": n,
            "steinke": dist(st),
            "fdp": dist(fd),
            "p_median5_steinke_ge_1.6": float(np.mean(med5["steinke"] >= 1.6)),
            "p_median5_fdp_ge_3.5": float(np.mean(med5["fdp"] >= 3.5)),
        }
    return out


def ideal_table(res: dict) -> str:
    lines = [
        "Ideal mechanism (scores N(μ, 1) in / N(0, 1) out, μ the ledger's GDP μ; no data "
        "gradient): simulated one-run bounds at α = 0.05, δ = 1e-5, median [min, max] over n "
        "audits, and P(median of 5 audits ≥ target).",
        "",
        "| ε | M | μ | n | Steinke ε_lb | f-DP ε_lb | P(med5 Steinke ≥ 1.6) | P(med5 f-DP ≥ 3.5) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res.values():
        lines.append(
            f"| {r['epsilon']:g} | {r['m']} | {r['mu']:.3f} | {r['n']} | {_fmt(r['steinke'])} "
            f"| {_fmt(r['fdp'])} | {r['p_median5_steinke_ge_1.6']:.2f} "
            f"| {r['p_median5_fdp_ge_3.5']:.2f} |"
        )
    return "\n".join(lines) + "\n"
