"""The utility claims decided from grid rows: intervals, pairing, verdicts, files."""

from __future__ import annotations

import json
import math
from statistics import fmean

import pytest

from analysis import stats as S
from analysis import utility_claims as U
from analysis import utility_figures as UF
from fl.errors import UsageError

# Student-t 0.975 quantiles (tables): df = 1, 2, 4
T975 = {1: 12.7062047, 2: 4.30265273, 4: 2.77644511}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_matches_tables(df):
    assert S.t_quantile(df) == pytest.approx(T975[df], abs=1e-6)


def test_mean_ci_closed_form():
    vals = [0.80, 0.82, 0.84]
    out = S.mean_ci(vals)
    m = sum(vals) / 3
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / 2)
    half = T975[2] * sd / math.sqrt(3)
    assert out["n"] == 3
    assert out["mean"] == pytest.approx(0.82)
    assert out["std"] == pytest.approx(0.02)
    assert out["ci"] == pytest.approx([m - half, m + half])
    assert S.mean_ci([0.5])["ci"] == [None, None]
    assert S.mean_ci([])["mean"] is None
    assert S.mean_ci([float("nan"), 0.7])["n"] == 1


def _row(grid, group, seed, bal, acc=None, **kw):
    tag = group.split("/")[-1]
    return {
        "epsilon": float(tag[3:]) if tag.startswith("eps") else None,
        "sigma": 1.0 if tag.startswith("eps") else 0.0,
        "grid": grid,
        "group": group,
        "seed": seed,
        "balanced_accuracy": bal,
        "accuracy": bal if acc is None else acc,
        "seconds": 10.0,
        "key": f"{grid}|{group}|{seed}",
        **kw,
    }


def test_paired_uses_common_seeds_only():
    rows = [_row("g", "a/eps8", s, 0.8 + 0.01 * s) for s in (0, 1, 2, 3)]
    rows += [_row("g", "b/eps8", s, 0.7 + 0.02 * s) for s in (1, 2, 3)]
    t = U.cells(rows)
    d = S.paired(t[("g", "a/eps8")], t[("g", "b/eps8")])
    assert d["pairs"] == [1, 2, 3]
    diffs = [(0.8 + 0.01 * s) - (0.7 + 0.02 * s) for s in (1, 2, 3)]
    assert d["mean"] == pytest.approx(sum(diffs) / 3)


def test_pairing_removes_seed_variance():
    """A is better by exactly 0.02 on every seed although seeds vary by ±0.1:
    the unpaired intervals overlap, the paired one does not."""
    rows = []
    for s, base in enumerate((0.6, 0.8, 0.7)):
        rows += [_row("g", "a/eps3", s, base + 0.02), _row("g", "b/eps3", s, base)]
    t = U.cells(rows)
    assert t[("g", "a/eps3")]["ci"][0] < t[("g", "b/eps3")]["ci"][1]
    d = S.paired(t[("g", "a/eps3")], t[("g", "b/eps3")])
    assert d["ci"][0] == pytest.approx(0.02) and d["ci"][1] == pytest.approx(0.02)
    assert S.verdict_better(d) is True


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ([0.03, 0.04, 0.05], True),  # interval above 0
        ([-0.03, -0.04, -0.05], False),  # below 0
        ([0.001, 0.002, 0.003], False),  # [-0.0005, 0.0045]: under the 0.01 margin
        ([-0.05, 0.0, 0.08], None),  # wide
        ([0.03, 0.04], None),  # fewer than 3 pairs
    ],
)
def test_verdicts(diffs, expected):
    d = S.mean_ci(diffs)
    assert S.verdict_better(d) is expected, (diffs, d["ci"])


def test_verdict_margin():
    # tight around +0.002: lower end below 0, upper below the margin -> does not hold
    d = {"n": 3, "mean": 0.002, "ci": [-0.001, 0.005]}
    assert S.verdict_better(d) is False
    d = {"n": 3, "mean": 0.01, "ci": [-0.001, 0.021]}
    assert S.verdict_better(d) is None
    assert S.verdict_word(None) == "inconclusive"


