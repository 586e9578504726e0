"""The DP libraries' own accountants checked against dp-accounting's PLD (issue 43, item 3).

``python -m benchmarks.auditing.accountants [--quick] [--out benchmarks/results/accountants]``

For every cell of a grid (σ, q, steps, δ) — the Poisson-subsampled Gaussian mechanism (the plain
Gaussian at q = 1) composed ``steps`` times, add/remove-one neighbours — each library accountant
is asked for its ε through the library's public API, exactly as a user would get it:

- Opacus 1.6 (``opacus.accountants``): ``RDPAccountant``, ``PRVAccountant`` and
  ``GaussianAccountant`` ("gdp", Poisson), each fed ``steps`` calls of ``step()``;
- Flower 1.42: ``flwr.serverapp.RdpAccountant`` (a ``PrivacyConfig`` over a population of
  10 000, ``POISSON`` sampling at q < 1, ``NO_AMPLIFICATION`` at q = 1 — the only sampling its
  accounted DP strategies accept), and the ε that ``LocalDpMod`` takes for its noise
  (σ = Δ·√(2 ln(1.25/δ))/ε, one release: the cells q = 1, steps = 1 only);
- pfl 0.6 (``pfl.privacy``, the optional ``pfl`` extra): ``PLDPrivacyAccountant``,
  ``PRVPrivacyAccountant``, ``RDPPrivacyAccountant`` with ``noise_parameter=σ, delta=δ``;
- the toolkit itself (``fl.privacy.accounting.epsilon``: the PLD headline and RDP).

The reference is dp-accounting's privacy loss distribution of the same mechanism, built twice:
pessimistic (connect-the-dots; an upper bound on the true ε) and optimistic (privacy buckets,
``pessimistic_estimate=False``; a lower bound), at a value discretisation of 1e-4 or finer (the
optimistic one drifts down by about steps·h/2, so it is built at h = min(1e-4, 0.05/steps) where
memory allows), coarser only where the composed PLD would exceed 4 million points (recorded per
cell). At q = 1 the composition is exactly one Gaussian of multiplier σ/√steps and the
reference is its exact ε(δ) (Balle & Wang's analytic Gaussian, ``dp_accounting.get_epsilon_gaussian``).

Criterion (:func:`verdict`): a library ε is an **understatement** (a finding) when it lies below
the optimistic PLD ε — a lower bound on the true ε — by more than ``REL_TOL`` · max(1, ε_opt)
(the tolerance covers the 1e-15 tail mass the PLD composition adds and float error). A library ε
below the pessimistic PLD ε by more than that tolerance but not below the lower bound is
"unresolved" (the bracket is too wide to tell). The ratio is ε_lib / ε_PLD-pessimistic: above 1
the library is loose but safe (an overstatement, by that ratio).

A cell a library will not compute (it raises or returns NaN) is recorded as ``refused`` with its
reason; a cell whose PRV domain or PLD would exceed this benchmark's memory cap is ``skipped``
(the library would try to allocate it); a cell an accountant does not model is ``n/a``.

Writes ``results.json`` (every cell) and ``table.md`` (per accountant: cells compared, refused,
skipped, the largest ratio each way, findings and a minimal reproduction of the worst one) in
``--out``. One process; set ``OMP_NUM_THREADS=1`` for the timings to mean one thread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks.auditing.accountants_core import (
    GRIDS,
    H_REF,
    OPT_DRIFT,
    PLD_MAX_POINTS,
    PRV_MAX_POINTS,
    REL_TOL,
    MissingExtra,
    Reference,
    reference,
    require_extra,
    short_text,
    skipped,
    verdict,
)
from benchmarks.auditing.accountants_libraries import ACCOUNTANTS, Accountant, dist_version
from benchmarks.auditing.accountants_table import summarize, table


def cells(grid: dict) -> list[tuple[float, float, int]]:
    return [(s, q, t) for s in grid["sigmas"] for q in grid["qs"] for t in grid["steps"]]


def compare(
    sigma: float,
    q: float,
    steps: int,
    deltas: tuple[float, ...],
    accountants: Iterable[Accountant] = ACCOUNTANTS,
    ref: Reference | None = None,
) -> list[dict]:
    """Every accountant's outcome on (σ, q, steps) at each δ, with the reference and verdict."""
    ref = ref or reference(sigma, q, steps, deltas)
    rows = []
    for acc in accountants:
        t0 = time.perf_counter()
        try:
            outcomes = acc.run(sigma, q, steps, deltas, ref)
        except MissingExtra as exc:
            outcomes = [skipped(str(exc)) for _ in deltas]
        except Exception as exc:  # noqa: BLE001 - building the accountant failed
            why = short_text(f"{type(exc).__name__}: {exc}")
            outcomes = [{"status": "refused", "reason": why} for _ in deltas]
        seconds = time.perf_counter() - t0
        for d, out in zip(deltas, outcomes, strict=True):
            row = {
                "library": acc.library,
                "accountant": acc.name,
                "sigma": sigma,
                "q": q,
                "steps": steps,
                "delta": d,
                **out,
                "reference": ref.method,
                "pld_pessimistic": ref.pessimistic[d],
                "pld_optimistic": ref.optimistic[d],
                "h_pessimistic": ref.h_pessimistic,
                "h_optimistic": ref.h_optimistic,
            }
            if out["status"] == "ok":
                row.update(verdict(out["epsilon"], ref.pessimistic[d], ref.optimistic[d]))
            row.setdefault("seconds", round(seconds / len(deltas), 4))
            rows.append(row)
    return rows


