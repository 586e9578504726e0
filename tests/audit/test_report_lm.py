"""The report's optional sections: a causal-LM run's perplexities and the client-level
attack appear (with their numbers and figures) when a run has them, and not otherwise."""

import json
import re

import pytest
import torch

from audit.report.build import SECTIONS, build_report
from audit.report.lm import CLIENT_TITLE, LM_TITLE
from pipeline.cli import main


@pytest.fixture(scope="module")
def lm_report(tmp_path_factory):
    from fl.run.engine import train
    from fl.testing import tiny_config

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lmreport")
    run = tmp / "lm-run"
    cfg = tiny_config(model="tiny-gpt2", task="causal-lm", members=24, nonmembers=24, test=8,
                      clients=3, rounds=1, max_length=16, min_client_size=4)  # fmt: skip
    train(cfg, run, quiet=True)
    rc = main(["attack", str(run), "--attacks", "loss,lm", "--client-level", "--device", "cpu",
               "--bootstrap", "10"])  # fmt: skip
    assert rc == 0
    s = build_report([str(run)], str(tmp / "report"))
    return s, tmp / "report", run


def test_lm_and_client_sections(lm_report):
    s, out, run = lm_report
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    heads = re.findall(r"<h2>(.*?)</h2>", page)
    assert heads == s["sections"]
    assert [h for h in heads if h in SECTIONS] == list(SECTIONS)
    i = heads.index("Membership inference")
    assert heads[i + 1 : i + 3] == [LM_TITLE, CLIENT_TITLE]
    # the perplexities in the table are attacks.json's
    att = json.loads((run / "attacks" / "attacks.json").read_text())
    lm_md = md.split(f"\n## {LM_TITLE}\n")[1].split("\n## ")[0]
    row = next(x for x in lm_md.splitlines() if x.startswith("| lm-run |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ppl = att["lm"]["perplexity"]
    assert cells[6:8] == [f"{ppl['test']['base']:.4g}", f"{ppl['test']['adapter']:.4g}"]
    assert cells[8:12] == [f"{ppl[r][w]:.4g}" for r in ("member", "nonmember")
                           for w in ("base", "adapter")]  # fmt: skip
    assert "random-init base" in lm_md and "lm_perplexity.png" in lm_md
    # the client level: one row per example-level attack, AUC with its interval
    cl = json.loads((run / "attacks" / "clients.json").read_text())
    cl_md = md.split(f"\n## {CLIENT_TITLE}\n")[1].split("\n## ")[0]
    for name, a in cl["attacks"].items():
        r = next(x for x in cl_md.splitlines() if x.startswith(f"| {name} |"))
        lo, hi = a["ci"]["auc"]
        assert f"{a['auc']:.3g} [{lo:.3g}, {hi:.3g}]" in r
    assert "lm-run-roc_clients.png" in cl_md and "lm-run-client_hist.png" in cl_md
    # the client figures are not repeated among the example-level ROC figures
    mi = md.split("\n## Membership inference\n")[1].split("\n## ")[0]
    assert "roc_clients" not in mi and "lm-run-roc.png" in mi
    # 24 non-members: 0.1% FPR is no false positive at all, and the page says so
    assert "With 24 non-members, 0.1% FPR is less than one false positive" in mi
    assert page.count("<img") == md.count("![")


def test_report_on_a_non_run_writes_nothing(tmp_path):
    """A directory that is not a run is refused before the output folder is made."""
    from fl.errors import UsageError

    (tmp_path / "notarun").mkdir()
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="no manifest.json"):
        build_report([str(tmp_path / "notarun")], str(out))
    assert not out.exists()
