"""The report of a real (tiny) run, attacked and audited, opens with the verdict table
and the privacy figure, holds no raw dicts, and renders in a real browser: headless
Chromium (the Debian ``chromium`` package, installed here when missing) loads every
figure, finds no empty section, and at a laptop's and a phone's width nothing makes the
page scroll sideways (wide tables become cards on the phone)."""

import html
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from audit.report.build import SECTIONS, build_report
from pipeline.cli import main


def _install_chromium() -> str | None:
    """Install the Debian package; the reason it could not, or None."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return "not root: cannot apt-get install chromium"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    p = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:  # a stale package list: update it once and retry
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=900)
        p = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    return None if p.returncode == 0 else f"apt-get install chromium failed: {p.stderr[-300:]}"


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = _install_chromium()
        found = shutil.which("chromium")
        if found is None:
            print(f"headless Chromium unavailable: {why}")
            pytest.skip(f"headless Chromium unavailable: {why}")
    return found


def _headless(chromium: str, profile, *args) -> subprocess.CompletedProcess:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _analyses(root):
    """A noise-analysis folder (rows, fits, a figure) and a claims document whose
    measured values and settings are nested mappings, as analysis/ writes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = root / "amplification"
    d.mkdir(parents=True)
    sig = np.logspace(-2, 1, 20)
    rows = [{"scheme": "both", "sigma": s, "noise_power": s**4, "closed_form": s**4} for s in sig]
    fits = {"both": {"exponent_low": 2.0, "exponent_high": 4.0, "sigma_low": [0.01, 0.03]}}
    doc = {"analysis": "amplification", "rows": rows, "fits": fits}
    (d / "amplification.json").write_text(json.dumps(doc))
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.loglog(sig, sig**4)
    fig.savefig(d / "amplification.png")
    plt.close(fig)
    claims = {
        "analysis": "claims",
        "claims": [
            {"id": "fedask_linear_noise", "paper": "FedASK", "statement": "noise ∝ σ²",
             "holds": True, "measured": {"both": {"exponent_low": 2.02, "exponent_high": 3.99},
                                         "by_sigma": {str(i): 0.1 * i for i in range(9)}},
             "setting": {"m": 64, "sigma_range": [0.01, 10.0], "note": "a long note"}},
            {"id": "x", "paper": "P", "statement": "undecided", "holds": None,
             "measured": {"auc": 0.51, "auc_ci": [0.48, 0.54], "angles": list(range(9))},
             "setting": {}},
        ],
    }  # fmt: skip
    return claims


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from fl.run.engine import train
    from fl.testing import tiny_config

    tmp = tmp_path_factory.mktemp("browser")
    run = tmp / "dp-run"
    cfg = tiny_config(rounds=1, dp_level="sample", noise_multiplier=2.0, canaries=20)
    train(cfg, run, quiet=True)
    rc = main(["attack", str(run), "--attacks", "loss", "--device", "cpu", "--bootstrap", "20"])
    assert rc == 0
    claims = _analyses(tmp / "analysis")
    out = tmp / "report"
    s = build_report([str(run)], str(out), analyses_dir=str(tmp / "analysis"), claims=claims)
    return s, out


