"""The Ray path of fl.distributed.run_tasks, against the sequential one: a failing task
is reported and retried without losing the others; the grid runner and the shadow models
give the same results on Ray as in this process. Ray starts once, for this module."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fl import distributed


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    distributed.ensure_ray("local")
    yield
    ray.shutdown()


def test_failures_are_reported_retried_and_do_not_lose_the_others(ray_local, tmp_path):
    flaky_mark = tmp_path / "flaky-failed-once"

    def task(x):  # a local function: Ray pickles it by value
        if x == 2 and not flaky_mark.exists():
            flaky_mark.touch()
            raise RuntimeError("flaky")
        if x == 3:
            raise ValueError("always")
        return x * x

    for address in ("local", "none"):
        flaky_mark.unlink(missing_ok=True)
        said = []
        outs = list(
            distributed.run_tasks(
                task, [0, 1, 2, 3, 4], workers=2, address=address, retries=1, report=said.append
            )
        )
        by = {o.index: o for o in outs}
        assert sorted(by) == [0, 1, 2, 3, 4]
        assert {i: by[i].value for i in (0, 1, 2, 4)} == {0: 0, 1: 1, 2: 4, 4: 16}
        assert by[2].ok and by[2].attempts == 2  # failed once, then ran again
        assert by[3].error == "ValueError: always" and by[3].attempts == 2
        assert not by[3].ok and by[3].value is None
        failures = [m for m in said if "failed (attempt" in m]
        assert sum("task 2 failed (attempt 1/2): RuntimeError: flaky" in m for m in failures) == 1
        assert sum("task 3 failed" in m for m in failures) == 2, address


def test_deadline_skips_tasks_not_started(ray_local):
    outs = list(distributed.run_tasks(abs, [-1, -2], workers=2, deadline=0.0))
    assert [(o.index, o.skipped, o.value) for o in outs] == [
        (0, "deadline", None),
        (1, "deadline", None),
    ]


_VOLATILE = {"seconds", "round_seconds", "worker", "attempts"}


def _rows(path):
    rows = [json.loads(x) for x in (path / "results.jsonl").read_text().splitlines()]
    return sorted(
        ({k: v for k, v in r.items() if k not in _VOLATILE} for r in rows),
        key=lambda r: r["index"],
    )


def test_grid_on_ray_gives_the_sequential_rows(ray_local, tmp_path, monkeypatch, tiny_cfg):
    from benchmarks.grids import jobs as J
    from benchmarks.grids import runner as G

    def jobs(base, seeds, overrides=None):
        return [
            {"grid": "t", "group": f"{m}/s{s}", "cfg": {**base, "method": m, "seed": s}}
            for s in seeds
            for m in ("fedavg", "ffa")
        ]

    monkeypatch.setitem(J.GRIDS, "recipe", jobs)
    tiny = tiny_cfg(members=80, nonmembers=20, test=30, clients=2, rounds=1, local_steps=2)
    fields = ("model", "dataset", "members", "nonmembers", "test", "max_length", "clients")
    fields += ("rounds", "local_steps", "batch_size", "lr", "rank", "alpha", "head_init")
    base = [f"{k}={getattr(tiny, k)}" for k in fields]
    argv = ["recipe", "--seeds", "0,1", "--base", *base]
    assert G.main([*argv, "--out", str(tmp_path / "seq"), "--workers", "1"]) == 0
    assert G.main([*argv, "--out", str(tmp_path / "ray"), "--workers", "2"]) == 0
    seq, ray_rows = _rows(tmp_path / "seq"), _rows(tmp_path / "ray")
    assert len(seq) == 4 and all("error" not in r for r in seq)
    assert ray_rows == seq  # accuracy, balanced accuracy, ε, σ, keys: identical


def test_shadows_on_ray_equal_the_sequential_shadows(ray_local, tmp_path, monkeypatch, tiny_cfg):
    from attacks.reference import train_shadows
    from fl.data.datasets import make_synthetic

    monkeypatch.setattr(distributed, "usable_cpus", lambda: 2)  # 1 torch thread per task
    cfg = tiny_cfg(members=30, nonmembers=0, test=20, clients=2, rounds=1, local_steps=2)
    cfg = type(cfg).from_dict({**cfg.to_dict(), "lora_layers": 1})
    ds = make_synthetic()
    n = 40
    args = (cfg, ds.ids[:n], ds.texts[:n], np.asarray(ds.labels[:n]), 2)
    kw = dict(seed=1, device="cpu", progress=False, num_labels=ds.num_classes)
    seq = train_shadows(*args, tmp_path / "seq", workers=1, ray_address="none", **kw)
    par = train_shadows(*args, tmp_path / "ray", workers=2, ray_address="local", **kw)
    assert par.reused == [False, False]
    for a_dir, b_dir in zip(seq.adapter_dirs, par.adapter_dirs):
        a = load_file(str(a_dir / "adapter_model.safetensors"))
        b = load_file(str(b_dir / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a)


def _niceness(_):
    import os

    return os.getpriority(os.PRIO_PROCESS, 0)


def test_ray_workers_get_the_drivers_priority(ray_local):
    """Ray starts its workers at niceness 15; the tasks run at the driver's (where the
    process may lower a niceness, as root can), else at Ray's."""
    import os

    driver = os.getpriority(os.PRIO_PROCESS, 0)
    outs = list(distributed.run_tasks(_niceness, [0, 1], workers=2, address="local"))
    got = {o.value for o in outs}
    if os.geteuid() == 0:
        assert got == {driver}
    else:
        assert got <= {driver, 15}


