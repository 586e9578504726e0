"""Neighbour replay (audit.replay): record on D, replay on D′ with every draw frozen.

The engine's tests train tiny runs (tiny-bert, synthetic text, < 1 s each on one core);
the Recorder's tests drive the tap by hand with a toy mechanism whose sensitivity is
known in closed form.
"""

import math

import pytest
import torch

from audit.replay.engine import replay_neighbours, replay_recorded
from audit.replay.neighbours import Neighbour, engine_neighbours, parse_kinds
from audit.replay.record import Recorder, distance
from fl.privacy import tap
from pipeline.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from fl.run.engine import train
    from fl.testing import tiny_config

    root = tmp_path_factory.mktemp("replay")
    out = {}
    # Trained without dropout, as the job's presets train: the job's client-local replay then
    # takes the recorded training as its reference (one pass per neighbour; the pass on D that
    # a training with dropout needs is tested in test_replay_reference.py). The correct run
    # keeps two rounds (the replay carries the frozen trajectory from round to round); the
    # others hold one round: what they check (a release past its bound, the client-level
    # bounds, which releases FedPower makes) is in every round's releases. Two local steps,
    # not TINY's four: each release is one step's clipped sum, and the tiny model's
    # per-record gradients exceed C from the first step, so every neighbour still meets its
    # bound with equality (max ratios 0.999999 at 2 steps as at 4; 12 releases a pass, not
    # 24) and every replay pass costs about two thirds of the CPU. The client-level run keeps
    # four: its release is a client's whole clipped update, and the empty-client neighbour
    # meets C with equality only if that update is longer than C (at two steps one fresh-
    # clone run found 0.946).
    for name, kw in {
        "correct": {},
        "no_clip": {"inject_fault": "no_clip", "rounds": 1},
        "client": {"dp_level": "client", "clients": 4, "rounds": 1, "local_steps": 4},
        "fedpower": {"dp_level": "client", "method": "fedpower", "clients": 4, "rounds": 1},
    }.items():
        cfg = tiny_config(
            **{"dp_level": "sample", "noise_multiplier": 1.0, "dropout": "off", "local_steps": 2}
            | kw
        )
        rec = Recorder()
        rec.keep_deliveries = True  # the job's way: recorded while it trains
        with tap.tapped(rec):
            train(cfg, root / name, quiet=True)
        out[name] = root / name
        out[name + ":recorded"] = (cfg, rec)
    return out


def test_a_correct_run_passes_every_neighbour_at_its_bound(runs):
    res = replay_neighbours(runs["correct"], kinds="all")
    assert res["verdict"] == "pass", res["findings"]
    assert res["releases"] > 0
    kinds = [r["neighbour"]["kind"] for r in res["neighbours"]]
    # (a client with no data is a client-level neighbour only)
    assert kinds == ["remove", "duplicate", "empty", "max-length", "flipped", "replace"]
    for r in res["neighbours"]:
        cmp = r["comparison"]
        assert cmp["compared"] == res["releases"] and cmp["divergence"] is None
        # the tiny model's gradients exceed C = 1: a clipped record moves the sum by
        # exactly C (replace-one: up to 2C), so the replay meets its bound with equality
        assert 0.9 < cmp["max_ratio"] <= 1 + 1e-4
        assert r["public_diffs"] == [] and r["exception"] is None


def test_the_jobs_client_local_replay_after_a_recorded_training(runs):
    cfg, rec = runs["correct:recorded"]
    res = replay_recorded(cfg, runs["correct"], rec, kinds="remove,duplicate,replace")
    assert res["verdict"] == "pass" and res["mode"] == "client-local", res["findings"]
    assert res["reference"] == "the recorded training (no dropout)"  # the job's way
    for r in res["neighbours"]:
        cmp = r["comparison"]
        # only the neighbour's client retrained: its releases, not the others'
        assert 0 < cmp["compared"] < res["releases"] and cmp["divergence"] is None
        assert 0.9 < cmp["max_ratio"] <= 1 + 1e-4 and r["public_diffs"] == []
    cfg, rec = runs["no_clip:recorded"]
    bad = replay_recorded(cfg, runs["no_clip"], rec, kinds="remove")
    assert bad["verdict"] == "fail"
    assert {f["code"] for f in bad["findings"]} == {"sensitivity_exceeded"}


