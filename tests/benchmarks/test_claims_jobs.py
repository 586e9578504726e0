"""The claims grids' jobs: what each holds, their order, the tuned learning rates."""

from __future__ import annotations

import pytest

from benchmarks.grids import claims as C
from benchmarks.grids import jobs as J
from fl.run.config import TrainConfig


@pytest.fixture
def lrs(monkeypatch):
    table = {"fedask-w": 1e-3, "fedask-b": 3e-3, "ffa": 1e-2, "fedavg": 1e-3, "probe": 0.1}
    monkeypatch.setattr(C, "CLAIMS_LR", table)
    return table


def test_registered_with_the_runner():
    for name in C.GRIDS:
        assert J.GRIDS[name] is C.GRIDS[name]


def test_fedask_grid(lrs):
    jobs = C.jobs_fedask({}, [0, 1, 2])
    groups = {}
    for j in jobs:
        groups.setdefault(j["group"], []).append(j["cfg"]["seed"])
        TrainConfig(**j["cfg"])  # every job is a valid configuration
    for name in C.FEDASK_VARIANTS:
        for eps in ("eps1", "eps3", "eps8"):
            assert groups[f"{name}/{eps}"] == [0, 1, 2]
    assert groups["fedavg/nodp"] == [0] and "probe/nodp" not in groups
    seeds = [j["cfg"]["seed"] for j in jobs]
    assert seeds == sorted(seeds)  # seed-major: a worker's next job reuses the cache
    by = {(j["group"], j["cfg"]["seed"]): j["cfg"] for j in jobs}
    assert by[("fedask-b/eps3", 1)]["opts"] == {"clip_space": "b"}
    assert by[("fedask-b/eps3", 1)]["lr"] == 3e-3
    assert by[("probe/eps1", 0)]["lr"] == 0.1 and by[("probe/eps1", 0)]["head_lr"] == 0.0
    assert by[("ffa/eps8", 2)]["epsilon"] == 8.0
    assert by[("ffa/eps8", 2)]["dp_level"] == "sample"


def test_lr_must_be_tuned_first(monkeypatch):
    monkeypatch.setattr(C, "CLAIMS_LR", {})
    with pytest.raises(KeyError, match="claims-tune"):
        C.jobs_fedask({}, [0])


def test_tune_and_best_lrs():
    jobs = C.jobs_tune({}, [0, 1, 2])
    assert {j["cfg"]["seed"] for j in jobs} == {C.TUNE_SEED}  # never an evaluation seed
    assert {j["cfg"]["epsilon"] for j in jobs} == {C.TUNE_EPSILON}
    assert len(jobs) == sum(len(v) for v in C.TUNE_LRS.values())
    rows = [
        {"grid": "claims-tune", "group": "ffa/lr0.001", "val_balanced_accuracy": 0.70},
        {"grid": "claims-tune", "group": "ffa/lr0.01", "val_balanced_accuracy": 0.75},
        {"grid": "claims-tune", "group": "fedavg/lr0.001", "val_balanced_accuracy": 0.74},
        {"grid": "claims-tune", "group": "fedavg/lr0.003", "val_balanced_accuracy": None},
        {"grid": "other", "group": "fedavg/lr0.003", "val_balanced_accuracy": 0.99},
    ]
    assert C.best_lrs(rows) == {"ffa": 0.01, "fedavg": 0.001}


