"""The papers' privacy–utility claims decided from measurement grids (issue 18, item 5).

Input: the ``results.jsonl`` files of ``python -m benchmarks.grids.runner`` runs (one row per
training run: ``grid``, ``group`` = ``method/condition``, ``seed``, ``accuracy``,
``balanced_accuracy``, ``attacks``...). Rows with an ``error`` or ``skipped`` field are
ignored; a job run twice (same ``key``) counts once (the last row).

Statistics (:mod:`analysis.stats`). A *cell* is one (grid, group); its seeds give mean,
sample std and a 95 % Student-t interval of the mean. A claim "A beats B" is decided on the **paired**
differences A − B over the seeds both ran (the same seed means the same member split,
partition and initialization, so pairing removes that variance), with a 95 % t interval
(at least 3 pairs are required, else the verdict is *inconclusive*):

* **holds** — the interval lies above 0 (A is better);
* **does not hold** — the interval lies below ``MARGIN`` (0.01): A is worse, or better by
  less than one point of balanced accuracy, which no one would call an improvement;
* **inconclusive** — otherwise (the seeds cannot tell).

"holds" is tested first: an interval inside (0, MARGIN) holds — a real gain, however
small (its size is in the claim's ``measured``).

The primary metric is balanced accuracy: tweets is 70 % positive, so plain accuracy
rewards predicting the majority class. Plain accuracy is given beside it.

The figure and the Markdown table of a decision are in :mod:`analysis.utility_figures`.

Membership inference "near chance" (private runs only): an attack's AUC interval
(bootstrap, from the attack itself) lies below ``0.5 + MIA_MARGIN`` on every attacked
run, with at least 3 distinct seeds attacked: holds; its lower end above that on any run:
does not hold; otherwise inconclusive.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from analysis.stats import (
    MARGIN,
    mean_ci,
    paired,
    verdict_better,
    verdict_reaches,
    verdict_word,
)
from fl.errors import UsageError

MIA_MARGIN = 0.05
METRIC = "balanced_accuracy"

FEDASK = "FedASK (arXiv 2507.09990)"
PLORA = "Fed-PLoRA (arXiv 2602.16936)"
FEDPOWER = "FedPower (arXiv 2605.08443)"


def load_rows(dirs: Iterable[str | Path]) -> list[dict]:
    """The finished rows of the grids in ``dirs`` (a results.jsonl file or its folder,
    or a folder of such folders, e.g. ``benchmarks/results/claims``; a folder's
    ``mia.jsonl``, written by ``benchmarks.grids.claims_mia``, adds the attacks to the rows of
    the same ``key``)."""
    rows: dict[str, dict] = {}
    anon = 0
    paths = []
    expanded: list[Path] = []
    for d in dirs:
        p = Path(d)
        if p.is_dir() and not (p / "results.jsonl").is_file():
            expanded += sorted(c.parent for c in p.glob("*/results.jsonl")) or [p]
        else:
            expanded.append(p)
    for p in expanded:
        path = p / "results.jsonl" if p.is_dir() else p
        if not path.is_file():
            raise UsageError(
                f"{p}: no results.jsonl (a benchmarks.grids.runner --out folder, or a folder of them)"
            )
        if path.suffix != ".jsonl":
            raise UsageError(f"{p}: not a results.jsonl file or a grid folder")
        paths.append(path)
        if p.is_dir() and (p / "mia.jsonl").is_file():
            paths.append(p / "mia.jsonl")
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{i + 1}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or "error" in row or "skipped" in row:
                continue
            if "grid" not in row or "group" not in row:
                continue
            key = row.get("key")
            if key is None:
                key, anon = f"anon{anon}", anon + 1
            if path.name == "mia.jsonl":
                # an attack adds to its run; its own wall time must not replace the
                # training's (the tables' s/run), nor any other field of the run. An
                # attack whose run is not in results.jsonl (moved out, superseded) is
                # not a run: it must not count as an attacked seed
                if key not in rows:
                    continue
                row = {("attack_seconds" if k == "seconds" else k): v for k, v in row.items()}
                rows[key] = {**row, **rows[key]}
            else:
                rows[key] = {**rows.get(key, {}), **row}
    return list(rows.values())


def cells(rows: Sequence[dict], metric: str = METRIC) -> dict[tuple[str, str], dict]:
    """(grid, group) → {seeds: {seed: value}, **mean_ci}."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    seen: dict[tuple[str, str, int], object] = {}
    for r in rows:
        v = r.get(metric)
        if v is None:
            continue
        seed = int(r.get("seed", 0))
        cell = (r["grid"], r["group"], seed)
        if cell in seen:
            # two configurations under one group (e.g. a grid re-run after its learning
            # rate changed): which one counts must not depend on the order of the rows
            raise UsageError(
                f"{r['grid']} {r['group']} seed {seed}: two runs of different "
                f"configurations ({seen[cell]} and {r.get('key')}); move the superseded "
                "rows out of results.jsonl"
            )
        seen[cell] = r.get("key")
        by.setdefault((r["grid"], r["group"]), {})[seed] = float(v)
    return {k: {"seeds": s, **mean_ci(list(s.values()))} for k, s in by.items()}


