"""Shared output helpers for ``analysis``: figures (matplotlib Agg, PNG + SVG), the JSON
document, and the short text table each analysis prints.

Figures are paper quality: labelled axes with units, a legend, log axes where the
quantity spans decades, and the closed form (lines) drawn beside the measurement
(markers). Nothing here needs a display.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display anywhere (tests, servers); must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from fl.io import atomic_write_json  # noqa: E402

__all__ = [
    "plt",
    "subplots",
    "save_figure",
    "write_json",
    "jsonable",
    "to_json_text",
    "single_thread",
    "default_out",
    "format_table",
    "finite_or_none",
    "loglog_slope",
]

_STYLE = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "legend.fontsize": 7,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "svg.hashsalt": "fedlora-analysis",  # deterministic SVG ids
}


def subplots(ncols: int = 1, nrows: int = 1, width: float = 3.8, height: float = 3.2):
    """A figure with ``nrows × ncols`` axes (each ``width × height`` inches) in the
    project style. Returns (fig, list of axes, row-major)."""
    plt.rcParams.update(_STYLE)  # analysis figures only; set here so legends use it too
    with plt.rc_context(_STYLE):
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False
        )
    for ax in axes.ravel():
        ax.grid(True, which="both", alpha=0.3)
    return fig, list(axes.ravel())


def save_figure(fig, out: str | Path, stem: str) -> dict[str, str]:
    """Write ``out/stem.png`` (200 dpi) and ``out/stem.svg`` and close the figure.
    Returns {"png": path, "svg": path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    with plt.rc_context(_STYLE):
        fig.tight_layout()
        for ext in ("png", "svg"):
            p = out / f"{stem}.{ext}"
            tmp = out / f".{stem}.{os.getpid()}.tmp.{ext}"
            kw = {"dpi": 200} if ext == "png" else {"metadata": {"Date": None}}
            fig.savefig(tmp, format=ext, **kw)
            os.replace(tmp, p)
            paths[ext] = str(p)
    plt.close(fig)
    return paths


def finite_or_none(x):
    """JSON has no NaN/Inf: map them to None (null); pass other values through."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _clean(obj):
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return finite_or_none(obj)
    return obj


def jsonable(doc: dict) -> dict:
    """A copy of ``doc`` as plain JSON data (tuples → lists, NaN/Inf → None)."""
    return _clean(doc)


def write_json(doc: dict, out: str | Path, stem: str) -> str:
    """Write the analysis document (NaN/Inf → null) to ``out/stem.json``; returns the path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"{stem}.json"
    atomic_write_json(p, _clean(doc))
    return str(p)


def to_json_text(doc: dict) -> str:
    """The JSON document as text (NaN/Inf → null), as printed by ``--json``."""
    return json.dumps(_clean(doc), indent=2, sort_keys=False)


def default_out(name: str) -> Path:
    """Default output folder: reports/analysis/NAME (relative to the working directory)."""
    return Path("reports") / "analysis" / name


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4):
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str], max_rows: int = 40) -> str:
    """A plain-text table of ``columns`` of ``rows`` (at most ``max_rows`` rows shown)."""
    shown = list(rows)[:max_rows]
    cells = [[_fmt(r.get(c)) for c in columns] for r in shown]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows (see the JSON)")
    return "\n".join(lines)


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (the exponent of a power law y ∝ x^k).
    Points with non-positive x or y are dropped; NaN if fewer than two remain."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pts)
    return sxy / sxx if sxx > 0 else float("nan")


class single_thread:
    """Context manager: torch on one intra-op thread while an analysis runs.

    The analyses multiply small matrices (tens to hundreds of rows), where extra
    threads only add synchronization; on a loaded machine the default thread pool
    made them ~50× slower (measured: 0.2 s vs 10 s). The previous count is restored."""

    def __enter__(self):
        import torch

        self._n = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self._n)
        return False
