"""jax_privacy's f-DP one-run bound (``CanaryScoreAuditor.epsilon_one_run_fdp``) on the arrays.

Run in a separate venv that has jax_privacy (never the project's)::

    python3 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax-privacy==2.0.0
    /tmp/jaxenv/bin/python -m benchmarks.auditing.jax_privacy.run_jax_fdp   # from the repo root

Writes ``jax_privacy_fdp.json``; ``compare_fdp.py`` puts it beside ``audit.bounds.fdp``. jax_privacy 2.0.0
tests mu-GDP (mu = 1 / sigma of the Gaussian mechanism that is (eps, delta)-DP) with the same
recursion, one-sided ("in" guesses only, k- = 0), over every vertex of its ROC hull at
alpha / (number of vertices).
"""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata

from benchmarks.auditing.jax_privacy.arrays import ALPHA, DELTA, SEED, cells, fingerprint, scores
from benchmarks.paths import RESULTS

OUT = RESULTS / "jax_privacy" / "jax_privacy_fdp.json"


def main() -> None:
    from jax_privacy import auditing

    rows = []
    for mu, n in cells():
        x_in, x_out = scores(mu, n)
        aud = auditing.CanaryScoreAuditor(x_in, x_out)
        t0 = time.perf_counter()
        eps = float(aud.epsilon_one_run_fdp(ALPHA, DELTA))
        row = {
            "mu": mu,
            "n": n,
            "n_hull": int(len(aud._fn_counts)),
            "fingerprint": fingerprint(x_in, x_out),
            "one_run_fdp": eps,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        print(row, flush=True)
        rows.append(row)
    meta = {
        "jax_privacy": metadata.version("jax-privacy"),
        "numpy": metadata.version("numpy"),
        "scipy": metadata.version("scipy"),
        "dp_accounting": metadata.version("dp-accounting"),
        "python": platform.python_version(),
        "seed": SEED,
        "delta": DELTA,
        "alpha": ALPHA,
    }
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
