"""The report's figures (issue 41, item 6): the privacy figure (ε claimed, recomputed,
certified and noise-implied per run, against utility), ROC curves on log–log axes,
per-round curves only where a run has more than one round, compressed PNGs; and a report
of the default job's shape (six runs, the job's five analyses) under 1 MB."""

import math
import shutil

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from attacks.metrics import roc_metrics
from audit.report.build import build_report
from audit.report.document import MAX_WIDTH, compress_png, copy_figure, save_figure
from audit.report.figures import (
    accuracy_figure,
    accuracy_series,
    claims_figure,
    implied_epsilon,
    privacy_figure,
    roc_figure,
)
from audit.report.verdict_table import headline, privacy_points
from pipeline.cli import main

#: what the default job reads (pipeline.job: RUNS, ANALYSES)
JOB_RUNS = ("fedavg-nodp", "fedavg-eps8", "ffa-eps8", "fedask-eps8", "fedpower-eps8",
            "plora-eps8")  # fmt: skip
JOB_ANALYSES = ("amplification", "exactness", "hetero", "refactorization", "claims")
#: the report of the default job must stay under this (issue 41, item 6)
MAX_REPORT_BYTES = 1_000_000


def _point(run, dp=True, claimed=8.0, recomputed=8.0, implied=None, lb=None, bal=0.8, acc=0.85):
    return dict(run=run, dp=dp, claimed=claimed if dp else None,
                recomputed=recomputed if dp else None, implied=implied, lb=lb,
                alpha=0.05 if lb is not None else None, balanced_accuracy=bal, accuracy=acc,
                perplexity=None)  # fmt: skip


def _legend(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def _row(run, level="sample", one_run=None, bal=0.5, acc=0.5, metrics=()):
    audit = {"epsilon_pld": 7.99, "findings": []}
    if one_run is not None:
        audit["one_run"] = one_run
    return {"run": run, "level": level, "epsilon_claimed": 8.0 if level != "none" else None,
            "audit": audit, "balanced_accuracy": bal, "accuracy": acc,
            "metrics": list(metrics)}  # fmt: skip


def test_privacy_points_read_the_run_audit():
    """The certified bound is the verdict's (the claim check's), the noise-implied ε is read
    where the run audit puts it and left out where it has none."""
    one = {"epsilon_lb": 1.79, "alpha": 0.05, "m": 500, "kind": "gradient", "delta": 1e-5,
           "claim_check": {"epsilon": 7.99, "delta": 1e-5, "epsilon_lb": 1.72,
                           "exceeds": False}}  # fmt: skip
    rows = [
        _row("with", one_run={**one, "implied_epsilon": 9.5}),
        _row("nested", one_run={**one, "conformance": {"implied_epsilon": "inf"}}),
        _row("without", one_run=one),
        _row("nodp", level="none", bal=0.9, acc=0.91),
    ]
    pts = {p["run"]: p for p in privacy_points(rows)}
    assert pts["with"]["implied"] == 9.5 and pts["nested"]["implied"] == math.inf
    assert pts["without"]["implied"] is None and implied_epsilon({}) is None
    assert pts["with"]["lb"] == 1.72 and pts["with"]["recomputed"] == 7.99
    assert pts["with"]["limit"] is None  # the claim check's limit is the recomputed ε
    client = _row("client", level="client", one_run={**one, "claim_check": {
        **one["claim_check"], "epsilon": 15.98, "delta": 3e-5}})  # fmt: skip
    assert privacy_points([client])[0]["limit"] == 15.98
    assert pts["nodp"]["claimed"] is None and pts["nodp"]["recomputed"] is None
    assert pts["nodp"]["lb"] is None and pts["nodp"]["balanced_accuracy"] == 0.9


def test_privacy_figure_rows_markers_and_legend():
    pts = [
        _point("fedavg-nodp", dp=False, bal=0.9, acc=0.91),
        _point("fedavg-eps8", implied=8.0, lb=1.7, bal=0.5, acc=0.5),
        _point("ffa-eps8", implied=math.inf, lb=0.0, bal=0.5, acc=0.5),
    ]
    fig = privacy_figure(pts)
    ax, au = fig.axes
    # one row per run, labelled with its name, the first on top; ε on a linear axis from 0
    assert [t.get_text() for t in ax.get_yticklabels()] == [p["run"] for p in pts]
    assert ax.get_ylim()[0] > ax.get_ylim()[1] and ax.get_xlim()[0] == 0
    assert ax.get_xscale() == "linear"
    legend = _legend(fig)
    assert legend[:4] == ["ε claimed", "ε recomputed (ledger)", "ε implied by the noise",
                          "certified: ε ≥ bound (95%)"]  # fmt: skip
    assert "balanced accuracy" in legend and "accuracy" in legend
    # equal ε and equal utility: the markers of one run sit at different heights, and no
    # two runs share a height (nothing hidden behind anything)
    ys = [(round(y, 6), x) for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata())
          if len(line.get_xdata()) == 1]  # fmt: skip
    assert len(ys) == len(set(ys))
    eps8 = sorted(y for y, x in ys if x == 8.0 and 0.5 < y < 1.5)
    assert len(eps8) == 3  # claimed, recomputed, implied of fedavg-eps8: three heights
    # the non-DP run is said to be one; ∞ is written at the edge
    texts = [t.get_text() for t in ax.texts]
    assert "no DP claimed" in texts and "∞" in texts
    # without a noise-implied ε in any run, its marker is not in the legend; at client
    # level what one canary may reach (2ε) is marked on the bound's line
    fig2 = privacy_figure([_point("a", lb=1.0), {**_point("b", lb=9.0), "limit": 16.0}])
    assert "ε implied by the noise" not in _legend(fig2)
    assert "limit for one canary (2ε)" in _legend(fig2)
    (cross,) = [ln for ln in fig2.axes[0].lines if ln.get_marker() == "x"]
    assert list(cross.get_xdata()) == [16.0] and fig2.axes[0].get_xlim()[1] > 16.0
    assert privacy_figure([_point("nodp", dp=False)]) is None  # nothing to show


