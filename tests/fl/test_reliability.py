"""Crash-anywhere resume, locks, hostile client updates."""

import json
import multiprocessing as mp
import os
import random
import time

import pytest
import torch
from safetensors.torch import load_file

from fl.errors import UsageError
from fl.io import RunLock
from fl.run.engine import Engine, train
from fl.testing import tiny_flags

ROUNDS = 3
# σ = 3 rather than about 1: a resume replays the same draws whatever σ is, and each
# round's PLD ε costs a trainer 0.12 s instead of 0.45 s (σ = 1.1, q = 0.2)
TINY = tiny_flags(rounds=ROUNDS, local_steps=3, dp_level="sample", noise_multiplier=3.0)


#: what a `fedlora train` process imports before it trains (imports only, no torch op,
#: so a process forked from one that holds them is a fresh trainer minus the import time)
PRELOAD = [
    "pipeline.cli",
    "fl.run.engine",
    "fl.methods",
    "transformers.models.bert.modeling_bert",
    "transformers.models.bert.tokenization_bert",
    "peft",
    "opacus",
]


@pytest.fixture
def fedlora_cli():
    """Start ``fedlora train ARGS`` (``pipeline.cli.main``) in a process of its own,
    forked from a server that has done the imports once (multiprocessing's forkserver):
    each start costs no Python start-up and imports (3-4 s each, most of a trainer's
    life before). The process is SIGKILLed like any other; the server stops after the
    test."""
    from multiprocessing import forkserver

    from pipeline.cli import main

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    procs = []

    def start(args):
        p = ctx.Process(target=main, args=(list(args),))
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    stop = getattr(forkserver._forkserver, "_stop", None)  # else it ends with this process
    if stop is not None:
        stop()


def _adapter(d):
    return load_file(str(d / "adapter" / "adapter_model.safetensors"))


def _state(run) -> str:
    """Where a killed run stood: its files (config, checkpoints, the round journal)."""
    if not (run / "config.json").exists():
        return "no config.json"
    ck = sorted(p.name for p in (run / "checkpoint").glob("meta-*.json"))
    inflight = (run / "checkpoint" / "inflight.json").exists()
    done = (run / "manifest.json").exists()
    return f"checkpoints {ck}, round in flight: {inflight}, manifest: {done}"


def _rounds_done(run) -> int:
    f = run / "metrics.jsonl"  # a round's row is written just before its checkpoint
    return len(f.read_text().splitlines()) if f.exists() else 0


@pytest.mark.timeout(900)
def test_sigkill_at_random_points_then_resume_equals_uninterrupted(tmp_path, fedlora_cli):
    """SIGKILL the trainer at random moments (several times per run); every --resume
    completes; the final adapter and ε equal an uninterrupted run's.

    Kill i falls at a random moment of about a round's length after round i's row
    (its checkpoint follows) appeared: a process with its imports done is inside
    round i + 1 then (its journal in flight) or writing round i's checkpoint, so each
    resume loads a checkpoint a round further on and replays a journaled round, where a
    kill at a random moment of a whole CLI process mostly fell in its imports (nothing
    to resume). Main's exit code is not the process's: a run that did not finish is
    seen by its missing manifest."""
    ref = tmp_path / "ref"
    p = fedlora_cli(["train", *TINY, "--out", str(ref)])
    t0 = time.time()
    p.join(timeout=300)
    round_time = (time.time() - t0) / ROUNDS
    assert p.exitcode == 0 and (ref / "manifest.json").exists()
    ref_m = json.loads((ref / "manifest.json").read_text())

    rng = random.Random(int(os.environ.get("FEDLORA_KILL_SEED", "7")))
    # two kills by default; FEDLORA_KILLS=10 for a longer soak (kills past the last
    # round fall in it or in the run's end)
    kills = int(os.environ.get("FEDLORA_KILLS", "2"))
    run = tmp_path / "killed"
    # The key holder's replay: the killed run uses the reference run's noise key.
    p = fedlora_cli(
        ["train", *TINY, "--out", str(run), "--noise-key", str(ref / "private/noise.key")]
    )
    done_kills = 0
    for i in range(1, kills + 1):
        deadline = time.time() + 300
        while p.is_alive() and _rounds_done(run) < min(i, ROUNDS - 1):
            assert time.time() < deadline, "no progress"
            p.join(timeout=0.02)
        p.join(timeout=rng.uniform(0.0, round_time))
        if not p.is_alive():  # finished before the kill
            break
        p.kill()
        p.join()
        done_kills += 1
        print(f"kill {i}: {_state(run)}")
        # a killed run is never mistaken for a finished one
        assert not (run / "manifest.json").exists() or json.loads(
            (run / "manifest.json").read_text()
        )
        p = fedlora_cli(["train", "--resume", str(run), "--no-progress"])
    p.join(timeout=300)
    assert p.exitcode == 0 and (run / "manifest.json").exists(), p.exitcode
    assert done_kills >= 1
    m = json.loads((run / "manifest.json").read_text())
    a, b = _adapter(ref), _adapter(run)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert m["privacy"]["epsilon"]["pld"] == pytest.approx(
        ref_m["privacy"]["epsilon"]["pld"], rel=1e-12
    )
    assert len(m["privacy"]["ledger"]["events"]) == len(ref_m["privacy"]["ledger"]["events"])
    rounds = [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(1, ROUNDS + 1))


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
