"""Crash-anywhere resume, locks, hostile client updates."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from fl.errors import UsageError
from fl.io import RunLock
from fl.run.engine import Engine, train
from fl.testing import tiny_flags

TINY = tiny_flags(rounds=4, local_steps=3, dp_level="sample", noise_multiplier=1.1)


def _cli(args, **kw):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **kw,
    )


def _adapter(d):
    return load_file(str(d / "adapter" / "adapter_model.safetensors"))


@pytest.mark.timeout(900)
def test_sigkill_at_random_points_then_resume_equals_uninterrupted(tmp_path):
    """SIGKILL the trainer at random moments (several times per run); every --resume
    completes; the final adapter and ε equal an uninterrupted run's."""
    ref = tmp_path / "ref"
    p = _cli(["train", *TINY, "--out", str(ref)])
    t0 = time.time()
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    full_time = time.time() - t0
    ref_m = json.loads((ref / "manifest.json").read_text())

    rng = random.Random(int(os.environ.get("FEDLORA_KILL_SEED", "7")))
    # two kills by default (each costs a CLI start); FEDLORA_KILLS=10 for a longer soak
    kills = int(os.environ.get("FEDLORA_KILLS", "2"))
    run = tmp_path / "killed"
    # The key holder's replay: the killed run uses the reference run's noise key.
    first = ["train", *TINY, "--out", str(run), "--noise-key", str(ref / "private/noise.key")]
    p = _cli(first)
    done_kills = 0
    for _attempt in range(kills + 10):
        delay = rng.uniform(0.3, max(0.6, full_time * 0.8))
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            done_kills += 1
            # a killed run is never mistaken for a finished one
            assert not (run / "manifest.json").exists() or json.loads(
                (run / "manifest.json").read_text()
            )
        else:
            if p.returncode == 0 and (run / "manifest.json").exists():
                break
            raise AssertionError(p.stderr.read().decode())
        # killed before config.json existed: the directory is not a run yet, start again
        args = ["train", "--resume", str(run), "--no-progress"]
        if not (run / "config.json").exists():
            args = first
        if done_kills >= kills:
            p = _cli(args)
            assert p.wait(timeout=300) == 0, p.stderr.read().decode()
            break
        p = _cli(args)
    assert done_kills >= 1
    m = json.loads((run / "manifest.json").read_text())
    a, b = _adapter(ref), _adapter(run)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert m["privacy"]["epsilon"]["pld"] == pytest.approx(
        ref_m["privacy"]["epsilon"]["pld"], rel=1e-12
    )
    assert len(m["privacy"]["ledger"]["events"]) == len(ref_m["privacy"]["ledger"]["events"])
    rounds = [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 4]


def test_second_process_on_same_run_dir_refuses(tmp_path, tiny_cfg):
    out = tmp_path / "r"
    out.mkdir()
    with RunLock(out):
        eng = Engine(tiny_cfg(), out, resume=True, quiet=True)
        with pytest.raises(UsageError, match="in use"):
            eng.run()


def test_unwritable_output_is_a_clear_error_before_training(tmp_path, tiny_cfg):
    if os.geteuid() == 0:
        # root ignores permission bits: use a path under a regular file instead
        f = tmp_path / "file"
        f.write_text("x")
        with pytest.raises(UsageError, match="cannot create output directory"):
            train(tiny_cfg(), f / "sub")
    else:  # pragma: no cover
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(UsageError, match="writable"):
            train(tiny_cfg(), ro)


@pytest.mark.parametrize("poison", ["nan", "inf", "shape"])
def test_poisoned_client_update_is_rejected_and_round_goes_on(tmp_path, tiny_cfg, poison):
    from fl.methods.fedavg import FedAvg

    orig = FedAvg.on_train

    def evil(self, client, payload):
        out = orig(self, client, payload)
        if client.id == "1":
            k = next(iter(out["state"]["factors"]))
            if poison == "shape":
                out["state"]["factors"][k]["A"] = torch.zeros(1, 1)
            else:
                out["state"]["factors"][k]["B"][0, 0] = float(poison)
        return out

    FedAvg.on_train = evil
    try:
        m = train(tiny_cfg(dp_level="sample", noise_multiplier=1.0, rounds=2), tmp_path / "r")
    finally:
        FedAvg.on_train = orig
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rejected_updates"] == 1 for r in rows)
    ad = _adapter(tmp_path / "r")
    assert all(bool(torch.isfinite(v).all()) for v in ad.values())
    # the rejected client's DP steps are still in the ledger: 3 clients × 2 rounds
    assert len(m["privacy"]["ledger"]["events"]) == 6
    assert "rejected the update of client 1" in (tmp_path / "r" / "run.log").read_text()


def test_enormous_update_is_reported_for_non_dp_methods(tmp_path, tiny_cfg):
    from fl.methods.fedavg import FedAvg

    orig = FedAvg.on_train

    def huge(self, client, payload):
        out = orig(self, client, payload)
        if client.id == "2":
            for ab in out["state"]["factors"].values():
                ab["B"] = ab["B"] + 1e3
        return out

    FedAvg.on_train = huge
    try:
        train(tiny_cfg(rounds=1), tmp_path / "r")
    finally:
        FedAvg.on_train = orig
    row = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["outlier_updates"] == ["2"]
    assert row["update_norm_max"] > 100 * row["update_norm_median"]
    assert "more than 10x the median" in (tmp_path / "r" / "run.log").read_text()
