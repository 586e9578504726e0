"""Resume, kills and STOP: a resumed run equals an uninterrupted one; a round killed in flight
is replayed bit for bit or re-run with fresh noise and charged; RUN/STOP stops at a round
boundary; a corrupt checkpoint is a clear error. The rest of the engine: test_engine.py."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fl.run.engine import Engine, train
from fl.testing import tiny_config, tiny_flags
from pipeline.cli import main as cli_main

#: the run the tests below stop, kill and resume (the first test has its own: a cohort).
#: σ = 3 rather than about 1: what is replayed, charged or re-drawn does not depend on σ,
#: and each round's PLD ε costs 0.12 s instead of 0.4 s (σ = 1.2, q = 0.2)
SIGMA = 3.0
CFG = dict(rounds=3, dp_level="sample", noise_multiplier=SIGMA)


def _adapter(run):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_resume_equals_uninterrupted_and_keeps_budget(tmp_path, tiny_cfg):
    cfg = tiny_cfg(rounds=3, dp_level="sample", noise_multiplier=SIGMA, clients_per_round=2)
    full = train(cfg, tmp_path / "full")

    # The key holder replays: a second run given the first run's key.
    eng = Engine(
        cfg, tmp_path / "killed", quiet=True, noise_key=tmp_path / "full/private/noise.key"
    )
    orig = eng._save_checkpoint

    def crash_after_round_two(completed):
        orig(completed)
        if completed == 2:
            raise KeyboardInterrupt  # as if killed right after the round-2 checkpoint

    eng._save_checkpoint = crash_after_round_two
    with pytest.raises(KeyboardInterrupt):
        eng.run()
    assert not (tmp_path / "killed" / "manifest.json").exists()
    resumed = train(cfg, tmp_path / "killed", resume=True)
    assert _max_diff(_adapter(tmp_path / "full"), _adapter(tmp_path / "killed")) < 1e-6
    assert resumed["privacy"]["epsilon"]["pld"] == pytest.approx(
        full["privacy"]["epsilon"]["pld"], rel=1e-12
    )
    assert len(resumed["privacy"]["ledger"]["events"]) == len(full["privacy"]["ledger"]["events"])
    rows = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2, 3]


def _kill_in_round_three(eng_cls_train, monkeypatch):
    """Make ClientContext.train raise (as a kill would stop it) in round 3."""
    from fl.run.contexts import ClientContext

    def train_or_die(self, *a, **kw):
        if self.round.index == 2:
            raise KeyboardInterrupt
        return eng_cls_train(self, *a, **kw)

    monkeypatch.setattr(ClientContext, "train", train_or_die)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run of CFG, trained once for the module: (run dir, manifest).
    Every test only reads it (its noise key is the killed runs' key)."""
    out = tmp_path_factory.mktemp("full") / "full"
    return out, train(tiny_config(**CFG), out)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, full):
    """CFG run with the full run's key, killed in round 3 (its journal in flight), made
    once: each test resumes its own copy (:func:`_killed_copy`)."""
    from fl.run.contexts import ClientContext

    run = tmp_path_factory.mktemp("killed") / "killed"
    with pytest.MonkeyPatch.context() as mp:
        _kill_in_round_three(ClientContext.train, mp)
        with pytest.raises(KeyboardInterrupt):
            Engine(
                tiny_config(**CFG), run, quiet=True, noise_key=full[0] / "private/noise.key"
            ).run()
    return run


def _killed_copy(killed_run, tmp_path):
    run = tmp_path / "killed"
    shutil.copytree(killed_run, run)
    return run


