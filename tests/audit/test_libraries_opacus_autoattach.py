"""Sampler canaries attached at import (audit.libraries.opacus.autoattach) and the one verdict
of ``fedlora audit-script`` (audit.cli.script): canaries and neighbour replay on an unchanged
Opacus script (tests/audit/scripts/opacus_replay_train.py: an MLP, 10 Poisson steps, ~0.05 s a
run) and an unchanged Hugging Face Trainer + Opacus script (hf_trainer_opacus_train.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from audit.claims.schema import validate_claim  # noqa: E402
from audit.cli.script import audit_script_complete  # noqa: E402
from audit.libraries.opacus.autoattach import canaries_at_import, run_with_canaries  # noqa: E402
from pipeline.cli import main  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "opacus_replay_train.py"
CLAIM = validate_claim(
    {
        "level": "sample",
        "noise_multiplier": 1.0,
        "clipping_norm": 1.0,
        "sampling": "poisson",
        "rounds": 1,
        "steps_per_round": 10,
        "sample_rate": 0.1,
        "claimed_epsilon": 5.0,
        "delta": 1e-5,
    }
)
FAST = {"canary_seed": 1, "permutations": 199}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_a_correct_opacus_script_passes_with_one_verdict_over_both_instruments():
    res = audit_script_complete(SCRIPT, CLAIM, "remove,scaled@end", **FAST)
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    assert res["instruments"] == {"canaries": "pass", "replay": "incomplete"}
    tested = res["coverage"]["tested"]
    assert tested["sampling"] == ["canaries (sampler coins and release)"]
    assert tested["accounting"] == ["claim check"]
    assert "replay" in tested["clipping"] and any("canaries" in t for t in tested["clipping"])
    # the user's loop `for xb, yb in loader: model(xb)` read every batch's canary ids by the
    # tag the collate put on its tensors; the mechanism is the user's (q, steps, N held)
    run = res["canaries"]["runs"][0]
    assert run["side_channel"] == {"by_order": 0, "unmatched": 0}
    assert run["run"]["sample_rate"] == 0.1 and run["run"]["steps"] == 10
    assert res["canaries"]["printed"] == "done\n"
    assert set(res["seconds"]) == {"canaries", "D", "N0", "N1"}


def test_the_planted_clip_bug_fails_both_instruments(monkeypatch):
    # the canary audit's two ε at the planted σ = 1e-9 (floored to 0.25) cost ~14 s of PLD:
    # stubbed here, the accounting is tested in test_libraries_opacus*.py
    import audit.libraries.opacus.verdict as v

    stub = {"epsilon_pld": float("inf"), "understated": True, "mechanism": "stub"}
    monkeypatch.setattr(v, "check_claim", lambda c: stub)
    monkeypatch.setattr(v, "epsilon_of_scaled_claim", lambda *a: (float("inf"), False))
    res = audit_script_complete(SCRIPT, CLAIM, "scaled@start", ["--no-clip"], **FAST)
    assert res["verdict"] == "fail" and res["exit_code"] == 1
    assert res["instruments"] == {"canaries": "fail", "replay": "fail"}
    codes = {(f["instrument"], f["code"]) for f in res["findings"]}
    assert {("canaries", "clipping_norm_mismatch"), ("canaries", "noise_multiplier_mismatch"),
            ("replay", "sensitivity_exceeded")} <= codes  # fmt: skip


def _data(n=200, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _train(*, transform=None, ghost=False, shuffle_only=False, per_layer=False, physical=None):
    """A user's loop, no audit code in it: returns what it trained with."""

    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(_data(), batch_size=20)
        kw = {"poisson_sampling": not shuffle_only}
        if ghost:
            kw.update(grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss())
        if per_layer:  # four norms of 0.5: C = 1 (the canary block's adds a fifth)
            kw.update(clipping="per_layer")
        out = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=[0.5] * 4 if per_layer else 1.0, **kw,
        )  # fmt: skip
        model, opt, loader = out[0], out[1], out[-1]
        crit = out[2] if ghost else nn.CrossEntropyLoss()
        if physical:  # BatchMemoryManager: physical batches, one noised step per logical one
            from opacus.utils.batch_memory_manager import BatchMemoryManager

            loader = BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=physical, optimizer=opt
            ).__enter__()
        for xb, yb in loader:
            opt.zero_grad()
            xb = transform(xb) if transform else xb
            crit(model(xb), yb).backward()
            opt.step()

    return train