def test_clipping_skipped_is_a_sensitivity_violation(runs):
    res = replay_neighbours(runs["no_clip"], kinds="remove")
    assert res["verdict"] == "fail"
    codes = {f["code"] for f in res["findings"]}
    assert codes == {"sensitivity_exceeded"}
    v = res["neighbours"][0]["comparison"]["violations"][0]
    assert v["distance"] > v["bound"] == 1.0


def test_client_level_record_neighbours_are_held_to_2C_an_empty_client_to_C(runs):
    res = replay_neighbours(runs["client"], kinds="remove,duplicate,empty-client")
    assert res["verdict"] == "pass"
    rel = [(r["neighbour"]["relation"], r["neighbour"]["bound"]) for r in res["neighbours"]]
    assert rel == [("replace-one-client", "2·C")] * 2 + [("add/remove-client", "1·C")]
    # a client with no data removes its whole clipped update: exactly C (its update is
    # longer than C on the tiny model)
    assert abs(res["neighbours"][2]["comparison"]["max_ratio"] - 1) < 1e-4


def test_a_method_whose_noise_bypasses_the_tap_is_never_a_pass(runs, monkeypatch):
    import fl.privacy.dpsgd as dpsgd

    class Bypass:  # DP-SGD's noise added beside the seam, as an uninstrumented method would
        @staticmethod
        def release(kind, value, noise, sensitivity, part="", released=None):
            return value.add_(noise.to(value.dtype))

    monkeypatch.setattr(dpsgd, "tap", Bypass)
    res = replay_neighbours(runs["correct"], kinds="remove")
    assert res["verdict"] == "incomplete"
    assert res["releases"] == 0
    assert [f["code"] for f in res["findings"]] == ["replay_empty"]


def test_fedpower_powerdp_projections_and_private_head_are_replayed(runs):
    cfg, rec = runs["fedpower:recorded"]
    assert {r.kind for r in rec.releases} == {"powerdp", "fedpower-head"}
    res = replay_recorded(cfg, runs["fedpower"], rec, kinds="remove,empty-client")
    assert res["verdict"] == "pass", res["findings"]
    assert all(r["public_diffs"] == [] for r in res["neighbours"])  # nothing else moved
    assert all(0 < r["comparison"]["max_ratio"] <= 1 for r in res["neighbours"])


def test_cli_neighbours_exit_codes(runs, capsys):
    assert main(["audit", str(runs["no_clip"]), "--neighbours", "remove"]) == 1
    assert "sensitivity_exceeded" in capsys.readouterr().out
    assert main(["audit", str(runs["correct"]), "--neighbours"]) == 0
    assert "neighbour replay: pass (2 neighbours" in capsys.readouterr().out
    assert main(["audit", str(runs["correct"]), "--neighbours", "bogus"]) == 2


def test_parse_and_place_neighbours():
    assert parse_kinds(None) == ("remove", "max-length")
    with pytest.raises(ValueError, match="unknown kind"):
        parse_kinds("remove,nope")
    nbs = engine_neighbours(("remove", "duplicate", "empty", "flipped"), {"0": 5, "1": 9}, False)
    assert [(n.kind, n.client, n.at) for n in nbs] == [
        ("remove", "1", "end"),
        ("duplicate", "1", "end"),
        ("empty", "0", "start"),
    ]  # no label flip for a causal LM
    assert Neighbour("replace", "0").factor == 2.0 and Neighbour("remove", "0").factor == 1.0


# ---- the Recorder on a toy mechanism: q(D) = Σ_i clip(x_i), one release per step ------
def _toy(rec, data, clip=1.0, steps=3, extra_step_if=None):
    outs = []
    with tap.tapped(rec):
        for t in range(steps + (1 if extra_step_if and extra_step_if(data) else 0)):
            with tap.scope(step=t):
                s = torch.zeros(2)
                for x in data:
                    s += x * min(1.0, clip / float(x.norm()))
                outs.append(tap.release("toy", s, torch.randn(2), clip))
    return outs


def test_recorder_freezes_outputs_and_measures_each_release():
    d = [torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4])]
    rec = Recorder()
    out_d = _toy(rec, d)
    rec.start_replay()
    out_dp = _toy(rec, d[:1])  # the small record removed: moves each sum by 0.5
    assert all(torch.equal(a, b) for a, b in zip(out_d, out_dp))  # one trajectory
    cmp = rec.compare()
    assert cmp["passed"] and cmp["compared"] == 3
    assert math.isclose(cmp["max_ratio"], 0.5, rel_tol=1e-6)