@pytest.mark.parametrize("same_environment", [True, False])
def test_round_killed_midway_is_replayed_or_rerun_with_fresh_noise(
    tmp_path, full, killed_run, same_environment
):
    """A round killed after it started may have released. Resumed in the environment that
    journaled it (CPU, in process), it is replayed bit for bit and charged once; in another
    environment (here: another thread count) its planned events are charged again and it
    is re-run with fresh noise streams, never the first attempt's noise over a computation
    that may differ."""
    full_dir, full = full
    cfg = tiny_config(**CFG)
    run = _killed_copy(killed_run, tmp_path)
    journal = json.loads((run / "checkpoint" / "inflight.json").read_text())
    assert journal["round"] == 2 and journal["attempt"] == 0
    assert journal["environment"]["threads"] == torch.get_num_threads()
    if not same_environment:
        journal["environment"]["threads"] += 1
        (run / "checkpoint" / "inflight.json").write_text(json.dumps(journal))
    resumed = train(cfg, run, resume=True)
    events = resumed["privacy"]["ledger"]["events"]
    charged = [e for e in events if e["stage"] == "interrupted"]
    diff = _max_diff(_adapter(full_dir), _adapter(run))
    log = (run / "run.log").read_text()
    if same_environment:
        assert not charged and diff < 1e-6
        assert resumed["privacy"]["epsilon"]["pld"] == pytest.approx(
            full["privacy"]["epsilon"]["pld"], rel=1e-12
        )
    else:
        assert {(e["unit"], e["round"]) for e in charged} == {
            (e["unit"], 2) for e in full["privacy"]["ledger"]["events"] if e["round"] == 2
        }
        assert "attempt 1 with fresh noise streams" in log and "CPU environment" in log
        assert diff > 1e-3  # round 3's noise is not the first attempt's
        assert resumed["privacy"]["epsilon"]["pld"] > full["privacy"]["epsilon"]["pld"]


def _killed_elsewhere(killed_run, tmp_path):
    """A copy of the killed run whose journal says another CPU environment (no bit-exact
    replay here). Returns (run, journal path, journal)."""
    run = _killed_copy(killed_run, tmp_path)
    journal_path = run / "checkpoint" / "inflight.json"
    journal = json.loads(journal_path.read_text())
    journal["environment"]["threads"] += 1
    journal_path.write_text(json.dumps(journal))
    return run, journal_path, journal


def test_round_killed_twice_keeps_the_first_attempts_charge(
    tmp_path, full, killed_run, monkeypatch
):
    """Killed in round 3, resumed where it cannot replay (charged, attempt 1), killed again
    in the same round and resumed where attempt 1 replays bit for bit: the first attempt's
    charge lived only in memory, so the second journal carries it and the final ledger
    holds it once; the third pass charges nothing new."""
    from fl.run.contexts import ClientContext

    full_dir, full = full
    cfg = tiny_config(**CFG)
    key = full_dir / "private/noise.key"
    run, journal_path, journal = _killed_elsewhere(killed_run, tmp_path)
    real = ClientContext.train
    _kill_in_round_three(real, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        Engine(cfg, run, resume=True, quiet=True, noise_key=key).run()
    second = json.loads(journal_path.read_text())
    round3 = [e for e in full["privacy"]["ledger"]["events"] if e["round"] == 2]
    assert second["attempt"] == 1 and len(second["charged"]) == len(round3)
    monkeypatch.setattr(ClientContext, "train", real)
    resumed = train(cfg, run, resume=True)
    charged = [e for e in resumed["privacy"]["ledger"]["events"] if e["stage"] == "interrupted"]
    assert sorted((e["unit"], e["round"]) for e in charged) == sorted(
        (e["unit"], 2) for e in round3
    )
    assert "charged again" in (run / "run.log").read_text()
    assert not journal_path.exists()
    assert resumed["privacy"]["epsilon"]["pld"] > full["privacy"]["epsilon"]["pld"]


def test_a_stop_before_the_rerun_is_journaled_keeps_the_charge(
    tmp_path, full, killed_run, monkeypatch
):
    """Resume charges an interrupted round that cannot be replayed, then stops before the
    re-run has journaled it: the journal was kept, so the next resume charges that attempt
    (once: the charge of the stopped resume was never checkpointed)."""
    full_dir, full = full
    cfg = tiny_config(**CFG)
    run, journal_path, journal = _killed_elsewhere(killed_run, tmp_path)

    def stop(self, r, planned):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "_write_inflight", stop)
    with pytest.raises(KeyboardInterrupt):
        Engine(cfg, run, resume=True, quiet=True, noise_key=full_dir / "private/noise.key").run()
    assert json.loads(journal_path.read_text()) == journal  # kept as it was
    monkeypatch.undo()
    resumed = train(cfg, run, resume=True)
    charged = [e for e in resumed["privacy"]["ledger"]["events"] if e["stage"] == "interrupted"]
    round3 = [e for e in full["privacy"]["ledger"]["events"] if e["round"] == 2]
    assert sorted((e["unit"], e["round"]) for e in charged) == sorted(
        (e["unit"], 2) for e in round3
    )