def _fedask_rows():
    rows = []
    for s in range(3):
        for eps, shift in (("eps1", 0.0), ("eps8", 0.05)):
            rows += [
                _row("claims-fedask", f"fedask-w/{eps}", s, 0.70 + shift + 0.001 * s),
                _row("claims-fedask", f"fedask-b/{eps}", s, 0.60 + shift + 0.002 * s),
                _row("claims-fedask", f"ffa/{eps}", s, 0.65 + shift + 0.001 * s),
                _row("claims-fedask", f"fedavg/{eps}", s, 0.65 + shift + 0.01 * (s - 1)),
                _row("claims-fedask", f"probe/{eps}", s, 0.68 + shift),
            ]
    return rows


def test_fedask_claims_verdicts(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    rows = _fedask_rows()
    rows.append({"grid": "claims-fedask", "group": "ffa/eps1", "error": "boom", "key": "x"})
    (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    doc = U.decide([d])
    by = {c["id"]: c for c in doc["claims"]}
    assert by["fedask_beats_ffa:w:eps1"]["verdict"] == "holds"
    assert by["fedask_beats_ffa:b:eps8"]["verdict"] == "does not hold"
    assert by["ffa_beats_fedavg:eps8"]["verdict"] == "inconclusive"
    assert by["fedask-w_beats_probe:eps1"]["holds"] is True
    assert by["ffa_beats_probe:eps1"]["holds"] is False
    cell = next(c for c in doc["cells"] if c["group"] == "ffa/eps1")
    assert cell["n"] == 3  # the error row is ignored
    md = UF.table_md(doc)
    assert "fedask_beats_ffa:w:eps1 | holds" in md
    figs = UF.plot(doc, tmp_path / "fig")
    assert figs and (tmp_path / "fig" / "claims_utility.png").stat().st_size > 1000


def test_hetero_and_mia_claims(tmp_path):
    rows = []
    for s in range(3):
        for m, v in (("plora", 0.8), ("flora", 0.7), ("flexlora", 0.8), ("hetlora", 0.81)):
            rows.append(_row("claims-hetero", f"{m}/dirichlet0.1/eps8", s, v + 0.001 * s))
        atk = {"loss": {"auc": 0.51, "ci": {"auc": [0.48, 0.53 + 0.005 * s]}}}
        rows.append(_row("claims-fedask", "fedavg/eps8", s, 0.8, attacks=atk))
        bad = {"loss": {"auc": 0.7, "ci": {"auc": [0.65, 0.75]}}}
        rows.append(_row("claims-fedask", "fedavg/nodp", s, 0.8, attacks=bad))
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    doc = U.decide([p])
    by = {c["id"]: c for c in doc["claims"]}
    assert by["plora_beats_flora:dirichlet0.1:eps8"]["verdict"] == "holds"
    assert by["plora_beats_hetlora:dirichlet0.1:eps8"]["verdict"] == "does not hold"
    assert by["mia_near_chance:loss:fedask:fedavg/eps8"]["verdict"] == "holds"
    assert not any(k.endswith("fedavg/nodp") for k in by)  # non-private runs are not claimed


def test_bad_input(tmp_path):
    with pytest.raises(UsageError, match="no results.jsonl"):
        U.decide([tmp_path])
    p = tmp_path / "results.jsonl"
    p.write_text('{"grid": "g"\n')
    with pytest.raises(UsageError, match="not JSON"):
        U.decide([tmp_path])
    p.write_text(json.dumps({"grid": "g", "group": "a/eps1", "error": "x"}) + "\n")
    with pytest.raises(UsageError, match="no finished run"):
        U.decide([tmp_path])


def test_a_folder_of_grids_is_read_grid_by_grid(tmp_path):
    """``--grids benchmarks/results/claims`` (the folder of the committed grids) reads
    each subfolder's results.jsonl (and mia.jsonl); a stray file such as a README named
    as a grid is refused by name."""
    for name, shift in (("a", 0.0), ("b", 0.1)):
        d = tmp_path / "claims" / name
        d.mkdir(parents=True)
        rows = [_row("claims-fedask", "ffa/eps8", s, 0.7 + shift) for s in range(3)]
        for r in rows:
            r["key"] = f"{name}{r['seed']}"
        (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "claims" / "README.md").write_text("# not a grid\n")
    both = U.load_rows([tmp_path / "claims"])
    assert sorted(r["key"] for r in both) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert both == U.load_rows([tmp_path / "claims" / "a", tmp_path / "claims" / "b"])
    with pytest.raises(UsageError, match="README.md: not a results.jsonl file"):
        U.load_rows([tmp_path / "claims" / "a", tmp_path / "claims" / "README.md"])


def test_claims_cli_with_grids(tmp_path):
    """`fedlora analyze claims --grids DIR` adds the utility claims, their cells and the
    accuracy-vs-ε figure; the report's claims section shows both."""
    import contextlib
    import io

    from audit.report.analyses import claims_section
    from pipeline.cli import main

    g = tmp_path / "grid"
    g.mkdir()
    (g / "results.jsonl").write_text("\n".join(json.dumps(r) for r in _fedask_rows()) + "\n")
    out = tmp_path / "claims"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["analyze", "claims", "--grids", str(g), "--out", str(out), "--json"])
    assert rc == 0
    doc = json.loads(buf.getvalue())
    ids = {c["id"]: c for c in doc["claims"]}
    assert ids["fedask_beats_ffa:w:eps1"]["verdict"] == "holds"
    assert "fedask_exact" in ids  # the synthetic claims are still there
    assert len(doc["utility"]["cells"]) == 10
    assert (out / "claims_utility.png").is_file()
    figdir = tmp_path / "fig"
    figdir.mkdir()
    sec = claims_section(doc, str(tmp_path), figdir)
    assert (figdir / "claims-utility.png").is_file()
    text = repr(sec.blocks)
    assert "fedask-w/eps1" in text and "accuracy vs ε (below)" in text
    # a comparison's row shows both of its cells, not one and "… 1 more"
    table = sec.blocks[0]
    row = next(r for r in table.rows if "FedASK" in str(r[0]) and "clip space w" in str(r[0]))
    measured = str(row[table.headers.index("measured")])
    assert "fedask-w/eps" in measured and "ffa/eps" in measured and "more" not in measured


def test_mia_rows_merge_into_their_runs(tmp_path):
    rows = [_row("claims-fedask", "ffa/eps8", s, 0.8) for s in range(3)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    mia = [
        {
            "grid": r["grid"],
            "group": r["group"],
            "seed": r["seed"],
            "key": r["key"],
            "seconds": 1.5,
            "attacks": {"loss": {"auc": 0.5, "ci": {"auc": [0.47, 0.53]}}},
        }
        for r in rows
    ]
    (tmp_path / "mia.jsonl").write_text("\n".join(json.dumps(r) for r in mia))
    doc = U.decide([tmp_path])
    cell = next(c for c in doc["cells"] if c["group"] == "ffa/eps8")
    assert cell["n"] == 3 and cell["balanced_mean"] == pytest.approx(0.8)
    # the attack's wall time is its own: s/run stays the training's
    assert cell["seconds_mean"] == pytest.approx(fmean(r["seconds"] for r in rows))
    merged = [r for r in U.load_rows([tmp_path]) if r["group"] == "ffa/eps8"]
    assert {r["attack_seconds"] for r in merged} == {1.5}
    by = {c["id"]: c for c in doc["claims"]}
    assert by["mia_near_chance:loss:fedask:ffa/eps8"]["verdict"] == "holds"


def test_two_configurations_of_one_cell_are_an_error(tmp_path):
    """A grid re-run under a changed setting leaves two rows for one (group, seed): the
    analysis must not pick one by row order."""
    old = _row("claims-fedask", "ffa/eps8", 0, 0.80)
    new = {**_row("claims-fedask", "ffa/eps8", 0, 0.83), "key": old["key"] + "-lr3e-3"}
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new))
    with pytest.raises(UsageError, match="ffa/eps8 seed 0: two runs"):
        U.decide([tmp_path])