# ---------------------------------------------------------------- summary and table


def _meta(argv: list[str], grid: dict, accountants: Iterable[Accountant]) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout
        except Exception:  # noqa: BLE001 - not a checkout
            return ""

    return {
        "command": " ".join(["OMP_NUM_THREADS=1 python -m benchmarks.auditing.accountants", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "HEAD").strip() or "?",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(one process, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"Python {platform.python_version()}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "versions": {
            n: dist_version(n)
            for n in ("dp-accounting", "opacus", "flwr", "pfl", "prv-accountant", "numpy", "scipy")
        },
        "accountant_versions": {a.key: a.version() for a in accountants},
        "grid": grid,
        "cells_per_accountant": len(cells(grid)) * len(grid["deltas"]),
        "criterion": {
            "finding": "library ε < PLD optimistic ε − REL_TOL·max(1, PLD optimistic ε)",
            "rel_tol": REL_TOL,
            "ratio": "library ε / PLD pessimistic ε",
            "h_reference": H_REF,
            "opt_drift": OPT_DRIFT,
            "pld_max_points": PLD_MAX_POINTS,
            "prv_max_points": PRV_MAX_POINTS,
        },
    }


def _write(out: Path, meta: dict, rows: list[dict]) -> None:
    summary = summarize(rows)
    head = json.dumps({**meta, "summary": summary}, indent=1, allow_nan=True)
    # one line per cell: a readable diff when a rerun changes some
    cells_text = ",\n".join("  " + json.dumps(r, allow_nan=True) for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(f'{head[:-2]},\n "cells": [\n{cells_text}\n ]\n}}\n')
    (out / "table.md").write_text(table(meta, summary))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.auditing.accountants", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="a 12-cell grid (seconds)")
    ap.add_argument("--out", default="benchmarks/results/accountants")
    ap.add_argument(
        "--only", default="", help="comma-separated library/accountant keys (default: all)"
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite table.md (and the summary) from --out's results.json; compute nothing",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        doc = json.loads((out / "results.json").read_text())
        rows = doc.pop("cells")
        doc.pop("summary", None)
        _write(out, doc, rows)
        return 0
    logging.getLogger("absl").setLevel(logging.ERROR)
    grid = GRIDS["quick" if args.quick else "full"]
    wanted = {k for k in args.only.split(",") if k}
    accountants = [a for a in ACCOUNTANTS if not wanted or a.key in wanted]
    for a in accountants:
        if a.extra:
            try:
                require_extra(a.extra)
            except MissingExtra as exc:
                print(exc, file=sys.stderr)
    meta = _meta(argv, grid, accountants)
    deltas = tuple(grid["deltas"])
    rows: list[dict] = []
    t0 = time.perf_counter()
    todo = cells(grid)
    for i, (s, q, t) in enumerate(todo, 1):
        ref = reference(s, q, t, deltas)
        got = compare(s, q, t, deltas, accountants, ref)
        rows += got
        slow = sorted(
            {(r["library"] + "/" + r["accountant"], r.get("seconds", 0)) for r in got},
            key=lambda x: -x[1],
        )[:2]
        print(
            f"[{i}/{len(todo)}] σ={s:g} q={q:g} steps={t}: reference {ref.seconds:.1f} s "
            f"(h {ref.h_pessimistic}, {ref.h_optimistic}); slowest "
            + ", ".join(f"{k} {v:.1f} s" for k, v in slow)
            + f"; total {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if i % 25 == 0 or i == len(todo):
            meta["wall_s"] = time.perf_counter() - t0
            _write(out, meta, rows)
    meta["wall_s"] = time.perf_counter() - t0
    _write(out, meta, rows)
    findings = sum(bool(r.get("finding")) for r in rows)
    print(f"{len(rows)} rows, {findings} findings; {out}/results.json, {out}/table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
