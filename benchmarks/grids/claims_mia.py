"""Membership inference on the claims grids' private runs (issue 18, item 5).

``python -m benchmarks.grids.claims_mia GRID_DIR [--only eps8] [--attacks loss] [--shadows 0]``

For every finished run of ``GRID_DIR/results.jsonl`` whose group contains one of the
``--only`` texts (default ``eps8``), attack the released adapter (its members against its
non-members, :func:`attacks.run.run_attacks`) and append one row per run to
``GRID_DIR/mia.jsonl``: ``grid`` (the run's grid), ``group``, ``seed``, ``key`` and
``attacks`` (AUC, TPR at the FPR targets and their bootstrap intervals), the layout that
:func:`analysis.utility_claims.mia_claims` reads. A resumed call skips runs already
there with every result the chosen attack families give; a run whose row lacks one (a
family that gained a result) is attacked again, from its cached signals, and its row
replaced. Without shadows only the loss family applies (``loss``, ``loss_class``);
``--shadows N`` adds the shadow-model attacks (each shadow is a training run of the
target's configuration).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fl.errors import UsageError
from fl.io import atomic_write_text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.grids.claims_mia", description=__doc__)
    ap.add_argument("grid_dir")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT")
    ap.add_argument("--attacks", default="loss", help="comma-separated attack names")
    ap.add_argument("--shadows", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    only = args.only or ["eps8"]
    root = Path(args.grid_dir)
    res = root / "results.jsonl"
    if not res.is_file():
        ap.error(f"{root}: no results.jsonl")
    rows = [json.loads(x) for x in res.read_text().splitlines() if x.strip()]
    out = root / "mia.jsonl"
    old = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []
    from attacks.config import parse_attacks
    from attacks.registry import select
    from attacks.run import run_attacks

    try:
        attacks = parse_attacks(args.attacks)
    except UsageError as exc:
        ap.error(str(exc))
    # a run is done when its row has every result these families give (a family that
    # gained a result, e.g. loss → loss_class, re-scores the run from its cached signals)
    want = {a.name for a in select(attacks)}
    done = {m["key"] for m in old if want <= set(m.get("attacks") or {})}
    todo = [
        r
        for r in rows
        if "error" not in r
        and "skipped" not in r
        and any(o in r.get("group", "") for o in only)
        and r.get("key") not in done
    ]
    print(f"claims_mia: {len(todo)} runs to attack ({', '.join(attacks)})", flush=True)
    for i, r in enumerate(todo):
        run_dir = root / "runs" / r["run"]
        t0 = time.perf_counter()
        doc = run_attacks(
            run_dir,
            attacks=attacks,
            shadows=args.shadows,
            out=run_dir / "attacks",
            device=args.device,
            progress=False,
        )
        row = {
            "grid": r["grid"],
            "group": r["group"],
            "seed": r.get("seed"),
            "key": r["key"],
            "run": r["run"],
            "seconds": time.perf_counter() - t0,
            "attacks": {
                k: {m: v.get(m) for m in ("auc", "tpr_at_fpr", "ci")}
                for k, v in doc["attacks"].items()
                if isinstance(v, dict)
            },
        }
        if any(m["key"] == row["key"] for m in old):  # replace the older row, in place
            old = [row if m["key"] == row["key"] else m for m in old]
            atomic_write_text(out, "".join(json.dumps(m) + "\n" for m in old))
        else:
            old.append(row)
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        aucs = {k: v.get("auc") for k, v in row["attacks"].items()}
        print(f"[{i + 1}/{len(todo)}] {r['group']} seed {r.get('seed')}: {aucs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