def test_a_transformed_batch_ghost_per_layer_and_physical_batches_carry_the_canaries():
    res = run_with_canaries(_train(transform=lambda x: x * 2.0), CLAIM, **_fast())
    assert res["verdict"] == "pass", res["findings"]
    assert res["runs"][0]["side_channel"]["by_order"] == 10  # matched by size and order
    res = run_with_canaries(_train(ghost=True), CLAIM, **_fast())
    assert res["runs"][0]["mode"] == "ghost" and res["verdict"] == "pass", res["findings"]
    assert res["coverage"]["tested"]["sampling"]  # the criterion carried the canaries
    res = run_with_canaries(_train(per_layer=True), CLAIM, **_fast())
    assert res["runs"][0]["mode"] == "per_layer" and res["verdict"] == "pass", res["findings"]
    res = run_with_canaries(_train(physical=6), CLAIM, **_fast())
    assert res["verdict"] == "pass" and res["runs"][0]["run"]["steps"] == 10, res["findings"]


def test_the_side_channel_finds_each_batch_by_tag_fingerprint_or_order():
    from audit.libraries.opacus.autoattach import AutoCanaryDataset, CanaryIdChannel

    ch = CanaryIdChannel()
    ds = AutoCanaryDataset(_data(6), [3, 5], 0, ch)
    loader = DataLoader(ds, batch_size=4, collate_fn=ch.collate(torch.utils.data.default_collate))
    (x1, y1), (x2, y2) = list(loader)  # both collated before either is read (a prefetch)
    assert ch.take((x1,), {}, True)[0].tolist() == [-1, -1, -1, -1]  # the tag on its tensors
    assert ch.take((x1.clone(),), {}, True)[0].tolist() == [-1] * 4  # re-read: same ids
    assert ch.take((x2 * 2.0,), {}, True)[0].tolist() == [-1, -1, 3, 5]  # by size and order
    assert ch.by_order == 1 and ch.unmatched == 0
    assert ch.take((torch.zeros(3, 10),), {}, False)[0].tolist() == [-1] * 3  # an eval batch
    assert ch.take((torch.zeros(3, 10),), {}, True)[0].tolist() == [-1] * 3
    assert ch.unmatched == 1
    assert ch.take((), {"input_ids": x2[:0]}, True)[0].numel() == 0  # an empty Poisson batch


def _fast():
    return {"seed": 1, "permutations": 199}


def test_what_cannot_carry_the_canaries_is_incomplete_with_the_reason_never_a_crash():
    res = run_with_canaries(_train(shuffle_only=True), CLAIM, **_fast())
    assert res["verdict"] == "incomplete" and res["runs"] == []
    assert "shuffled batches" in res["reasons"][0] and "would add a batch" in res["reasons"][0]
    assert all("canaries: " in w for w in res["coverage"]["why"].values())
    res = run_with_canaries(lambda: None, CLAIM, **_fast())
    assert res["reasons"] == ["the script never called PrivacyEngine.make_private"]

    def crashes():
        _train()()
        raise RuntimeError("boom")

    res = run_with_canaries(crashes, CLAIM, **_fast())
    assert res["verdict"] == "incomplete" and "RuntimeError: boom" in res["reasons"][0]
    res = run_with_canaries(SCRIPT, None, **_fast())
    assert res["verdict"] == "incomplete" and "no claim" in res["reasons"][0]
    with canaries_at_import(m=4, seed=1):  # the patch is undone after the block
        pass
    assert not hasattr(PrivacyEngine.make_private, "__wrapped__")


def test_hf_trainer_with_opacus_unchanged_passes_under_both_instruments():
    pytest.importorskip("transformers")
    res = audit_script_complete(SCRIPTS / "hf_trainer_opacus_train.py", CLAIM, "remove", **FAST)
    assert res["verdict"] == "pass", res["findings"]
    run = res["canaries"]["runs"][0]
    assert run["side_channel"] == {"by_order": 0, "unmatched": 0}
    assert run["run"]["steps"] == 10 and run["run"]["sample_rate"] == 0.1


def test_cli_one_verdict(tmp_path, capsys):
    claim = tmp_path / "claim.json"
    claim.write_text(json.dumps(CLAIM.to_dict()))
    argv = ["audit-script", str(SCRIPT), "--claim", str(claim), "--neighbours", "remove"]
    assert main([*argv, "--canary-seed", "1", "--permutations", "199"]) == 0
    out = capsys.readouterr().out
    assert "verdict: pass" in out and "canaries: pass" in out and "10 steps at q = 0.1" in out
    assert main([*argv, "--canaries", "0"]) == 4  # the replay alone cannot pass
    assert "canaries: incomplete" in capsys.readouterr().out
    assert main([*argv, "--canaries", "-1"]) == 2
