"""Measurement grids: job lists, recipe choice, summaries, and one real resumable call."""

import json

import pytest

from benchmarks.grids import jobs as J
from benchmarks.grids import runner as G

# The fields passed as --base to the real call (values from the shared tiny_cfg fixture).
BASE_FIELDS = (
    "model",
    "dataset",
    "members",
    "nonmembers",
    "test",
    "max_length",
    "clients",
    "rounds",
    "local_steps",
    "batch_size",
    "lr",
    "rank",
    "alpha",
)


def test_grid_sizes_and_unique_keys():
    base = dict(J.RECIPE)
    seeds = [0, 1, 2]
    sizes = {g: len(f(base, seeds)) for g, f in J.GRIDS.items()}
    # 4 privacy settings x 3 methods x 3 seeds; 3 ε x 3 methods x 3 seeds + 2 x 3 + 3;
    # 2 privacy x 2 partitions x 5 methods x 3 seeds; 4 attack targets; 8 recipes x 2.
    # dplearn: 3 ε x 12 candidates x 3 seeds; dplearn-m21k 3 ε x 2 x 3. The claims grids (benchmarks.grids.claims):
    # tune 13 lrs; fedask 3 ε x 5 variants x 3 seeds + 4 non-private; hetero 2 privacy x
    # 3 partitions x 4 methods x 3 seeds; fedpower (3 x 3 + 2) x 3 and its tuning 5 clips x
    # 3 methods; bbc 5 x 3 + 72.
    assert sizes == {
        "fedask": 36,
        "fedpower": 36,
        "hetero": 60,
        "attacks": 4,
        "recipe": 16,
        "dplearn": 108,
        "dplearn-m21k": 18,
        "claims-tune": 13,
        "claims-fedask": 49,
        "claims-hetero": 72,
        "claims-fedpower-tune": 15,
        "claims-fedpower": 33,
        "claims-bbc": 87,
    }
    keys = [G.job_key(j) for f in J.GRIDS.values() for j in f(base, seeds)]
    assert len(keys) == len(set(keys))


def test_grid_configs_are_valid_train_configs():
    from fl.methods import registry
    from fl.run.config import TrainConfig

    methods = set()
    for f in J.GRIDS.values():
        for job in f(dict(J.RECIPE), [0]):
            cfg = TrainConfig(**job["cfg"]).validate()  # raises on an unknown or bad field
            assert cfg.method in registry.names()
            assert (cfg.dp_level == "none") == (cfg.epsilon == 0)  # DP jobs name their ε
            methods.add(cfg.method)
    assert {"fedask", "fedpower", "plora", "flora", "flexlora", "hetlora"} <= methods


def test_hetero_uses_the_smallest_rank_for_fedavg():
    jobs = J.jobs_hetero(dict(J.RECIPE), [0])
    fedavg = [j["cfg"] for j in jobs if j["cfg"]["method"] == "fedavg"]
    others = [j["cfg"] for j in jobs if j["cfg"]["method"] != "fedavg"]
    assert {c["rank"] for c in fedavg} == {4}
    assert {(c["rank"], c["client_ranks"]) for c in others} == {(16, "4,8,16")}


def test_best_recipe_needs_both_methods_and_takes_the_best_mean():
    rows = [
        {"grid": "recipe", "group": "m10k-b64-s10-adamw5e-3/fedavg", "accuracy": 0.9},
        {"grid": "recipe", "group": "m10k-b64-s10-adamw2e-2/fedavg", "accuracy": 0.8},
        {"grid": "recipe", "group": "m10k-b64-s10-adamw2e-2/ffa", "accuracy": 0.78},
        {"grid": "recipe", "group": "m10k-b64-s10-sgd2/fedavg", "accuracy": 0.7},
        {"grid": "recipe", "group": "m10k-b64-s10-sgd2/ffa", "accuracy": 0.75},
    ]
    name, over = J.best_recipe(rows)
    assert name == "m10k-b64-s10-adamw2e-2"  # mean 0.79 > 0.725; 0.9 has no ffa run
    assert over == J.RECIPE_CANDIDATES[name]
    with pytest.raises(RuntimeError, match="no recipe candidate"):
        J.best_recipe(rows[:1])


