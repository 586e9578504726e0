"""The report's analysis and claims sections (:mod:`audit.report.build` assembles the rest).

Analyses show their figure and a short summary (fits, ratios), with the full rows left
in their JSON; claims are a readable table (claim, setting, measured value, verdict,
figure). Nothing here prints a raw dict (:func:`readable`).
"""

from __future__ import annotations

from pathlib import Path

from audit.report.document import (
    Figure,
    Paragraph,
    Section,
    Table,
    copy_figure,
    save_figure,
)
from audit.report.document import format_cell as _fmt
from audit.report.figures import claims_figure
from fl.errors import UsageError
from fl.io import read_json


def figure_paragraph(fig: Path, caption: str) -> Figure:
    """A figure written into the report's ``figures/`` folder."""
    return Figure(f"figures/{fig.name}", caption)


def analyses_section(analyses_dir: str | None, figdir: Path) -> Section:
    """The "Noise analyses" section: each analysis under ``analyses_dir`` with its figure
    (copied into ``figdir``) and a short summary."""
    sec = Section("Noise analyses")
    analyses = []
    if analyses_dir and Path(analyses_dir).is_dir():
        for js in sorted(Path(analyses_dir).glob("*/*.json")) + sorted(
            Path(analyses_dir).glob("*.json")
        ):
            try:
                doc = read_json(js)
            except UsageError:
                continue
            if not isinstance(doc, dict) or "analysis" not in doc or doc["analysis"] == "claims":
                continue
            analyses.append((js, doc))
    if not analyses:
        sec.missing = "no analysis results were given."
    for js, doc in analyses:
        name = doc["analysis"]
        sub = Section(name)
        sec.add(sub)
        for png in sorted(js.parent.glob("*.png")):
            dst = copy_figure(png, figdir / f"{name}-{png.name}")
            sub.add(figure_paragraph(dst, name))
        rows_a = [ra for ra in doc.get("rows") or [] if isinstance(ra, dict)]
        summarize = _SUMMARIES.get(name)
        if summarize and rows_a:
            sub.add(*summarize(doc, rows_a))
        sub.add(Paragraph.of(f"Full rows ({len(rows_a)}) in {js}."))
    return sec