def test_recorder_flags_unclipped_nonfinite_extra_and_empty():
    d = [torch.tensor([3.0, 4.0])]
    rec = Recorder()
    _toy(rec, d, clip=1.0)
    rec.start_replay()
    _toy(rec, d + [torch.tensor([30.0, 40.0])], clip=100.0)  # a bug: the clip ignored
    cmp = rec.compare()
    assert not cmp["passed"] and cmp["n_violations"] == 3
    assert cmp["violations"][0]["distance"] > 40
    rec.start_replay()
    _toy(rec, d + [torch.tensor([float("nan"), 0.0])], clip=1.0)
    cmp = rec.compare()
    assert not cmp["passed"] and cmp["violations"][0]["nonfinite"]
    rec.start_replay()
    _toy(rec, d * 2, extra_step_if=lambda data: len(data) > 1)  # steps depend on the data
    cmp = rec.compare()
    assert not cmp["passed"] and "more releases" in cmp["divergence"]
    rec.start_replay()
    _toy(rec, d, steps=2)
    assert "2 of the 3 releases" in rec.compare()["divergence"]
    empty = Recorder()
    empty.start_replay()
    assert empty.compare()["empty"] and not empty.compare()["passed"]


def test_distance_never_small_for_broken_input():
    a = {"": torch.tensor([1.0, 2.0])}
    assert math.isnan(distance(a, {"": torch.tensor([1.0, float("inf")])})[0])
    assert math.isnan(distance(a, {"x": torch.tensor([1.0, 2.0])})[0])
    assert distance(a, {"": torch.tensor([4.0, 6.0])})[0] == pytest.approx(5.0)


def test_the_reports_replay_column_reads_the_file_as_untrusted(tmp_path):
    import json

    from audit.replay.engine import REPLAY_FILE, read_replay
    from audit.report.verdict_table import replay_cell

    assert read_replay(tmp_path) is None and replay_cell(None, True) == "not run"
    (tmp_path / REPLAY_FILE).parent.mkdir(parents=True)
    bad = {
        "verdict": "pass",
        "neighbours": [],
        "releases": 3,
        "findings": [{"code": "sensitivity_exceeded", "severity": "error", "message": "x"}],
    }
    (tmp_path / REPLAY_FILE).write_text(json.dumps(bad))
    rep = read_replay(tmp_path)
    assert rep["verdict"] == "not read" and "pass' beside an error" in rep["error"]
    (tmp_path / REPLAY_FILE).write_text("{not json")
    assert read_replay(tmp_path)["verdict"] == "not read"
    good = dict(bad, verdict="fail")
    good["neighbours"] = [{"comparison": {"max_ratio": 1.5}}]
    (tmp_path / REPLAY_FILE).write_text(json.dumps(good))
    cell = replay_cell(read_replay(tmp_path), True)
    assert cell.startswith("fail (1 neighbour × 3 releases, largest ‖Δq‖/bound 1.500)")
    assert cell.endswith(": sensitivity_exceeded") and replay_cell(None, False) == "–"


def test_fedask_w_space_is_replayed_and_recording_changes_no_bit(tmp_path):
    """FedASK's W-space step passes its release through the tap in A's row space (the
    W-space sum, sensitivity C); the B-sum it releases is computed as without a tap, so a
    recorded training gives the adapter of an unrecorded one bit for bit."""
    from fl.run.engine import train
    from fl.testing import tiny_config

    # one round (both of FedASK's stages, the W-space releases and the B-sum): each round
    # runs the same code, and the adapter is compared bit for bit after it
    cfg = tiny_config(
        dp_level="sample",
        noise_multiplier=1.0,
        method="fedask",
        insecure_deterministic_noise=True,
        rounds=1,
    )
    train(cfg, tmp_path / "plain", quiet=True)
    rec = Recorder()
    rec.keep_deliveries = True
    with tap.tapped(rec):
        train(cfg, tmp_path / "taped", quiet=True)
    name = "adapter/adapter_model.safetensors"
    assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "taped" / name).read_bytes()
    assert {r.kind for r in rec.releases} == {"dpsgd-wspace"}
    res = replay_recorded(cfg, tmp_path / "taped", rec, kinds="remove")
    assert res["verdict"] == "pass", res["findings"]
    assert 0.9 < res["neighbours"][0]["comparison"]["max_ratio"] <= 1 + 1e-4