def test_best_dplearn_chooses_on_the_nonmember_pool_not_the_test_set():
    rows = [
        {"grid": "dplearn", "group": "lora2-b256-s10-r5/eps8", "val_balanced_accuracy": 0.80,
         "balanced_accuracy": 0.70},
        {"grid": "dplearn", "group": "lora2-b256-s10-r5/eps8", "val_balanced_accuracy": 0.78,
         "balanced_accuracy": 0.70},
        {"grid": "dplearn", "group": "lora2-b512-s10-r8/eps8", "val_balanced_accuracy": 0.77,
         "balanced_accuracy": 0.95},
        {"grid": "dplearn", "group": "probe-b500-s20-r10-lr5e-2/eps8",
         "val_balanced_accuracy": 0.81},
        {"grid": "dplearn", "group": "lora2-b512-s10-r8/eps1", "val_balanced_accuracy": 0.7},
        {"grid": "fedask", "group": "lora2-b256-s10-r5/eps1", "val_balanced_accuracy": 0.99},
    ]  # fmt: skip
    assert J.best_dplearn(rows) == {
        ("lora2", "eps8"): "lora2-b256-s10-r5",  # mean 0.79 > 0.77, whatever the test set says
        ("probe", "eps8"): "probe-b500-s20-r10-lr5e-2",
        ("lora2", "eps1"): "lora2-b512-s10-r8",
    }


def test_summary_mean_and_std():
    rows = [
        {"grid": "x", "group": "a", "accuracy": 0.5, "seconds": 1.0},
        {"grid": "x", "group": "a", "accuracy": 0.7, "seconds": 3.0},
        {"grid": "x", "group": "b", "error": "boom"},
    ]
    md = G.summarize(rows)
    assert "| a | 2 | 0.6000 ± 0.1414 |" in md
    assert "| b |" not in md


def test_real_call_then_resume_skips_finished_jobs(tmp_path, monkeypatch, tiny_cfg):
    def two_jobs(base, seeds, overrides=None):
        return [
            {"grid": "t", "group": f"fedavg/s{s}", "cfg": {**base, "method": "fedavg", "seed": s}}
            for s in seeds
        ]

    monkeypatch.setitem(J.GRIDS, "recipe", two_jobs)  # the parent builds the job list
    tiny = tiny_cfg(members=120, nonmembers=30, test=40, clients=2, rounds=1, local_steps=1)
    base = [f"{k}={getattr(tiny, k)}" for k in BASE_FIELDS]
    argv = ["recipe", "--out", str(tmp_path), "--workers", "1", "--seeds", "0,1", "--base", *base]
    assert G.main([*argv, "--only", "s1"]) == 0  # one job of two
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["group"] for r in rows] == ["fedavg/s1"]
    assert G.main(argv) == 0  # the other one; s1 is not run again
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["group"] for r in rows) == ["fedavg/s0", "fedavg/s1"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["epsilon"] is None for r in rows)
    man = json.loads((tmp_path / "runs" / rows[0]["run"] / "manifest.json").read_text())
    assert man["config"]["members"] == 120
    assert G.main(argv) == 0  # nothing left to do: no new rows
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    assert "fedavg/s0" in (tmp_path / "summary.md").read_text()


def test_fedpower_grid_takes_base_overrides_over_its_client_level_setup():
    jobs = J.jobs_fedpower(dict(J.RECIPE), [0])
    assert {j["cfg"]["clients"] for j in jobs} == {J.CLIENT_LEVEL["clients"]}
    assert {j["cfg"]["members"] for j in jobs} == {J.CLIENT_LEVEL["members"]}
    over = {"clients": 5000, "members": 80000}
    jobs = J.jobs_fedpower({**J.RECIPE, **over}, [0], overrides=over)
    assert {(j["cfg"]["clients"], j["cfg"]["members"]) for j in jobs} == {(5000, 80000)}
    assert {j["cfg"]["rounds"] for j in jobs} == {J.CLIENT_LEVEL["rounds"]}