def test_other_claims_grids(lrs):
    het = C.jobs_hetero({}, [0, 1, 2])
    assert len(het) == 2 * 3 * 3 * 4
    assert het[0]["cfg"]["epsilon"] == 8.0  # the private cells first
    d01 = next(j for j in het if j["group"] == "plora/dirichlet0.1/eps8")["cfg"]
    assert d01["partition"] == "dirichlet" and d01["dirichlet_alpha"] == 0.1
    assert d01["client_ranks"] == "4,8,16" and d01["lr"] == lrs["fedavg"]
    fp = C.jobs_fedpower({}, [0])
    assert {j["group"] for j in fp} >= {"fedpower/eps3", "ffa/eps9", "fedpower-output/eps6"}
    for j in fp:
        cfg = TrainConfig(**j["cfg"])
        assert cfg.dp_level == "client" and cfg.clients >= 1000
    tune = C.jobs_fedpower_tune({}, [0, 1])
    assert {j["cfg"]["clip"] for j in tune} == set(C.TUNE_CLIPS)
    assert {j["cfg"]["seed"] for j in tune} == {C.TUNE_SEED}  # not an evaluation seed
    assert {j["cfg"]["epsilon"] for j in tune} == {6.0}
    rows = [
        {"grid": "claims-fedpower-tune", "group": "ffa/clip0.3", "val_balanced_accuracy": 0.6},
        {"grid": "claims-fedpower-tune", "group": "ffa/clip3", "val_balanced_accuracy": 0.7},
        {"grid": "claims-fedpower-tune", "group": "ffa/clip1", "val_balanced_accuracy": 0.7},
        {"grid": "claims-fedpower-tune", "group": "fedavg/clip1", "val_balanced_accuracy": None},
        {"grid": "claims-fedpower", "group": "fedavg/clip3", "val_balanced_accuracy": 0.9},
    ]
    assert C.best_clips(rows) == {"ffa": 1.0}  # a tie goes to the smaller bound
    bbc = C.jobs_bbc({}, [0])
    assert {j["grid"] for j in bbc} == {"claims-bbc"}
    assert all(j["cfg"]["dataset"] == "bbc" for j in bbc)


def test_claims_mia_attacks_a_grid_run(tmp_path):
    """benchmarks.grids.claims_mia attacks the selected runs of a grid folder once (resumable)
    and its rows give the analysis its membership-inference claim."""
    import json

    from analysis import utility_claims as U
    from benchmarks.grids import claims_mia
    from fl.run.engine import train
    from fl.testing import tiny_config

    root = tmp_path / "grid"
    run = root / "runs" / "claims-fedask-0000"
    cfg = dict(members=16, nonmembers=8, test=8, max_length=16, clients=1, rounds=1)
    # σ 3 given, not ε 8 calibrated (its PLDs): the rows, not the run, say "eps8", and nothing
    # checked (the selection, the attacks' rows, the resume) depends on σ
    cfg.update(batch_size=8, lr=0.02, dp_level="sample", noise_multiplier=3.0)
    train(tiny_config(**cfg), run, quiet=True)
    rows = [
        {"grid": "claims-fedask", "group": "ffa/eps8", "seed": s, "key": f"k{s}",
         "run": "claims-fedask-0000", "balanced_accuracy": 0.5, "accuracy": 0.5, "seconds": 1,
         "epsilon": 8.0, "sigma": 1.0}
        for s in range(3)
    ]  # fmt: skip
    rows.append({**rows[0], "group": "ffa/eps1", "key": "k9", "epsilon": 1.0})
    (root / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert claims_mia.main([str(root)]) == 0
    mia = [json.loads(x) for x in (root / "mia.jsonl").read_text().splitlines()]
    assert [m["key"] for m in mia] == ["k0", "k1", "k2"]  # eps8 only
    auc = mia[0]["attacks"]["loss"]["auc"]
    assert 0.0 <= auc <= 1.0 and len(mia[0]["attacks"]["loss"]["ci"]["auc"]) == 2
    assert set(mia[0]["attacks"]) == {"loss", "loss_class"}
    before = (root / "mia.jsonl").read_text()
    assert claims_mia.main([str(root)]) == 0  # resumed: nothing attacked twice
    assert (root / "mia.jsonl").read_text() == before
    # a row from before the loss family gained loss_class is attacked again and replaced
    mia[1]["attacks"].pop("loss_class")
    mia[1]["seconds"] = -1.0
    (root / "mia.jsonl").write_text("".join(json.dumps(m) + "\n" for m in mia))
    assert claims_mia.main([str(root)]) == 0
    again = [json.loads(x) for x in (root / "mia.jsonl").read_text().splitlines()]
    assert [m["key"] for m in again] == ["k0", "k1", "k2"]
    assert again[0] == mia[0] and again[2] == mia[2] and again[1]["seconds"] >= 0
    assert set(again[1]["attacks"]) == {"loss", "loss_class"}
    assert again[1]["attacks"]["loss"]["auc"] == mia[1]["attacks"]["loss"]["auc"]
    with pytest.raises(SystemExit) as exc:  # argparse: one line, exit code 2
        claims_mia.main([str(root), "--attacks", "bogus"])
    assert exc.value.code == 2
    assert (root / "mia.jsonl").read_text() == "".join(json.dumps(m) + "\n" for m in again)
    claims = {c["id"] for c in U.decide([root])["claims"]}
    assert "mia_near_chance:loss:fedask:ffa/eps8" in claims