def _claim(cid, paper, statement, holds, measured, setting) -> dict:
    return {
        "id": cid,
        "paper": paper,
        "statement": statement,
        "holds": holds,
        "verdict": verdict_word(holds),
        "measured": measured,
        "setting": setting,
    }


def compare(
    table: dict, grid: str, a: str, b: str, cid: str, paper: str, statement: str, setting: dict
) -> dict | None:
    """The claim "group a beats group b" in ``grid``; None when neither cell ran."""
    ca, cb = table.get((grid, a)), table.get((grid, b))
    if ca is None and cb is None:
        return None
    d = paired(ca, cb)
    measured = {
        "diff_mean": d["mean"],
        "diff_ci95": d["ci"],
        "pairs": len(d["pairs"]),
        a: _cell_brief(ca),
        b: _cell_brief(cb),
    }
    return _claim(cid, paper, statement, verdict_better(d), measured, {"grid": grid, **setting})


def _cell_brief(c: dict | None) -> dict | None:
    if c is None:
        return None
    return {"mean": c["mean"], "std": c["std"], "ci95": c["ci"], "n": c["n"]}


def _eps_tags(table: dict, grid: str) -> list[str]:
    tags = {g.split("/")[-1] for (gr, g) in table if gr == grid}
    dp = sorted((t for t in tags if t.startswith("eps")), key=lambda t: float(t[3:]))
    return dp + (["nodp"] if "nodp" in tags else [])


def _cid_prefix(grid: str, home: str) -> str:
    """Claim ids of a grid's second data set (claims-bbc) carry its name."""
    return "" if grid == home else grid.removeprefix("claims-") + ":"


def fedask_claims(table: dict, grid: str = "claims-fedask") -> list[dict]:
    out, pre = [], _cid_prefix(grid, "claims-fedask")
    for tag in _eps_tags(table, grid):
        if tag == "nodp":
            continue
        eps = tag[3:]
        setting = {"epsilon": float(eps), "metric": METRIC, "level": "sample"}
        for clip in ("w", "b"):
            c = compare(
                table,
                grid,
                f"fedask-{clip}/{tag}",
                f"ffa/{tag}",
                f"{pre}fedask_beats_ffa:{clip}:eps{eps}",
                FEDASK,
                f"Under DP (ε = {eps}), FedASK (clip space {clip}) is more accurate than FFA-LoRA.",
                {**setting, "clip_space": clip},
            )
            out.append(c)
        out.append(
            compare(
                table,
                grid,
                f"ffa/{tag}",
                f"fedavg/{tag}",
                f"{pre}ffa_beats_fedavg:eps{eps}",
                FEDASK,
                f"Under DP (ε = {eps}), FFA-LoRA is more accurate than FedAvg-LoRA.",
                setting,
            )
        )
        for m in ("fedask-w", "fedask-b", "ffa", "fedavg"):
            out.append(
                compare(
                    table,
                    grid,
                    f"{m}/{tag}",
                    f"probe/{tag}",
                    f"{pre}{m}_beats_probe:eps{eps}",
                    "baseline (issue 18)",
                    f"At ε = {eps}, DP-LoRA ({m}) is more accurate than the DP linear probe.",
                    setting,
                )
            )
    return [c for c in out if c is not None]