def test_mia_claims_name_their_grid_and_show_the_runs_intervals(tmp_path):
    """The same group in two grids is two claims; the verdict's inputs (each run's own
    bootstrap interval) are what the claim shows, not only the spread over seeds."""
    rows = []
    for s in range(3):
        ok = {"loss": {"auc": 0.51, "ci": {"auc": [0.47, 0.53 + 0.005 * s]}}}
        wide = {"loss": {"auc": 0.52, "ci": {"auc": [0.46, 0.58]}}}
        rows.append(_row("claims-fedask", "ffa/eps8", s, 0.8, attacks=ok))
        rows.append(_row("claims-bbc", "ffa/eps8", s, 0.9, attacks=wide))
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    doc = U.decide([tmp_path])
    by = {c["id"]: c for c in doc["claims"]}
    home, bbc = by["mia_near_chance:loss:fedask:ffa/eps8"], by["mia_near_chance:loss:bbc:ffa/eps8"]
    assert (home["verdict"], bbc["verdict"]) == ("holds", "inconclusive")
    assert home["measured"]["largest_run_auc_upper"] == pytest.approx(0.54)
    assert home["measured"]["smallest_run_auc_lower"] == pytest.approx(0.47)
    assert home["measured"]["seeds"] == 3 and "claims-bbc" in bbc["statement"]
    md = UF.table_md(doc)
    assert "| mia_near_chance:loss:bbc:ffa/eps8 | inconclusive | 0.460 – 0.580 | 0.520 | 3 |" in md