def _grouped(rows: list[dict], key, cols: tuple[str, ...], agg=max) -> list[list]:
    """One row per group: ``[group, count, agg(col) for col in cols]`` (numbers only)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    out = []
    for g, rs in groups.items():
        vals = [[r[c] for r in rs if isinstance(r.get(c), int | float)] for c in cols]
        out.append([g, len(rs), *[agg(v) if v else None for v in vals]])
    return out


def _summary_amplification(doc: dict, rows: list[dict]) -> list:
    fits = doc.get("fits") or {}
    t = [[k, v.get("exponent_low"), v.get("exponent_high")] for k, v in fits.items()]
    return [
        Paragraph.of(
            "Noise power in ΔW against σ on log–log axes: slope 2 is linear in σ², "
            "slope 4 quadratic (the cross term of noise on both factors)."
        ),
        Table.of(["scheme", "slope (low σ)", "slope (high σ)"], t),
    ]


def _summary_exactness(doc: dict, rows: list[dict]) -> list:
    def key(r):
        a = {True: " (shared A)", False: " (independent A)"}.get(r.get("shared_a"), "")
        return f"{r.get('method')}{a}"

    t = _grouped(rows, key, ("relative_error",))
    return [
        Paragraph.of("Largest aggregation error ‖ΔW_global − Σ p_k B_kA_k‖_F / ‖Σ p_k B_kA_k‖_F."),
        Table.of(["method", "configurations", "largest relative error"], t),
    ]


def _summary_hetero(doc: dict, rows: list[dict]) -> list:
    t = _grouped(rows, lambda r: r.get("method"), ("init_noise", "agg_noise"))
    return [
        Paragraph.of("Largest initialization and aggregation noise (Frobenius norm) per method."),
        Table.of(["method", "rounds", "largest init noise", "largest aggregation noise"], t),
    ]


def _summary_refactorization(doc: dict, rows: list[dict]) -> list:
    t = []
    for scheme in dict.fromkeys(r.get("scheme") for r in rows):
        at = [
            r
            for r in rows
            if r.get("scheme") == scheme and isinstance(r.get("epsilon"), float | int)
        ]
        if at:
            lo, hi = min(at, key=lambda r: r["epsilon"]), max(at, key=lambda r: r["epsilon"])
            t.append(
                [scheme]
                + [
                    r.get(k)
                    for r in (lo, hi)
                    for k in ("epsilon", "subspace_error", "reconstruction_error")
                ]
            )
    hd = ["scheme", "smallest ε", "subspace error", "reconstruction error",
          "largest ε", "subspace error", "reconstruction error"]  # fmt: skip
    return [
        Paragraph.of(
            "Error of the private factors against the non-private truncated SVD at the "
            "smallest and the largest ε measured."
        ),
        Table.of(hd, t),
    ]


#: analysis name → the few key numbers the page shows (the rows stay in the JSON)
_SUMMARIES = {
    "amplification": _summary_amplification,
    "exactness": _summary_exactness,
    "hetero": _summary_hetero,
    "refactorization": _summary_refactorization,
}


CLAIM_FIGURES = {
    "fedask_exact": "exactness",
    "fedask_linear_noise": "amplification",
    "plora_zero_init_noise": "hetero",
    "flora_zero_agg_noise": "hetero",
    "hetlora_flexlora_both_noises": "hetero",
    "fedpower_exact": "exactness",
    "output_perturbation": "refactorization",
}
#: at most this many entries of a measured value or setting are shown (the rest: JSON)
READABLE_ITEMS = 4


def readable(x, depth: int = 0, items: int = READABLE_ITEMS) -> str:
    """A measured value or a setting as text a reader can scan (never a dict's repr):
    ``key value; key value`` (the first ``items`` keys, ``note`` left out), numbers to 3
    digits, long lists and nested mappings as their range, short lists of numbers (an
    interval ``[lo, hi]``) as they are."""
    if isinstance(x, bool) or x is None:
        return {True: "yes", False: "no", None: "–"}[x]
    if isinstance(x, float | int):
        return _fmt(float(x), 3) if isinstance(x, float) else str(x)
    if isinstance(x, str):
        return x
    if isinstance(x, list | tuple):
        nums = [v for v in x if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(nums) == len(x) and len(x) > READABLE_ITEMS:
            return f"{readable(min(nums))} to {readable(max(nums))} ({len(x)} values)"
        if len(nums) == len(x):
            return "[" + ", ".join(readable(v) for v in x) + "]"
        return f"{len(x)} entries"
    if isinstance(x, dict):
        pairs = [(k, v) for k, v in x.items() if k != "note"]
        if depth >= 1 and len(pairs) > READABLE_ITEMS:
            return f"{len(pairs)} values, {readable(pairs[0][1])} to {readable(pairs[-1][1])}"
        sep = "; " if depth == 0 else ", "
        shown = [f"{str(k).replace('_', ' ')} {readable(v, depth + 1)}" for k, v in pairs]
        more = len(shown) - items
        return sep.join(shown[:items]) + (f"{sep}… {more} more" if more > 0 else "")
    return str(x)


def _claim_figure(c: dict, analyses_dir: str | None) -> str:
    """Where the figure behind a claim is: its analysis's figure, the utility grids'
    figure, else none."""
    if "verdict" in c and "diff_mean" in (c.get("measured") or {}):
        return "accuracy vs ε (below)"
    name = next((a for k, a in CLAIM_FIGURES.items() if str(c.get("id", "")).startswith(k)), None)
    if name and analyses_dir and (Path(analyses_dir) / name).is_dir():
        return f"{name} (Noise analyses)"
    return "–"


def claims_section(claims: dict | None, analyses_dir: str | None, figdir: Path) -> Section:
    """The "Claims check" section: one readable row per claim of the claims analysis
    (``claims``), with the figure that shows it."""
    sec = Section("Claims check")
    if not (claims and claims.get("claims")):
        sec.missing = "the claims analysis was not run."
        return sec
    verdicts = {True: "holds", False: "does not hold", None: "inconclusive"}
    png = Path(analyses_dir) / "claims" / "claims.png" if analyses_dir else None
    t = [
        [
            f"{c.get('paper')}: {c.get('statement')}",
            readable(c.get("setting") or {}, items=8),
            # a comparison's measured: difference, interval, pairs and both cells
            readable(c.get("measured") or {}, items=5),
            verdicts.get(c.get("holds"), "inconclusive"),
            _claim_figure(c, analyses_dir),
        ]
        for c in claims["claims"]
    ]
    sec.add(Table.of(["claim", "setting", "measured", "verdict", "figure"], t))
    # the verdicts counted per paper (the analysis's own figure, a bar per claim, repeats
    # the table above in an image some ten thousand pixels tall: linked, not embedded)
    fig = claims_figure(claims["claims"])
    if fig is not None:
        sec.add(figure_paragraph(save_figure(fig, figdir / "claims-verdicts")[0],
                        "the claims by verdict, per paper"))  # fmt: skip
    if png and png.is_file():
        sec.add(Paragraph.of(f"The analysis's figure of every claim and its verdict: {png}."))
    _utility_blocks(sec, claims.get("utility"), png.parent if png else None, figdir)
    where = f" ({Path(analyses_dir) / 'claims' / 'claims.json'})" if analyses_dir else ""
    return sec.add(
        Paragraph.of(
            f"Every measured value, with the setting's notes, is in the claims JSON{where}."
        )
    )


def _ci_text(mean, std, ci) -> str:
    if mean is None:
        return "–"
    txt = _fmt(mean, 3) if std is None else f"{_fmt(mean, 3)} ± {_fmt(std, 3)}"
    if ci and ci[0] is not None:
        txt += f" [{_fmt(ci[0], 3)}, {_fmt(ci[1], 3)}]"
    return txt


def _utility_blocks(sec: Section, utility: dict | None, claims_dir, figdir: Path) -> None:
    """The privacy–utility grids behind the utility claims: cells and the figure."""
    if not utility or not utility.get("cells"):
        return
    sec.add(
        Paragraph.of(
            "Privacy–utility claims are decided over seeds from the measurement grids "
            f"{', '.join(utility.get('sources') or [])}: paired differences A − B over "
            "common seeds with a 95% Student-t interval; holds when the interval lies "
            "above 0, does not hold when it lies below +0.01 balanced accuracy, "
            "inconclusive otherwise (analysis/utility_claims.py)."
        )
    )
    rows = [
        [
            c["grid"],
            c["group"],
            str(c["n"]),
            _ci_text(c["balanced_mean"], c["balanced_std"], c["balanced_ci95"]),
            _ci_text(c["accuracy_mean"], c["accuracy_std"], c["accuracy_ci95"]),
            "–" if c.get("seconds_mean") is None else f"{c['seconds_mean']:.0f}",
        ]
        for c in utility["cells"]
    ]
    sec.add(
        Table.of(
            [
                "grid",
                "cell",
                "seeds",
                "balanced accuracy (mean ± std [95% CI])",
                "accuracy",
                "s/run",
            ],
            rows,
        )
    )
    png = Path(claims_dir) / "claims_utility.png" if claims_dir else None
    if png and png.is_file():
        dst = copy_figure(png, figdir / "claims-utility.png")
        sec.add(
            figure_paragraph(dst, "balanced accuracy vs ε per method (mean, 95% CI over seeds)")
        )


# --------------------------------------------------------------------------- outside inputs
#: the fields of `fedlora audit --claim FILE --json` a report row needs
CLAIM_AUDIT_FIELDS = ("claimed_epsilon", "delta", "epsilon_pld", "understated", "findings")


def read_attacks_dir(path) -> dict:
    """attacks.json of an attack folder (``fedlora attack ... --out DIR``, by default
    ``ADAPTER/attacks``); UsageError when the folder has none or it is not one."""
    p = Path(path)
    js = p / "attacks.json" if p.is_dir() else p
    if not js.is_file():
        raise UsageError(f"{p} has no attacks.json (give the --out folder of `fedlora attack`)")
    doc = read_json(js)
    if not isinstance(doc, dict) or not isinstance(doc.get("attacks"), dict):
        raise UsageError(f"{js} is not an attacks.json of `fedlora attack` (no 'attacks' block)")
    return doc


def read_claim_audit(path) -> dict:
    """The JSON `fedlora audit --claim FILE --json` printed (saved to a file); UsageError
    when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"claim audit file not found: {p}")
    doc = read_json(p)
    missing = [k for k in CLAIM_AUDIT_FIELDS if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise UsageError(
            f"{p} is not the output of `fedlora audit --claim FILE --json` (missing "
            f"{', '.join(missing)})"
        )
    return doc


def _num(v):
    """A JSON number of the audit output ("inf" / "nan" strings → floats)."""
    if isinstance(v, str) and v.lower() in ("inf", "infinity", "-inf", "nan"):
        return float(v)
    return v


def foreign_summary(attack_dir=None, claim_audit=None) -> dict:
    """A report row (the keys :func:`audit.report.build._run_summary` gives a run) for what an
    outside user has: the attack folder of a foreign adapter (``fedlora attack --adapter
    ... --out DIR``) and / or the saved JSON of ``fedlora audit --claim FILE --json``. The
    claim gives ε claimed and recomputed, δ, the level and the findings; the attack folder
    the attacks, their scores and ROC figures; nothing gives utility or per-round metrics."""
    if attack_dir is None and claim_audit is None:
        raise UsageError("give an attack folder, a claim audit, or both")
    att = read_attacks_dir(attack_dir) if attack_dir is not None else None
    claim = read_claim_audit(claim_audit) if claim_audit is not None else None
    target = (att or {}).get("target") or {}
    adapter = target.get("adapter") or target.get("run_dir")
    if adapter:
        name = Path(adapter).name
    elif attack_dir is not None:
        name = Path(attack_dir).name
    else:
        name = Path(claim_audit).stem
    level = None
    if claim is not None:
        level = "client" if "client" in str(claim.get("neighbouring", "")) else "sample"
    task = target.get("task", "classification")
    commands = []
    if target.get("adapter"):
        commands.append(
            f"fedlora attack --adapter {target['adapter']} --model {target.get('model')} "
            f"--members {target.get('members_from') or 'MEMBERS_FILE'} "
            f"--nonmembers {target.get('nonmembers_from') or 'NONMEMBERS_FILE'} "
            f"--out {attack_dir}"
        )
    if claim_audit is not None:
        commands.append(f"fedlora audit --claim CLAIM_FILE --json > {claim_audit}")
    row = {
        "run": name,
        "path": str(attack_dir if attack_dir is not None else claim_audit),
        "kind": "adapter" if att is not None else "claim",
        "method": "foreign adapter" if att is not None else "claim",
        "level": level,
        "noise_multiplier": None,
        "delta": _num(claim["delta"]) if claim else None,
        "epsilon_claimed": _num(claim["claimed_epsilon"]) if claim else None,
        "target_epsilon": None,
        "accuracy": None,
        "balanced_accuracy": None,
        "perplexity": None,
        "wall_seconds": None,
        "config": {"model": target.get("model"), "task": task},
        "versions": {},
        "manifest": {},
        "audit": claim
        if claim is not None
        else {"error": "no claim audit given (save `fedlora audit --claim FILE --json`)"},
        "epsilon_recomputed": _num(claim["epsilon_pld"]) if claim else None,
        "understated": claim.get("understated") if claim else None,
        "metrics": [],
        "attacks": att,
        "scores_path": None,
        "roc_figures": [],
        "clients": None,
        "commands": commands,
        "claim_audit": str(claim_audit) if claim_audit is not None else None,
    }
    if att is not None:
        d = Path(attack_dir)
        if (d / "scores.npz").is_file():
            row["scores_path"] = str(d / "scores.npz")
        row["roc_figures"] = [
            str(p)
            for p in sorted(d.glob("*.png"))
            if not p.stem.startswith(("roc_clients", "client_"))
        ]
        if (d / "clients.json").is_file():
            row["clients"] = read_json(d / "clients.json")
    return row


def pair_foreign(attack_dirs=None, claim_audits=None) -> list[tuple]:
    """(attack folder, claim audit) pairs: the i-th claim audit belongs to the i-th attack
    folder; the longer list's extra entries stand alone."""
    a, c = list(attack_dirs or []), list(claim_audits or [])
    n = max(len(a), len(c))
    return [(a[i] if i < len(a) else None, c[i] if i < len(c) else None) for i in range(n)]