def fedpower_claims(table: dict) -> list[dict]:
    grid, out = "claims-fedpower", []
    for tag in _eps_tags(table, grid):
        if tag == "nodp":
            continue
        eps = tag[3:]
        setting = {"epsilon": float(eps), "metric": METRIC, "level": "client"}
        for other in ("ffa", "fedavg"):
            out.append(
                compare(
                    table,
                    grid,
                    f"fedpower/{tag}",
                    f"{other}/{tag}",
                    f"fedpower_beats_{other}:eps{eps}",
                    FEDPOWER,
                    f"At client-level ε = {eps}, FedPower is more accurate than {other}.",
                    setting,
                )
            )
        for pert in ("input", "output"):
            if (grid, f"fedpower-{pert}/{tag}") not in table:
                continue  # the perturbation comparison ran at this ε only if its cell did
            out.append(
                compare(
                    table,
                    grid,
                    f"fedpower/{tag}",
                    f"fedpower-{pert}/{tag}",
                    f"powerdp_beats_{pert}:eps{eps}",
                    FEDPOWER,
                    f"At client-level ε = {eps}, PowerDP is more accurate than {pert} "
                    "perturbation.",
                    setting,
                )
            )
    return [c for c in out if c is not None]


def hetero_claims(table: dict, grid: str = "claims-hetero") -> list[dict]:
    out, pre = [], _cid_prefix(grid, "claims-hetero")
    # groups method/partition/privacy (claims-bbc also holds the FedASK groups method/privacy)
    conds = sorted({g.split("/", 1)[1] for (gr, g) in table if gr == grid and g.count("/") == 2})
    for cond in conds:
        part, tag = cond.rsplit("/", 1)
        setting = {"partition": part, "privacy": tag, "metric": METRIC}
        for other in ("flora", "flexlora", "hetlora"):
            out.append(
                compare(
                    table,
                    grid,
                    f"plora/{cond}",
                    f"{other}/{cond}",
                    f"{pre}plora_beats_{other}:{part}:{tag}",
                    PLORA,
                    f"Fed-PLoRA is more accurate than {other} ({part}, {tag}).",
                    setting,
                )
            )
    return [c for c in out if c is not None]


#: the DP linear probe's group in the dplearn grid (benchmarks.grids.jobs)
DPLEARN_PROBE = "probe-b500-s20-r10-lr5e-2"


def recipe_claims(table: dict, grid: str = "dplearn") -> list[dict]:
    """Issue 18 item 4: each DP-LoRA candidate of the dplearn grid against the DP linear
    probe at the same ε, on the paired seeds: "beats" (:func:`verdict_better`) and
    "reaches" (:func:`verdict_reaches`, within ``MARGIN``). Another scale of the grid
    (``dplearn-m21k``) compares within itself; its claim ids carry its name
    (``m21k:recipe_beats_probe:…``)."""
    out = []
    pre = "" if grid == "dplearn" else grid.removeprefix("dplearn-") + ":"
    for tag in _eps_tags(table, grid):
        probe = f"{DPLEARN_PROBE}/{tag}"
        if tag == "nodp" or (grid, probe) not in table:  # the claim is about DP at one ε
            continue
        eps = tag[3:]
        setting = {"epsilon": float(eps), "metric": METRIC, "level": "sample"}
        for gr, group in sorted(table):
            name = group.split("/")[0]
            if gr != grid or not group.endswith(f"/{tag}") or name.startswith("probe"):
                continue
            c = compare(
                table,
                grid,
                group,
                probe,
                f"{pre}recipe_beats_probe:{name}:eps{eps}",
                "baseline (issue 18)",
                f"At ε = {eps}, the DP-LoRA recipe {name} is more accurate than the DP "
                "linear probe.",
                setting,
            )
            out.append(c)
            d = paired(table.get((grid, group)), table.get((grid, probe)))
            out.append(
                _claim(
                    f"{pre}recipe_reaches_probe:{name}:eps{eps}",
                    "baseline (issue 18)",
                    f"At ε = {eps}, the DP-LoRA recipe {name} reaches the DP linear probe "
                    f"(at most {MARGIN:g} behind).",
                    verdict_reaches(d),
                    c["measured"],
                    {"grid": grid, **setting, "margin": MARGIN},
                )
            )
    return out


