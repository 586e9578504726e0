"""The main job end to end on the quick preset: every report section exists and the
numbers in the report are the numbers in the run files."""

import json
import math
import re

import pytest

from audit.report.build import CHANCE_BALANCED, SECTIONS
from pipeline.job import PRESETS, run_job


@pytest.mark.timeout(900)
def test_quick_preset_end_to_end(tmp_path):
    out = tmp_path / "job"
    st = run_job("quick", str(out), seed=0, progress=False)
    assert st["errors"] == [], st["errors"]
    assert st["missing_sections"] == []
    html = (out / "report" / "report.html").read_text()
    md = (out / "report" / "report.md").read_text()
    for sec in SECTIONS:
        assert f"<h2>{sec}</h2>" in html
        assert f"## {sec}" in md
    # figures are embedded in the single HTML file
    assert html.count("data:image/png;base64,") >= 5
    runs = sorted((out / "runs").iterdir())
    assert {r.name for r in runs} >= {"fedavg-nodp", "fedavg-eps8", "ffa-eps8"}
    for r in runs:
        m = json.loads((r / "manifest.json").read_text())
        acc = m["metrics"]["final"]["accuracy"]
        eps = m["privacy"]["epsilon"]["pld"]
        # the report opens with the verdict table: ε claimed and recomputed, a verdict
        verdict_md = md.split("\n## Verdict\n")[1].split("\n## ")[0]
        vrow = next(x for x in verdict_md.splitlines() if x.startswith(f"| {r.name} |"))
        vcells = [c.strip() for c in vrow.strip("|").split("|")]
        if eps is None:
            assert vcells[2] == "no DP" and vcells[-1].startswith("no DP claimed")
        else:
            assert float(vcells[2]) == pytest.approx(eps, rel=1e-3)
            assert float(vcells[3]) == pytest.approx(eps, rel=1e-3)
            assert vcells[-1].startswith("private as claimed (ε = ")
            # every DP run carries gradient canaries: a certified, non-vacuous one-run bound
            # (Steinke et al. and f-DP side by side), below the claim
            lb = re.match(
                r"\[([0-9.]+), ∞\) at 95% \(Steinke ([0-9.]+), f-DP ([0-9.]+);", vcells[4]
            )
            assert lb, vcells[4]
            assert "gradient canaries, one run" in vcells[4]
            assert 0 < float(lb.group(1)) <= eps and float(lb.group(2)) > 0
            assert f"empirical ε ≥ {lb.group(1)} at 95%" in vcells[-1]
            # the conformance tests pass on a correct run (column 5)
            assert vcells[5].startswith("pass ("), vcells[5]
            # the job replays every DP run on a neighbour (column 6: within the bound)
            assert re.fullmatch(
                r"pass \(1 neighbour × \d+ releases, largest ‖Δq‖/bound (0\.\d+|1\.000)\)",
                vcells[6],
            ), vcells[6]
            # the noise-implied ε is the ledger's with σ times the smallest upper confidence
            # bound on the observed noise factor, capped at 1: never below the ledger's, and
            # above it only where a bound falls under 1, which a correct run shows with
            # probability at most 5 % (the bounds' joint level; each DP run draws fresh
            # noise keys, so over five runs this is not rare: it was 8.02 for 7.99 once)
            implied = float(vcells[7].removeprefix("≥ "))
            assert eps * (1 - 1e-3) <= implied <= 1.25 * eps, vcells[7]
        # the Runs table row of this run shows the manifest's numbers
        runs_md = md.split("\n## Runs\n")[1]
        row = next(line for line in runs_md.splitlines() if line.startswith(f"| {r.name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[8]) == pytest.approx(acc, abs=5e-4)
        if eps is None:
            assert cells[5] == "—"
        else:
            assert float(cells[5]) == pytest.approx(eps, rel=1e-3)
            assert float(cells[6]) == pytest.approx(eps, rel=1e-3)  # recomputed by the audit
            assert cells[7] == "False"  # not understated
            assert eps <= 8.0
        assert st["runs"][r.name]["accuracy"] == acc
    # the chance-level note names exactly the runs at chance balanced accuracy
    para = next((x for x in md.splitlines() if x.startswith("**Chance-level runs.**")), "")
    for r in runs:
        bal = json.loads((r / "manifest.json").read_text())["metrics"]["final"].get(
            "balanced_accuracy"
        )
        assert (f"{r.name} (" in para) == (bal is not None and bal <= CHANCE_BALANCED)
    # the non-private run learned the synthetic task
    assert st["runs"]["fedavg-nodp"]["accuracy"] > 0.75
    # attacks ran and their AUCs in the report come from attacks.json
    att = json.loads((out / "runs" / "fedavg-nodp" / "attacks" / "attacks.json").read_text())
    auc = att["attacks"]["loss"]["auc"]
    assert re.search(rf"\| loss \| {re.escape(f'{auc:.4g}')} \|", md)
    assert all(0.0 <= v <= 1.0 for v in st["attacks"]["fedavg-nodp"].values())
    # its two shadow models were trained in the trainings' pool and reused by the attack
    assert att["shadows"]["k"] == 2 and att["shadows"]["trained_now"] == 0
    assert all(s > 0 for s in att["shadows"]["train_seconds_each"])
    # the claims check and analyses are present
    claims = json.loads((out / "analysis" / "claims" / "claims.json").read_text())
    assert len(claims["claims"]) >= 6
    for c in claims["claims"]:
        assert c["statement"] in md
    assert all(v == "ok" for v in st["analyses"].values())
    assert math.isfinite(st["seconds"])
    # the job's log (pipeline.progress): each run's rounds, each with its time, before
    # the run's end; then the later stages
    log = [x.split(" ", 1)[1] for x in (out / "job.log").read_text().splitlines()]
    for r in runs:
        rounds = [i for i, x in enumerate(log) if x.startswith(f"[{r.name}] round ")]
        assert [log[i].split(" · ")[0] for i in rounds] == [
            f"[{r.name}] round {k}/2" for k in (1, 2)
        ]
        assert re.search(r" · [0-9.]+ s/round · ~\d+ (s|min) left", log[rounds[0]]), log[rounds[0]]
        done = next(i for i, x in enumerate(log) if x.startswith(f"[{r.name}] done in "))
        assert rounds[-1] < done
    assert log.index("writing the report") > done
    ahead = [x for x in log if x.startswith("[shadows] fedavg-nodp shadow ")]
    assert [x.split(" trained in ")[0] for x in ahead] == [
        f"[shadows] fedavg-nodp shadow {j}/2" for j in (1, 2)
    ], ahead
    assert log.index(ahead[-1]) < log.index("attacking fedavg-nodp: loss, calibration, rmia")


def test_presets_configurations():
    """The presets' training set-ups (the README's ~15 minutes on 2 CPU cores for the
    default one rests on these, whatever TrainConfig's defaults become)."""
    from fl.run.config import TrainConfig

    d = TrainConfig(**PRESETS["default"].base)
    assert (d.model, d.dataset, d.members, d.nonmembers, d.test, d.max_length) == (
        "minilm", "tweets", 2000, 500, 500, 48
    )  # fmt: skip
    assert (d.clients, d.rounds, d.eval_every, d.local_steps, d.batch_size) == (5, 3, 3, 6, 128)
    assert (d.lr, d.head_lr, d.lora_layers, d.rank, d.alpha) == (1e-3, 3e-2, 1, 8, 16.0)
    assert (d.pooling, d.head_init) == ("auto", "zero")
    # no dropout: each DP run is its own reference in the neighbour replay (one pass)
    assert d.dropout == TrainConfig(**PRESETS["quick"].base).dropout == "off"
    q = TrainConfig(**PRESETS["quick"].base)
    assert (q.model, q.dataset, q.members, q.rounds, q.local_steps, q.lr) == (
        "tiny-bert", "synthetic", 300, 2, 20, 0.03
    )  # fmt: skip
    assert (q.clients, q.batch_size, q.rank, q.alpha, q.max_length) == (3, 32, 4, 8.0, 24)
    assert (q.head_init, q.head_lr, q.lora_layers) == ("random", 0.0, 0)
    assert PRESETS["quick"].canaries == 500 and PRESETS["default"].canaries == 5000
    assert PRESETS["default"].shadows == 2 and "lira" not in PRESETS["default"].attacks