def test_verdict_first_and_no_raw_dicts(report):
    s, out = report
    page, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    assert s["missing"] == []
    for text in (page, md):
        assert "{'" not in text and '{"' not in text
    # the first section is the verdict table: one row per run, its verdict in the last cell
    assert re.findall(r"<h2>(.*?)</h2>", page) == list(SECTIONS)
    head = md.split("\n## ")[1]
    assert head.startswith("Verdict\n")
    (row,) = [x for x in head.splitlines() if x.startswith("| dp-run |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    eps = s["runs"][0]["epsilon_recomputed"]
    assert cells[3] == f"{eps:.4g}"
    assert cells[-1] == s["runs"][0]["verdict"]
    assert cells[-1].startswith("private as claimed (ε = ")
    # the certified bound is the canaries' one-run audit, never the attacks' CP estimates
    assert re.fullmatch(
        r"\[[\d.]+, ∞\) at 95% \(Steinke [\d.]+, f-DP [\d.]+; each at 95%\) · 20 canaries, one run",
        cells[4],
    ), cells[4]
    # input canaries: no conformance tests (they need the privatized sums), so no implied ε;
    # a run trained outside fedlora run has no neighbour replay
    assert cells[5] == "–" and cells[6] == "not run" and cells[7] == "–"
    assert re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\] · loss(_class)?", cells[8])  # AUC, interval
    # analyses: a summary, not the rows; claims: readable, with a verdict each
    assert "| both | 2 | 4 |" in md and "Full rows (20) in " in md and "| 0.01 |" not in md
    assert "| FedASK: noise ∝ σ² | m 64; sigma range [0.01, 10] |" in md
    assert "both exponent low 2.02, exponent high 3.99; by sigma 9 values, 0 to 0.8" in md
    assert "auc 0.51; auc ci [0.48, 0.54]; angles 0 to 8 (9 values) | inconclusive | – |" in md
    assert "amplification (Noise analyses)" in md and "a long note" not in md
    # the verdict table, then the privacy figure; one round: no per-round figure
    assert set(s["figures"]) == {"privacy", "roc dp-run"}
    assert head.index("| dp-run |") < head.index("![privacy claimed, recomputed and measured")
    assert "Evaluated at one round only, so no per-round curve: dp-run (round 1);" in md
    # the ROC curves: drawn by the report, on log–log axes
    assert "![ROC dp-run (log–log)](figures/dp-run-roc.png)" in md


def test_renders_in_headless_chromium(report, chromium, tmp_path):
    _, out = report
    page = (out / "report.html").read_text()
    # a copy of the page with a script that writes what the browser saw into the DOM
    check = """<script>window.addEventListener('load', () => {
      const imgs = [...document.images].map(i => ({alt: i.alt, width: i.naturalWidth}));
      const empty = [...document.querySelectorAll('section')].filter(s => ![...s.children]
          .slice(1).some(c => c.textContent.trim() || c.tagName === 'IMG' || c.querySelector('img')))
        .map(s => s.firstElementChild.textContent);
      const pre = document.createElement('pre'); pre.id = 'browser-check';
      pre.textContent = JSON.stringify({imgs, empty, sections: document.querySelectorAll('section').length});
      document.body.appendChild(pre);
    });</script></body>"""
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", check))
    p = _headless(chromium, tmp_path / "p1", "--virtual-time-budget=10000", "--dump-dom",
                  f"file://{probe}")  # fmt: skip
    m = re.search(r'<pre id="browser-check">(.*?)</pre>', p.stdout, re.S)
    assert m, f"no check in Chromium's DOM (rc {p.returncode}): {p.stderr[-500:]}"
    seen = json.loads(html.unescape(m.group(1)))
    assert len(seen["imgs"]) == page.count("<img") >= 4  # privacy, analysis, ROC, claims
    assert [i for i in seen["imgs"] if i["width"] <= 0] == []
    assert seen["empty"] == []
    assert seen["sections"] >= len(SECTIONS)
    # the first screen, as a PNG
    shot = tmp_path / "first-screen.png"
    p = _headless(chromium, tmp_path / "p2", "--window-size=1280,900", f"--screenshot={shot}",
                  f"file://{out / 'report.html'}")  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p.stderr[-500:]


#: a laptop's and a phone's CSS width (an iPhone 12 to 15: 390 px)
WIDTHS = {"laptop": (1366, 900), "phone": (390, 844)}
#: what the page reports from inside the browser: its width against the viewport's, the
#: elements that stick out of it (outside the tables' own scroll containers), the tables
#: wider than their container (``cut``: a reader would scroll them sideways), the images'
#: widths, and how the verdict table is laid out (cards on a phone)
_LAYOUT_PROBE = """<script>window.addEventListener('load', () => {
  const W = document.documentElement.clientWidth;
  const out = [...document.body.querySelectorAll('*')]
    .filter(e => e.getBoundingClientRect().right > W + 1 && !e.closest('.scroll, pre'))
    .slice(0, 8).map(e => e.tagName + ' ' + e.textContent.slice(0, 50));
  const imgs = [...document.images].map(i => [i.naturalWidth, i.getBoundingClientRect().width]);
  const t = document.querySelector('table.stack');
  const cut = [...document.querySelectorAll('.scroll')]
    .filter(s => s.scrollWidth > s.clientWidth + 1)
    .map(s => s.querySelector('th, td').textContent + ': ' + s.scrollWidth + ' > ' + s.clientWidth);
  const res = {W, scroll: document.documentElement.scrollWidth, out, imgs, cut,
               thead: t && getComputedStyle(t.tHead).display, row: t && t.rows[1].offsetWidth};
  parent.postMessage(JSON.stringify(res), '*');
});</script></body>"""


def _layout(chromium, page: str, width: int, height: int, tmp_path, shot):
    """The page at ``width`` CSS px: an iframe that wide (Chromium's headless window is
    500 px at the least), the probe's findings posted to the frame page, which writes them
    into its own DOM (what --dump-dom prints); and a screenshot to ``shot``."""
    probe = tmp_path / f"probe-{width}.html"
    probe.write_text(page.replace("</body>", _LAYOUT_PROBE))
    frame = tmp_path / f"frame-{width}.html"
    frame.write_text(
        "<!DOCTYPE html><html><body style='margin:0'>"
        f"<iframe src='{probe.name}' style='border:0;width:{width}px;height:{height}px'></iframe>"
        "<script>addEventListener('message', e => { const p = document.createElement('pre');"
        "p.id = 'layout'; p.textContent = e.data; document.body.appendChild(p); });</script>"
        "</body></html>"
    )
    window = f"--window-size={max(width, 500)},{height}"
    p = _headless(chromium, tmp_path / f"p-{width}", window, "--hide-scrollbars",
                  "--virtual-time-budget=10000", "--dump-dom", f"file://{frame}")  # fmt: skip
    m = re.search(r'<pre id="layout">(.*?)</pre>', p.stdout, re.S)
    assert m, f"no layout from Chromium (rc {p.returncode}): {p.stderr[-500:]}"
    _headless(chromium, tmp_path / f"s-{width}", window, "--hide-scrollbars",
              "--virtual-time-budget=10000", f"--screenshot={shot}", f"file://{frame}")  # fmt: skip
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.parametrize("device", list(WIDTHS))
def test_no_sideways_scrolling_at_laptop_and_phone_width(report, chromium, tmp_path, device):
    from PIL import Image

    _, out = report
    width, height = WIDTHS[device]
    page = (out / "report.html").read_text()
    shot = tmp_path / f"{device}.png"
    seen = _layout(chromium, page, width, height, tmp_path, shot)
    # the page is as wide as the viewport: nothing sticks out (wide tables scroll inside
    # their own container on a laptop, become cards on a phone)
    assert seen["W"] == width and seen["scroll"] <= seen["W"], seen
    assert seen["out"] == [], seen["out"]
    if device == "laptop":  # every table whole at 1366 px: no column cut off
        assert seen["cut"] == [], seen["cut"]
    assert seen["imgs"] and all(0 < w <= seen["W"] for _, w in seen["imgs"]), seen["imgs"]
    if device == "phone":  # the verdict table as cards: no header row, a row as wide as the page
        assert seen["thead"] == "none" and seen["row"] <= seen["W"]
    else:
        assert seen["thead"] == "table-header-group"
    # the screenshot: the page was drawn (text and figures, not a blank window)
    im = Image.open(shot).convert("L").crop((0, 0, width, height))
    assert im.size == (width, height)
    dark = np.asarray(im) < 128
    assert dark.mean() > 0.01, "blank screenshot"