def test_stop_file_stops_at_a_round_boundary_and_resume_charges_nothing_twice(
    tmp_path, full, monkeypatch, capsys
):
    """RUN/STOP stops a run after its current round's checkpoint (exit 3, one line), with
    no round in flight; --resume then finishes it as if it had never stopped."""
    from fl.run.contexts import ClientContext
    from fl.run.engine import STOP_FILE

    full_dir, full = full
    cfg = tiny_config(**CFG)
    run = tmp_path / "stopped"
    real = ClientContext.train

    def touch_in_round_two(self, *a, **kw):
        if self.round.index == 1:
            (self.engine.out / STOP_FILE).touch()
        return real(self, *a, **kw)

    monkeypatch.setattr(ClientContext, "train", touch_in_round_two)
    from fl.errors import StoppedAtRound

    eng = Engine(cfg, run, quiet=True, noise_key=full_dir / "private/noise.key")
    with pytest.raises(StoppedAtRound, match="stopped after round 2 of 3"):
        eng.run()
    assert not (run / STOP_FILE).exists() and not (run / "manifest.json").exists()
    assert not (run / "checkpoint" / "inflight.json").exists()
    monkeypatch.setattr(ClientContext, "train", real)
    resumed = train(cfg, run, resume=True)
    assert _max_diff(_adapter(full_dir), _adapter(run)) < 1e-6
    assert resumed["privacy"]["ledger"]["events"] == full["privacy"]["ledger"]["events"]
    # the CLI's form: exit code 3 and one line (the tiny run's flags: its size does not
    # change how a stop ends the command)
    monkeypatch.setattr(ClientContext, "train", touch_in_round_two)
    run2 = tmp_path / "cli"
    rc = cli_main(["train", *tiny_flags(rounds=3, local_steps=1), "--out", str(run2)])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and len(err.splitlines()) == 1 and "--resume" in err, err


def test_a_private_stream_is_issued_once_and_attempts_rename_round_streams():
    from fl.privacy.rng import NoiseKey, RunRandomness, draw_normal

    rand = RunRandomness(NoiseKey.generate(), seed=0)
    a = draw_normal(rand.round_stream("dpsgd-noise", 2, "0", "train"), (4,), 1.0)
    with pytest.raises(RuntimeError, match="already issued"):
        rand.stream("dpsgd-noise", 2, "0", "train")
    rand.attempts[2] = 1
    b = draw_normal(rand.round_stream("dpsgd-noise", 2, "0", "train"), (4,), 1.0)
    assert not torch.equal(a, b)
    c = draw_normal(rand.round_stream("dpsgd-noise", 3, "0", "train"), (4,), 1.0)
    ref = RunRandomness(rand.key, seed=0)  # attempt 0 of another round: the plain name
    assert torch.equal(c, draw_normal(ref.stream("dpsgd-noise", 3, "0", "train"), (4,), 1.0))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tiny_cfg, capsys):
    cfg = tiny_cfg(rounds=1)
    train(cfg, tmp_path / "r")
    st = next((tmp_path / "r" / "checkpoint").glob("state-*.safetensors"))
    data = bytearray(st.read_bytes())
    data[-1] ^= 0xFF
    st.write_bytes(bytes(data))
    assert cli_main(["train", "--resume", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "corrupt" in capsys.readouterr().err