def test_mia_counts_seeds_of_runs_that_exist_and_only_private_ones(tmp_path):
    """An attack row whose run was moved out of results.jsonl is not an attacked seed;
    non-private runs (here the attacks grid's "overfit" group) carry no DP claim."""
    atk = {"loss": {"auc": 0.5, "ci": {"auc": [0.47, 0.53]}}}
    rows = [_row("claims-fedask", "ffa/eps8", s, 0.8) for s in range(2)]
    rows += [_row("attacks", "fedavg/overfit", s, 0.9) for s in range(3)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    orphan = {**rows[0], "key": "moved-out", "seconds": 2.0, "attacks": atk}
    mia = [{**r, "attacks": atk, "seconds": 2.0} for r in rows] + [orphan]
    (tmp_path / "mia.jsonl").write_text("\n".join(json.dumps(r) for r in mia))
    doc = U.decide([tmp_path])
    by = {c["id"]: c for c in doc["claims"]}
    assert by["mia_near_chance:loss:fedask:ffa/eps8"]["verdict"] == "inconclusive"
    assert by["mia_near_chance:loss:fedask:ffa/eps8"]["measured"]["seeds"] == 2
    assert not any("overfit" in k for k in by)
    assert all(c["seconds_mean"] == pytest.approx(10.0) for c in doc["cells"])


def test_pairs_count_only_finite_differences():
    rows = [_row("g", "a/eps8", s, 0.8 + 0.01 * s) for s in range(4)]
    rows += [_row("g", "b/eps8", s, math.nan if s == 0 else 0.7) for s in range(4)]
    t = U.cells(rows)
    d = S.paired(t[("g", "a/eps8")], t[("g", "b/eps8")])
    assert d["pairs"] == [1, 2, 3] and d["n"] == 3


def test_mia_needs_three_attacked_runs(tmp_path):
    atk = {"loss": {"auc": 0.5, "ci": {"auc": [0.47, 0.53]}}}
    rows = [_row("claims-fedask", "ffa/eps8", s, 0.8, attacks=atk) for s in range(2)]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    by = {c["id"]: c for c in U.decide([tmp_path])["claims"]}
    assert by["mia_near_chance:loss:fedask:ffa/eps8"]["verdict"] == "inconclusive"


def test_bbc_grid_holds_both_comparisons_and_fedpower_claims(tmp_path):
    """claims-bbc mixes FedASK groups (method/privacy) and hetero groups
    (method/partition/privacy): each family is decided under ids prefixed ``bbc:``.
    claims-fedpower: FedPower against FFA / FedAvg and PowerDP against input / output."""
    rows = []
    for s in range(3):
        rows += [
            _row("claims-bbc", "fedask-w/eps8", s, 0.90 + 0.001 * s),
            _row("claims-bbc", "ffa/eps8", s, 0.85 + 0.001 * s),
            _row("claims-bbc", "plora/iid/eps8", s, 0.80 + 0.002 * s),
            _row("claims-bbc", "flora/iid/eps8", s, 0.80 + 0.001 * s - 0.02),
            _row("claims-fedpower", "fedpower/eps6", s, 0.75 + 0.001 * s),
            _row("claims-fedpower", "ffa/eps6", s, 0.80 + 0.001 * s),
            _row(
                "claims-fedpower", "fedpower-input/eps6", s, 0.75 + 0.001 * s + (0.03, -0.03, 0)[s]
            ),
        ]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    by = {c["id"]: c for c in U.decide([tmp_path])["claims"]}
    assert by["bbc:fedask_beats_ffa:w:eps8"]["verdict"] == "holds"
    assert by["bbc:plora_beats_flora:iid:eps8"]["verdict"] == "holds"
    assert "fedask_beats_ffa:w:eps8" not in by  # claims-fedask did not run
    assert by["fedpower_beats_ffa:eps6"]["verdict"] == "does not hold"
    assert by["powerdp_beats_input:eps6"]["verdict"] == "inconclusive"
    assert by["powerdp_beats_input:eps6"]["setting"]["level"] == "client"
    assert "powerdp_beats_output:eps6" not in by  # no output-perturbation cell ran


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ([0.0, 0.001, 0.002], True),  # [-0.0015, 0.0035]: above -0.01
        ([-0.02, -0.03, -0.025], False),  # [-0.037, -0.013]: more than a point behind
        ([-0.004, -0.008, -0.006], None),  # [-0.011, -0.001]: behind, but not refuted
        ([-0.03, 0.0, 0.02], None),  # wide
        ([0.05, 0.06], None),  # fewer than 3 pairs
    ],
)
def test_verdict_reaches(diffs, expected):
    d = S.mean_ci(diffs)
    assert S.verdict_reaches(d) is expected, (diffs, d["ci"])


