"""The report's analysis and claims sections (:mod:`audit.report` assembles the rest).

Analyses show their figure and a short summary (fits, ratios), with the full rows left
in their JSON; claims are a readable table (claim, setting, measured value, verdict,
figure). Nothing here prints a raw dict (:func:`readable`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from audit.report_doc import (
    Figure,
    Paragraph,
    Section,
    Table,
)
from audit.report_doc import format_cell as _fmt
from fl.errors import UsageError
from fl.io import read_json


def _figure(fig: Path, caption: str) -> Figure:
    """A figure written into the report's ``figures/`` folder."""
    return Figure(f"figures/{fig.name}", caption)


def _analyses_section(analyses_dir: str | None, figdir: Path) -> Section:
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
            dst = figdir / f"{name}-{png.name}"
            shutil.copyfile(png, dst)
            sub.add(_figure(dst, name))
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


def _claim_figure(c: dict, analyses_dir: str | None, claims_png: bool) -> str:
    """Where the figure behind a claim is: its analysis's figure, else the claims figure."""
    if "verdict" in c and "diff_mean" in (c.get("measured") or {}):
        return "accuracy vs ε (below)"
    name = next((a for k, a in CLAIM_FIGURES.items() if str(c.get("id", "")).startswith(k)), None)
    if name and analyses_dir and (Path(analyses_dir) / name).is_dir():
        return f"{name} (Noise analyses)"
    return "claims figure (below)" if claims_png else "–"


def _claims_section(claims: dict | None, analyses_dir: str | None, figdir: Path) -> Section:
    sec = Section("Claims check")
    if not (claims and claims.get("claims")):
        sec.missing = "the claims analysis was not run."
        return sec
    verdicts = {True: "holds", False: "does not hold", None: "inconclusive"}
    png = Path(analyses_dir) / "claims" / "claims.png" if analyses_dir else None
    has_png = bool(png and png.is_file())
    t = [
        [
            f"{c.get('paper')}: {c.get('statement')}",
            readable(c.get("setting") or {}, items=8),
            # a comparison's measured: difference, interval, pairs and both cells
            readable(c.get("measured") or {}, items=5),
            verdicts.get(c.get("holds"), "inconclusive"),
            _claim_figure(c, analyses_dir, has_png),
        ]
        for c in claims["claims"]
    ]
    sec.add(Table.of(["claim", "setting", "measured", "verdict", "figure"], t))
    if has_png:
        dst = figdir / "claims-claims.png"
        shutil.copyfile(png, dst)
        sec.add(_figure(dst, "claims and their verdicts"))
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
        dst = figdir / "claims-utility.png"
        shutil.copyfile(png, dst)
        sec.add(_figure(dst, "balanced accuracy vs ε per method (mean, 95% CI over seeds)"))