def test_roc_on_log_axes_from_one_over_n():
    rng = np.random.default_rng(0)
    m = np.r_[np.ones(400, bool), np.zeros(500, bool)]
    res = {k: roc_metrics(rng.normal(size=m.size) + s * m, m, n_bootstrap=0)
           for k, s in (("loss", 0.3), ("rmia", 1.0))}  # fmt: skip
    fig = roc_figure("ROC", res)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlim() == pytest.approx((1e-3, 1.0))  # 1/500 > 1e-3: from 1e-3
    labels = [line.get_label() for line in ax.lines]
    assert labels[0] == "random guess"
    diag = ax.lines[0]
    assert list(diag.get_xdata()) == list(diag.get_ydata()) == [1e-3, 1]
    assert any(lab.startswith("loss: AUC ") for lab in labels)
    # every point drawn is on the axes: FPR 0 at 1/n, TPR > 0
    for line in ax.lines[1:]:
        assert min(line.get_xdata()) >= 1 / 500 and min(line.get_ydata()) > 0
    # the FPRs under 1/n are shaded as unmeasurable
    assert any("unmeasurable" in p.get_label() for p in ax.patches)
    # many non-members: the axis starts at 1/n
    big = {"a": {**res["loss"], "n_nonmembers": 5000}}
    assert roc_figure("ROC", big).axes[0].get_xlim()[0] == pytest.approx(1 / 5000)
    assert roc_figure("ROC", {"x": {"error": "failed"}}) is None


def test_per_round_curves_only_with_more_than_one_round():
    rows = [
        _row("two", metrics=[{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.5}]),
        _row("one", metrics=[{"round": 3, "accuracy": 0.8}]),
        _row("none"),
    ]
    series, single = accuracy_series(rows)
    assert [n for n, _ in series] == ["two"] and single == [("one", 3)]
    fig = accuracy_figure(series)
    lo, hi = fig.axes[0].get_ylim()
    assert hi - lo == pytest.approx(0.1)  # equal accuracies: not an axis of ±1e-9
    assert accuracy_figure(accuracy_series(rows[1:])[0]) is None


def test_claims_figure_counts_the_verdicts():
    claims = [{"paper": "A", "holds": True}, {"paper": "A", "holds": None},
              {"paper": "B", "holds": False}, {"paper": "B", "holds": False}]  # fmt: skip
    fig = claims_figure(claims)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["A", "B"]
    widths = {(round(p.get_y() + p.get_height() / 2), to_rgb(p.get_facecolor())): p.get_width()
              for p in ax.patches}  # fmt: skip
    assert widths[(0, to_rgb("#2ca02c"))] == 1 and widths[(1, to_rgb("#d62728"))] == 2
    assert claims_figure([]) is None


def test_compressed_png_keeps_the_colours(tmp_path):
    """A figure of ten lines in matplotlib's ten colours: the compressed PNG (palette,
    at most MAX_WIDTH wide) is several times smaller and still has every colour, and
    white stays white."""
    from matplotlib.figure import Figure
    from PIL import Image

    fig = Figure(figsize=(12, 4))
    ax = fig.add_subplot(1, 1, 1)
    for j in range(10):
        ax.plot(np.arange(50), np.sin(np.arange(50) / 5 + j), lw=3, label=f"line {j}")
    ax.legend()
    raw = tmp_path / "raw.png"
    fig.savefig(raw, dpi=200)
    small = tmp_path / "small.png"
    copy_figure(raw, small)
    assert small.stat().st_size * 2.5 < raw.stat().st_size
    im = Image.open(small)
    assert im.mode == "P" and im.width == MAX_WIDTH
    px = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(int)
    assert tuple(px[0]) == (255, 255, 255)
    for j in range(10):
        c = np.array(to_rgb(f"C{j}")) * 255
        assert np.abs(px - c).max(axis=1).min() <= 12, f"C{j} lost"
    # save_figure writes the compressed PNG only
    (path,) = save_figure(fig, tmp_path / "saved")
    assert path.suffix == ".png" and Image.open(path).mode == "P"
    assert compress_png(path.read_bytes()) is not None
    # a file Pillow cannot read is copied as it is
    svg = tmp_path / "a.svg"
    svg.write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    assert copy_figure(svg, tmp_path / "b.svg").read_text() == svg.read_text()


