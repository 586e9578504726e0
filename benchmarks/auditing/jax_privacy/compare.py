"""The toolkit's bounds on the seeded arrays beside jax_privacy's stored ones and the truth.

Writes ``results.json`` (every figure, and the toolkit's values the regression test in
tests/audit/test_empirical.py holds the toolkit to) and ``table.md``. jax_privacy's figures come
from ``jax_privacy.json`` (made once by ``run_jax.py`` in a separate venv); nothing here imports
JAX. Run from the repo root: ``python -m benchmarks.auditing.jax_privacy.compare``.
"""

from __future__ import annotations

import json

from audit.bounds.hypothesis import epsilon_lower_bound, gdp_epsilon
from audit.bounds.one_run import epsilon_one_run
from benchmarks.auditing.jax_privacy.arrays import (
    ALPHA,
    DELTA,
    cells,
    fingerprint,
    one_run_inputs,
    scores,
)
from benchmarks.paths import RESULTS

HERE = RESULTS / "jax_privacy"  # the committed arrays and tables (data only)

# toolkit bound -> the call that makes it, on a cell's arrays
BOUNDS = ("cp_bonferroni", "gdp", "one_run", "cp_split")


def toolkit_bounds(mu: float, n: int) -> dict[str, float]:
    """The toolkit's epsilon lower bounds (nats) on the cell (mu, n)."""
    x_in, x_out = scores(mu, n)
    s, member = one_run_inputs(mu, n)
    return {
        "cp_bonferroni": epsilon_lower_bound(
            x_in, x_out, DELTA, ALPHA, threshold_selection="bonferroni"
        )["epsilon_lb"],
        "gdp": epsilon_lower_bound(
            x_in, x_out, DELTA, ALPHA, method="gdp", threshold_selection="bonferroni"
        )["epsilon_lb"],
        "one_run": epsilon_one_run(s, member, DELTA, ALPHA)["epsilon_lb"],
        "cp_split": epsilon_lower_bound(x_in, x_out, DELTA, ALPHA, threshold_selection="split")[
            "epsilon_lb"
        ],
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def main() -> None:
    jax = json.loads((HERE / "jax_privacy.json").read_text())
    released = {(r["mu"], r["n"]): r for r in jax["rows"]}
    upstream = {(r["mu"], r["n"]): r for r in jax.get("upstream", {}).get("rows", [])}
    rows = []
    for mu, n in cells():
        jr, ju = released[(mu, n)], upstream.get((mu, n), {})
        if jr["fingerprint"] != fingerprint(*scores(mu, n)):
            raise SystemExit(f"cell mu={mu} n={n}: these arrays differ from jax_privacy's")
        tk = toolkit_bounds(mu, n)
        # jax_privacy's best Clopper-Pearson setting is two-sided (it is never below one-sided).
        jax_best = {
            "cp_bonferroni": jr["cp_bonferroni_two_sided"],
            "gdp": jr["gdp"],
            "one_run": jr["one_run"],
            "cp_split": jr["cp_split"],
        }
        rows.append(
            {
                "mu": mu,
                "n": n,
                "truth": gdp_epsilon(mu, DELTA),
                "fingerprint": jr["fingerprint"],
                "toolkit": tk,
                "jax_privacy": jax_best,
                "jax_privacy_upstream_gdp": ju.get("gdp"),
                # GDP is compared with the upstream fix: 2.0.0's larger figures are not bounds.
                "ratio": {
                    k: _ratio(tk[k], ju.get("gdp", jax_best[k]) if k == "gdp" else jax_best[k])
                    for k in BOUNDS
                },
            }
        )
    out = {
        "recipe": "benchmarks/auditing/jax_privacy/arrays.py: numpy.random.default_rng("
        "[21, round(10*mu), n]); n member scores N(mu, 1), then n non-member scores N(0, 1)",
        "delta": DELTA,
        "alpha": ALPHA,
        "jax_privacy_meta": jax["meta"],
        "jax_privacy_upstream_commit": jax.get("upstream", {}).get("commit"),
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    (HERE / "table.md").write_text(_table(out))


def _table(out: dict) -> str:
    lines = [
        "# Empirical ε lower bounds: toolkit vs jax_privacy vs truth",
        "",
        f"Members N(μ, 1), non-members N(0, 1), n per side, δ = {out['delta']:g}, "
        f"α = {out['alpha']:g}; truth = ε(δ) of μ-GDP (closed form). Arrays: "
        f"{out['recipe']}. jax_privacy {out['jax_privacy_meta']['jax_privacy']} "
        "(`CanaryScoreAuditor`, Bonferroni over its ROC hull); "
        "its Clopper–Pearson column is its two-sided setting (≥ its one-sided default). "
        "GDP: jax_privacy 2.0.0 takes |μ| of a negative estimate, so its figure can exceed "
        "the truth (marked !); the upstream fix (commit "
        f"{(out['jax_privacy_upstream_commit'] or '')[:7]}) is in the column 'jax upstream'. "
        "Ratio = toolkit / jax_privacy (for GDP: / jax upstream). The toolkit's Bonferroni "
        "rate bounds hold for every threshold at once (α/(2(n+1)) per rate bound: a union "
        "over the possible counts), jax_privacy's only over its data-chosen hull vertices "
        "(α/(2K)), which is not a valid union; hence ratios below 1 in those columns. CP-split is one random "
        "halving, the same partition as jax_privacy's `Split(seed=0)`; the two pick thresholds "
        "by different rules (the toolkit by both inequalities, jax_privacy by one), so its "
        "per-cell ratio is the luck of that pick, not a tightness figure. Regenerate: "
        "`run_jax.py` (separate venv), then `python -m benchmarks.auditing.jax_privacy.compare`.",
        "",
        "| μ | n | truth | CP-Bonf. toolkit | jax | ratio | GDP toolkit | jax 2.0.0 | "
        "jax upstream | ratio | one-run toolkit | jax | ratio | CP-split toolkit | jax | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        tk, jx, ra = r["toolkit"], r["jax_privacy"], r["ratio"]

        def f(x: float | None, bad: bool = False) -> str:
            return "—" if x is None else f"{x:.3f}" + (" !" if bad else "")

        lines.append(
            f"| {r['mu']:g} | {r['n']} | {r['truth']:.3f} "
            f"| {f(tk['cp_bonferroni'])} | {f(jx['cp_bonferroni'])} | {f(ra['cp_bonferroni'])} "
            f"| {f(tk['gdp'])} | {f(jx['gdp'], jx['gdp'] > r['truth'])} "
            f"| {f(r['jax_privacy_upstream_gdp'])} | {f(ra['gdp'])} "
            f"| {f(tk['one_run'])} | {f(jx['one_run'])} | {f(ra['one_run'])} "
            f"| {f(tk['cp_split'])} | {f(jx['cp_split'])} | {f(ra['cp_split'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
