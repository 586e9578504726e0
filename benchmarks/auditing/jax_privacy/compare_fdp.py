"""The toolkit's f-DP one-run bound (``audit.bounds.fdp``) beside jax_privacy's, on the seeded arrays.

Each cell (mu, n) is audited as one run: 2n canaries, n of them included (members N(mu, 1),
non-members N(0, 1): exactly mu-GDP, so the true eps(delta) is known). Columns:

* ``fdp_gdp``: ``fdp_one_run_bound(..., family="gdp")`` with its default guess grid (top-k and
  bottom-k, k = round(f m / 2), f in {0.02, 0.05, 0.1, 0.2, 0.5, 1}, union bound alpha/6);
* ``fdp_gdp_one_sided``: the same on a one-sided grid (k+ = round(f m), k- = 0), the shape of
  guesses jax_privacy makes;
* ``fdp_dp``: the (eps, delta)-DP family (no Gaussian assumption), default grid;
* ``steinke``: ``audit.bounds.one_run.epsilon_one_run`` (from results.json), for scale;
* ``jax_fdp``: jax_privacy 2.0.0's ``epsilon_one_run_fdp`` (from ``jax_privacy_fdp.json``, made by
  ``run_jax_fdp.py`` in a separate venv): the same recursion and GDP family, one-sided, over the
  vertices of its ROC hull at alpha / (number of vertices), a data-chosen set, so (as for its
  Clopper-Pearson bound, see table.md) not a valid union bound.

Writes ``results_fdp.json`` and ``table_fdp.md``. Run from the repo root:
``python -m benchmarks.auditing.jax_privacy.compare_fdp``.
"""

from __future__ import annotations

import json

from audit.bounds.fdp import fdp_one_run_bound
from audit.bounds.hypothesis import gdp_epsilon
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
FRACS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def toolkit_fdp(mu: float, n: int) -> dict[str, float]:
    """The toolkit's f-DP one-run bounds (nats) on the cell (mu, n), with the chosen splits."""
    s, member = one_run_inputs(mu, n)
    m = s.size
    one_sided = [(int(round(f * m)), 0) for f in FRACS]
    g = fdp_one_run_bound(s, member, DELTA, ALPHA, family="gdp")
    g1 = fdp_one_run_bound(s, member, DELTA, ALPHA, family="gdp", k=one_sided)
    d = fdp_one_run_bound(s, member, DELTA, ALPHA, family="dp")
    return {
        "fdp_gdp": g["epsilon_lb"],
        "fdp_gdp_mu": g["mu_lb"],
        "fdp_gdp_split": [g["k_plus"], g["k_minus"], g["correct"]],
        "fdp_gdp_one_sided": g1["epsilon_lb"],
        "fdp_gdp_one_sided_split": [g1["k_plus"], g1["k_minus"], g1["correct"]],
        "fdp_dp": d["epsilon_lb"],
    }


def main() -> None:
    jax = json.loads((HERE / "jax_privacy_fdp.json").read_text())
    jrows = {(r["mu"], r["n"]): r for r in jax["rows"]}
    steinke = {
        (r["mu"], r["n"]): r["toolkit"]["one_run"]
        for r in json.loads((HERE / "results.json").read_text())["rows"]
    }
    rows = []
    for mu, n in cells():
        jr = jrows[(mu, n)]
        if jr["fingerprint"] != fingerprint(*scores(mu, n)):
            raise SystemExit(f"cell mu={mu} n={n}: these arrays differ from jax_privacy's")
        tk = toolkit_fdp(mu, n)
        row = {
            "mu": mu,
            "n": n,
            "truth": gdp_epsilon(mu, DELTA),
            "toolkit": tk,
            "steinke": steinke[(mu, n)],
            "jax_fdp": jr["one_run_fdp"],
            "jax_n_hull": jr["n_hull"],
        }
        print(row, flush=True)
        rows.append(row)
    out = {"delta": DELTA, "alpha": ALPHA, "jax_privacy_meta": jax["meta"], "rows": rows}
    (HERE / "results_fdp.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# f-DP one-run bound: toolkit (audit.bounds.fdp) vs jax_privacy vs truth",
        "",
        f"2n canaries (n members N(μ, 1), n non-members N(0, 1)), δ = {DELTA:g}, α = {ALPHA:g}; "
        "truth = ε(δ) of μ-GDP. See compare_fdp.py for the columns. jax = jax_privacy "
        f"{jax['meta']['jax_privacy']} `epsilon_one_run_fdp` (one-sided, Bonferroni over its "
        "data-chosen hull vertices).",
        "",
        "| μ | n | truth | f-DP GDP | μ_lb | f-DP GDP one-sided | f-DP (ε,δ) | Steinke | jax f-DP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["toolkit"]
        lines.append(
            f"| {r['mu']:g} | {r['n']} | {r['truth']:.3f} | {t['fdp_gdp']:.3f} | "
            f"{t['fdp_gdp_mu']:.3f} | {t['fdp_gdp_one_sided']:.3f} | {t['fdp_dp']:.3f} | "
            f"{r['steinke']:.3f} | {r['jax_fdp']:.3f} |"
        )
    (HERE / "table_fdp.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