def test_match_driver_priority_in_process(monkeypatch):
    import os

    monkeypatch.delenv(distributed.NICENESS_ENV, raising=False)
    assert distributed.match_driver_priority() is False  # not a Ray worker: nothing to match
    monkeypatch.setenv(distributed.NICENESS_ENV, str(os.getpriority(os.PRIO_PROCESS, 0)))
    assert distributed.match_driver_priority() is True


def test_main_job_trains_its_runs_at_once_on_ray(ray_local, tmp_path, monkeypatch):
    """A preset with train_workers > 1 trains its runs as Ray tasks: every run directory
    is complete, the job's status holds each manifest's accuracy and ε, in RUNS order."""
    from pipeline import job

    base = dict(job.PRESETS["quick"].base) | dict(
        members=80, nonmembers=20, test=30, clients=2, rounds=1, local_steps=2
    )
    monkeypatch.setitem(
        job.PRESETS,
        "quick",
        job.Preset(base=base, attacks=("loss",), attack_runs=(), canaries=5, train_workers=2),
    )
    # ε = 1 rather than the job's 8: the same calibration, four times cheaper (σ ≈ 4.4
    # instead of 0.8 for q = 0.8 and two steps: 0.5 s instead of 1.9 s of PLD)
    runs = (
        ("fedavg-nodp", "fedavg", dict()),
        ("fedavg-eps1", "fedavg", dict(dp_level="sample", epsilon=1.0)),
    )
    monkeypatch.setattr(job, "RUNS", runs)
    monkeypatch.setattr(job, "ANALYSES", ())
    st = job.run_job("quick", str(tmp_path / "job"), seed=0, progress=False)
    assert st["errors"] == [], st["errors"]
    assert list(st["runs"]) == ["fedavg-nodp", "fedavg-eps1"]
    for name, _, _ in runs:
        m = json.loads((tmp_path / "job" / "runs" / name / "manifest.json").read_text())
        got = dict(st["runs"][name])
        replay = got.pop("replay", None)  # a DP run is replayed on neighbours in its task
        assert got == {
            "accuracy": m["metrics"]["final"]["accuracy"],
            "epsilon": m["privacy"]["epsilon"]["pld"],
        }
        assert (replay is None) == (name == "fedavg-nodp")
        assert replay is None or replay.startswith("pass (1 neighbour × ")
    assert st["runs"]["fedavg-eps1"]["epsilon"] <= 1.0
    assert st["runs"]["fedavg-nodp"]["epsilon"] is None
