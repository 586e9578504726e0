"""The one-run audit per method and DP level (issue 35): what the canaries certify, and the
canary clients' estimate, at ε ∈ {1, 3, 8}, with the ledger's ε beside them.

``python -m benchmarks.auditing.audit_methods [--eps 1,3,8] [--methods all] [--levels sample,client]
[--seed 0] [--out DIR]``

One training run per (method, level, ε), tiny-bert on synthetic text (the settings of
:mod:`benchmarks.auditing.tightness`, dataset ``tiny``), a fresh secret key each, audited with
``audit.bundle.audit.audit_run(run, one_run=True)``:

- ``sample``: DP-SGD, q = 1, rank 16 on every layer, M = 4 000 white-box gradient canaries
  (FFA-LoRA and FedASK train B and the head only: 4 226 coordinates at rank 16; FedASK's
  canaries live in its W-space, docs/fedask.md); Steinke et al.'s and the f-DP bound, each
  certified at 95 % on its own.
- ``client``: server noise, every client every round, 8 000 canary clients, rank 64; the
  certified bounds (the larger statistic) and the all-iterates Gaussian-fit *estimate* (not
  a bound), in the space the method's clip acts in (docs/audit.md, "Canary clients").

A method that refuses a level (or the canaries) is listed with its one-line reason. δ =
1e-5, α = 0.05. ``results.json`` and ``table.md`` in ``--out`` (default
``benchmarks/results/audit_methods``), rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.auditing import tightness as T

#: per level: the tightness setting whose tiny-bert configuration is used, and overrides
LEVELS = {
    "sample": ("eps8", dict(canaries=4000)),
    "client": ("client3", {}),
}
#: heterogeneous-rank methods: two clients' ranks below the global rank (16 / 64)
HETERO = ("plora", "flora", "flexlora", "hetlora")


def _overrides(method: str, level: str) -> dict:
    over: dict = {"method": method}
    if method in HETERO:
        over["client_ranks"] = "8,16" if level == "sample" else "32,64"
    return over


def one(method: str, level: str, eps: float, seed: int, work: Path) -> dict:
    """One run and its audit: the row of the table (or the refusal)."""
    from fl.errors import UsageError

    setting, over = LEVELS[level]
    base = {"method": method, "level": level, "epsilon_target": eps, "seed": seed}
    try:
        row = T.one_run(
            "tiny", setting, seed, work, epsilon=eps, **over, **_overrides(method, level)
        )
    except UsageError as exc:
        return {**base, "refused": str(exc)}
    return {**base, **row}


def _f(v, p: int = 2) -> str:
    return "–" if not isinstance(v, int | float) else f"{v:.{p}f}"


def table(rows: list[dict]) -> str:
    out = [
        "One run per row, tiny-bert on synthetic text, a fresh secret key each; δ = 1e-5; "
        "certified bounds at 95 % each (Steinke et al.; f-DP, (ε, δ) family). Client level: "
        "the estimate is the all-iterates Gaussian fit, **not a bound**.",
        "",
        "| method | level | ledger ε | Steinke ε_lb | f-DP ε_lb | estimate (client) "
        "| findings | train s | audit s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            out.append(
                f"| {r['method']} | {r['level']} | (ε = {r['epsilon_target']:g}) | refused: "
                f"{r['refused'][:140]} | | | | | |"
            )
            continue
        if r["level"] == "sample":
            st, fd, est = r["epsilon_lb"], r["epsilon_lb_fdp"], None
        else:
            st, fd = r["certified_all_iterates"], r["certified_fdp_all_iterates"]
            est = r["estimate"]
        out.append(
            f"| {r['method']} | {r['level']} | {_f(r['epsilon_ledger'], 3)} | {_f(st)} | "
            f"{_f(fd)} | {_f(est)} | {', '.join(r.get('findings') or []) or 'none'} | "
            f"{_f(r['train_s'], 1)} | {_f(r.get('audit_s'), 1)} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from fl.methods import registry

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.auditing.audit_methods", description=__doc__
    )
    ap.add_argument("--eps", default="1,3,8", help="target ε values (default: %(default)s)")
    ap.add_argument("--methods", default="all", help="comma-separated, or all (default)")
    ap.add_argument("--levels", default="sample,client", help="default: %(default)s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/audit_methods")
    a = ap.parse_args(argv)
    methods = sorted(registry.names()) if a.methods == "all" else a.methods.split(",")
    methods = [m for m in methods if m != "probe"]  # the head alone: no LoRA coordinates
    eps = [float(x) for x in a.eps.split(",")]
    levels = a.levels.split(",")
    unknown = [m for m in methods if m not in registry.names()] + [
        lv for lv in levels if lv not in LEVELS
    ]
    if unknown or not all(0 < e < 100 for e in eps):
        sys.stderr.write(f"audit_methods: bad --methods/--levels/--eps: {unknown or eps}\n")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="audit-methods-") as tmp:
        for level in levels:
            for m in methods:
                for e in eps:
                    r = one(m, level, e, a.seed, Path(tmp))
                    rows.append(r)
                    print(json.dumps(r, default=str), flush=True)
                    doc = {
                        "git": T.git_state(),
                        "seconds": round(time.time() - t0, 1),
                        "rows": rows,
                    }
                    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
                    (out / "table.md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