def test_headline_counts_the_verdicts():
    rows = [{"verdict": "private as claimed (ε = 8); empirical ε ≥ 1.7 at 95%",
             "balanced_accuracy": 0.5},
            {"verdict": "private as claimed (ε = 8); no empirical bound", "balanced_accuracy": 0.8},
            {"verdict": "no DP claimed", "balanced_accuracy": 0.9},
            {"verdict": "ε understated (recomputed 9.1 > claimed 8)"}]  # fmt: skip
    assert headline(rows) == (
        "4 runs: 2 private as claimed, 1 no DP claimed, 1 ε understated; 1 with utility at "
        "chance (balanced accuracy ≤ 0.52)."
    )


# --------------------------------------------------------------------------- the job's shape


@pytest.fixture(scope="module")
def job_report(tmp_path_factory):
    """A report of the default job's shape: its six runs (two tiny runs trained here, a
    DP one with gradient canaries as the job's, and a non-private one, each attacked,
    copied under the job's run names), the job's five analyses run for real (the claims
    analysis over the committed grids, as the job does)."""
    import importlib

    from benchmarks.paths import RESULTS
    from fl.run.engine import train
    from fl.testing import tiny_config

    tmp = tmp_path_factory.mktemp("jobshape")
    made = {
        "dp": tiny_config(rounds=1, dp_level="sample", noise_multiplier=2.0, canaries=50,
                          canary_kind="gradient"),
        "nodp": tiny_config(rounds=1),
    }  # fmt: skip
    for name, cfg in made.items():
        train(cfg, tmp / name, quiet=True)
        rc = main(["attack", str(tmp / name), "--attacks", "loss", "--device", "cpu",
                   "--bootstrap", "20"])  # fmt: skip
        assert rc == 0
    runs = []
    for run in JOB_RUNS:
        shutil.copytree(tmp / ("nodp" if run == "fedavg-nodp" else "dp"), tmp / "runs" / run)
        runs.append(str(tmp / "runs" / run))
    adir = tmp / "analysis"
    grids = sorted(str(p.parent) for p in (RESULTS / "claims").glob("*/results.jsonl"))
    claims = None
    for name in JOB_ANALYSES:
        kw = {"grids": grids} if name == "claims" and grids else {}
        doc = importlib.import_module(f"analysis.{name}").run(seed=0, out=str(adir / name), **kw)
        claims = doc if name == "claims" else claims
    out = tmp / "report"
    s = build_report(runs, str(out), analyses_dir=str(adir), claims=claims,
                     commands=["fedlora run"])  # fmt: skip
    return s, out


@pytest.mark.slow
def test_report_of_the_job_shape(job_report):
    s, out = job_report
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    size = (out / "report.html").stat().st_size
    print(f"report.html of the job's shape: {size} bytes")
    assert size < MAX_REPORT_BYTES, size
    assert s["missing"] == []
    # the line under the title, then the verdict table, then the privacy figure
    where = [
        page.index(x)
        for x in ("<p class='lead'>6 runs: 1 no DP claimed, 5 private as claimed",
                  "<h2>Verdict</h2>", "<table", 'alt="privacy claimed, recomputed and measured',
                  "<h2>Runs</h2>")
    ]  # fmt: skip
    assert where == sorted(where)
    assert s["headline"] in md.split("\n## Verdict\n")[0]
    # the privacy figure's numbers: every DP run with its claim, recomputation and certified
    # bound (gradient canaries); the noise-implied ε where the run audit gives one, and the
    # page explains it only then
    pts = {p["run"]: p for p in s["privacy"]}
    assert list(pts) == list(JOB_RUNS)
    for run in JOB_RUNS[1:]:
        assert None not in (pts[run]["claimed"], pts[run]["recomputed"], pts[run]["lb"])
    assert pts["fedavg-nodp"]["claimed"] is None and pts["fedavg-nodp"]["accuracy"] is not None
    implied = any(p["implied"] is not None for p in pts.values())
    assert ("the noise-implied ε is the ledger's ε recomputed" in md) == implied
    assert set(s["figures"]) == {"privacy", *(f"roc {r}" for r in JOB_RUNS)}
    # one evaluation per run: no per-round figure, and the page says why
    assert "accuracy" not in s["figures"] and "accuracy.png" not in md
    assert "Evaluated at one round only, so no per-round curve: fedavg-nodp (round 1), " in md
    # every figure embedded is a compressed PNG, at most MAX_WIDTH pixels wide
    from PIL import Image

    figs = sorted((out / "figures").glob("*.png"))
    assert page.count("data:image/png;base64,") == md.count("](figures/") == len(figs)
    for f in figs:
        im = Image.open(f)
        assert im.mode == "P" and im.width <= MAX_WIDTH, f.name
    # the analysis's figure of every claim (some ten thousand pixels tall) is linked only
    assert "claims-claims.png" not in md and "claims-verdicts.png" in md
    assert f"{out.parent / 'analysis' / 'claims' / 'claims.png'}" in md
