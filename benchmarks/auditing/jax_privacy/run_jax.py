"""jax_privacy 2.0's bounds on the seeded arrays; run ONCE, in a separate venv, output committed.

JAX is not a dependency of this project. To regenerate ``jax_privacy.json``::

    python3 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax-privacy==2.0.0
    /tmp/jaxenv/bin/python -m benchmarks.auditing.jax_privacy.run_jax   # from the repo root

Each cell gets CanaryScoreAuditor(in, out) and its three bounds with their defaults
(Bonferroni over the ROC hull, one-sided), plus Clopper-Pearson two-sided and with a 50/50
split (seed 0), so the toolkit is compared with jax_privacy's best setting.

The released 2.0.0 takes |mu| in ``epsilon_from_gdp``, which overstates epsilon (an unsound
"lower bound"); upstream fixed it after the release (commit aab3e1c, "Fix
CanaryScoreAuditor.epsilon_from_gdp() lower-bound estimation"). With ``--upstream PATH`` (a
later ``jax_privacy/auditing.py``, e.g. from commit 8967688) the same bounds are also computed
with that file, stored under ``upstream``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from importlib import metadata

from benchmarks.auditing.jax_privacy.arrays import ALPHA, DELTA, SEED, cells, fingerprint, scores
from benchmarks.paths import RESULTS

OUT = RESULTS / "jax_privacy" / "jax_privacy.json"


def _bounds(auditing, mu: float, n: int) -> dict:
    x_in, x_out = scores(mu, n)
    aud = auditing.CanaryScoreAuditor(x_in, x_out)
    t0 = time.perf_counter()
    row = {
        "mu": mu,
        "n": n,
        "n_hull": int(len(aud._fn_counts)),
        "fingerprint": fingerprint(x_in, x_out),
        "cp_bonferroni": float(aud.epsilon_clopper_pearson(ALPHA, DELTA)),
        "cp_bonferroni_two_sided": float(
            aud.epsilon_clopper_pearson(ALPHA, DELTA, one_sided=False)
        ),
        "cp_split": float(
            aud.epsilon_clopper_pearson(ALPHA, DELTA, threshold_strategy=auditing.Split(seed=0))
        ),
        "gdp": float(aud.epsilon_from_gdp(ALPHA, DELTA)),
        "one_run": float(aud.epsilon_one_run(ALPHA, DELTA)),
    }
    row["seconds"] = round(time.perf_counter() - t0, 3)
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", help="path of a later jax_privacy/auditing.py")
    ap.add_argument("--upstream-commit", default="", help="its commit, recorded in the output")
    args = ap.parse_args()
    from jax_privacy import auditing

    rows = [_bounds(auditing, mu, n) for mu, n in cells()]
    out: dict = {"rows": rows}
    if args.upstream:
        spec = importlib.util.spec_from_file_location("upstream_auditing", args.upstream)
        upstream = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = upstream  # its dataclasses look their module up
        spec.loader.exec_module(upstream)
        out["upstream"] = {
            "commit": args.upstream_commit,
            "rows": [_bounds(upstream, mu, n) for mu, n in cells()],
        }
    meta = {
        "jax_privacy": metadata.version("jax-privacy"),
        "numpy": metadata.version("numpy"),
        "scipy": metadata.version("scipy"),
        "python": platform.python_version(),
        "seed": SEED,
        "delta": DELTA,
        "alpha": ALPHA,
    }
    OUT.write_text(json.dumps({"meta": meta, **out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