def test_recipe_claims_pair_each_candidate_with_the_probe(tmp_path):
    probe = U.DPLEARN_PROBE
    rows = []
    for s in range(3):
        rows += [
            _row("dplearn", f"{probe}/eps8", s, 0.80 + 0.02 * s),
            _row("dplearn", "lora1-a/eps8", s, 0.83 + 0.02 * s + 0.001 * s),  # +0.03
            _row("dplearn", "lora1-b/eps8", s, 0.80 + 0.02 * s - 0.001 * (s - 1)),  # ~0
            _row("dplearn", "lora1-a/eps3", s, 0.75),  # no probe at ε = 3: no claim
            _row("dplearn", "probe-cos/eps8", s, 0.9),  # another probe: not a recipe
        ]
    d = tmp_path / "g"
    d.mkdir()
    (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    by = {c["id"]: c for c in U.decide([d])["claims"] if c["id"].startswith("recipe_")}
    assert set(by) == {
        f"recipe_{v}_probe:lora1-{x}:eps8" for v in ("beats", "reaches") for x in "ab"
    }
    assert by["recipe_beats_probe:lora1-a:eps8"]["verdict"] == "holds"
    assert by["recipe_beats_probe:lora1-a:eps8"]["measured"]["diff_mean"] == pytest.approx(0.031)
    assert by["recipe_beats_probe:lora1-b:eps8"]["verdict"] == "does not hold"
    assert by["recipe_reaches_probe:lora1-b:eps8"]["verdict"] == "holds"


def test_recipe_claims_of_another_scale_pair_within_their_own_grid(tmp_path):
    """dplearn-m21k holds the same candidates at 21 000 members: its recipe is compared
    with its own probe (never the 10 000-member one), under ids that name the grid."""
    probe = U.DPLEARN_PROBE
    rows = []
    for s in range(3):
        rows += [
            _row("dplearn", f"{probe}/eps8", s, 0.90),  # would make m21k's recipe lose
            _row("dplearn", "lora1-a/eps8", s, 0.80 + 0.001 * s),
            _row("dplearn-m21k", f"{probe}/eps8", s, 0.80 + 0.02 * s),
            _row("dplearn-m21k", "lora1-a/eps8", s, 0.83 + 0.02 * s + 0.001 * s),  # +0.031
        ]
    d = tmp_path / "g"
    d.mkdir()
    (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    by = {c["id"]: c for c in U.decide([d])["claims"] if "recipe_" in c["id"]}
    assert set(by) == {
        f"{pre}recipe_{v}_probe:lora1-a:eps8" for v in ("beats", "reaches") for pre in ("", "m21k:")
    }
    m = by["m21k:recipe_beats_probe:lora1-a:eps8"]
    assert m["verdict"] == "holds" and m["setting"]["grid"] == "dplearn-m21k"
    assert m["measured"]["diff_mean"] == pytest.approx(0.031)
    assert by["recipe_beats_probe:lora1-a:eps8"]["verdict"] == "does not hold"


def test_plot_leaves_out_methods_measured_on_one_seed(tmp_path, monkeypatch):
    """A candidate tried on one seed has no interval: the figure draws only the methods
    with a cell of at least two seeds (the non-private one-seed point of a method that
    has them stays)."""
    from analysis import figures

    rows = [_row("dplearn", f"{U.DPLEARN_PROBE}/eps8", s, 0.8 + 0.01 * s) for s in range(3)]
    rows += [_row("dplearn", "lora1-once/eps8", 0, 0.81)]
    rows += [_row("dplearn", f"{U.DPLEARN_PROBE}/nodp", 0, 0.85)]
    d = tmp_path / "g"
    d.mkdir()
    (d / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    drawn = []
    real = figures.save_figure

    def spy(fig, out, name):
        for ax in fig.axes:
            drawn.extend(t.get_text() for t in ax.get_legend().get_texts())
            drawn.append(len(ax.containers[0].lines[0].get_xdata()))
        return real(fig, out, name)

    monkeypatch.setattr(figures, "save_figure", spy)
    doc = U.decide([d])  # a non-private probe row is no recipe claim (and no crash)
    assert {c["id"] for c in doc["claims"] if c["id"].startswith("recipe_")} == {
        f"recipe_{v}_probe:lora1-once:eps8" for v in ("beats", "reaches")
    }
    assert UF.plot(doc, tmp_path / "fig")
    assert drawn == [U.DPLEARN_PROBE, 2]  # the probe's ε = 8 and no-DP points
    only_once = [_row("dplearn", "lora1-once/eps8", 0, 0.81)]
    (d / "results.jsonl").write_text(json.dumps(only_once[0]) + "\n")
    assert UF.plot(U.decide([d]), tmp_path / "fig2") is None