def mia_claims(rows: Sequence[dict]) -> list[dict]:
    """Membership inference near chance on the DP runs that were attacked."""
    by: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        for attack, res in (r.get("attacks") or {}).items():
            # a DP guarantee is claimed of private runs only: judged by the run's noise,
            # not by its group's name (the attacks grid's non-private groups are
            # "…/overfit" and "…/normal")
            if r["group"].endswith("nodp") or not _private(r):
                continue
            by.setdefault((r["grid"], r["group"], attack), []).append(
                {"seed": r.get("seed"), "auc": res.get("auc"), "ci": (res.get("ci") or {})}
            )
    out = []
    for (grid, group, attack), runs in sorted(by.items()):
        ups = [_auc_ci(x)[1] for x in runs]
        los = [_auc_ci(x)[0] for x in runs]
        seeds = {x["seed"] for x in runs}
        if any(lo is not None and lo > 0.5 + MIA_MARGIN for lo in los):
            holds: bool | None = False
        elif len(seeds) >= 3 and all(u is not None and u < 0.5 + MIA_MARGIN for u in ups):
            holds = True
        else:
            holds = None
        aucs = [x["auc"] for x in runs]
        known_ups = [u for u in ups if u is not None]
        known_los = [lo for lo in los if lo is not None]
        out.append(
            _claim(
                f"mia_near_chance:{attack}:{grid.removeprefix('claims-')}:{group}",
                "DP guarantee",
                f"Membership inference ({attack}) on {grid} {group} is near chance "
                f"(every attacked run's AUC interval below {0.5 + MIA_MARGIN:g}, "
                "at least 3 seeds).",
                holds,
                {
                    # the verdict's inputs first: each run's own bootstrap interval
                    "largest_run_auc_upper": max(known_ups) if known_ups else None,
                    "smallest_run_auc_lower": min(known_los) if known_los else None,
                    "seeds": len(seeds),
                    # the spread of the AUC across seeds (not what the verdict reads)
                    "auc": mean_ci(aucs),
                    "per_seed": runs,
                },
                {"grid": grid, "attack": attack, "margin": MIA_MARGIN},
            )
        )
    return out


def _private(row: dict) -> bool:
    """Whether a run released with DP noise: a finite ε or a positive σ."""
    eps, sigma = row.get("epsilon"), row.get("sigma")
    if eps is not None and math.isfinite(float(eps)):
        return True
    return bool(sigma) and float(sigma) > 0


def _auc_ci(x: dict) -> tuple[float | None, float | None]:
    ci = x["ci"]
    if isinstance(ci, dict):
        ci = ci.get("auc")
    if isinstance(ci, list | tuple) and len(ci) == 2:
        return float(ci[0]), float(ci[1])
    return None, None


def decide(dirs: Sequence[str | Path]) -> dict:
    """Every utility claim the grids in ``dirs`` can decide, with the cells' statistics."""
    rows = load_rows(dirs)
    if not rows:
        raise UsageError("the grids hold no finished run")
    table = cells(rows)
    acc = cells(rows, "accuracy")
    claims = [*fedask_claims(table), *fedpower_claims(table), *hetero_claims(table)]
    claims += fedask_claims(table, "claims-bbc") + hetero_claims(table, "claims-bbc")
    for grid in sorted({gr for (gr, _) in table if gr == "dplearn" or gr.startswith("dplearn-")}):
        claims += recipe_claims(table, grid)
    claims += mia_claims(rows)
    cell_rows = []
    for (grid, group), c in sorted(table.items()):
        a = acc.get((grid, group)) or {}
        secs = [
            r["seconds"]
            for r in rows
            if r["grid"] == grid and r["group"] == group and r.get("seconds") is not None
        ]
        cell_rows.append(
            {
                "grid": grid,
                "group": group,
                "n": c["n"],
                "balanced_mean": c["mean"],
                "balanced_std": c["std"],
                "balanced_ci95": c["ci"],
                "accuracy_mean": a.get("mean"),
                "accuracy_std": a.get("std"),
                "accuracy_ci95": a.get("ci"),
                "seconds_mean": statistics.fmean(secs) if secs else None,
            }
        )
    return {"claims": claims, "cells": cell_rows, "sources": [str(d) for d in dirs]}
