"""Signals: φ and loss against naive formulas; adapter loading against the engine's own
evaluation; the cache; clear errors for adapters that do not fit."""

import json
import shutil

import numpy as np
import pytest
import torch

from attacks.rundata import load_run, run_signals
from attacks.signals import adapter_signals, signals_from_logits
from fl.errors import UsageError


def _naive_phi(z, y):
    """φ = log p_y − log Σ_{y'≠y} p_{y'}, the plain way, in float64."""
    out = []
    for zi, yi in zip(z, y):
        p = np.exp(zi - zi.max())
        p = p / p.sum()
        out.append(np.log(p[yi]) - np.log(p.sum() - p[yi]))
    return np.array(out)


def test_phi_and_loss_match_naive_formulas():
    rng = np.random.default_rng(0)
    for c in (2, 3, 7):
        z = rng.normal(scale=4.0, size=(50, c))
        y = rng.integers(0, c, size=50)
        s = signals_from_logits(z, y)
        np.testing.assert_allclose(s.phi, _naive_phi(z, y), rtol=1e-9, atol=1e-9)
        ce = torch.nn.functional.cross_entropy(
            torch.tensor(z), torch.tensor(y), reduction="none"
        ).numpy()
        np.testing.assert_allclose(s.loss, ce, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(s.p_true, np.exp(-ce), rtol=1e-12)


def test_phi_is_stable_for_confident_logits():
    # Naively 1 - p_y rounds to 0 here; the closed form is z_y − z_other = ±400.
    s = signals_from_logits(np.array([[200.0, -200.0], [200.0, -200.0]]), np.array([0, 1]))
    np.testing.assert_allclose(s.phi, [400.0, -400.0])
    assert np.isfinite(s.loss).all() and s.loss[1] == pytest.approx(400.0)


@pytest.fixture(scope="module")
def tiny_run(train_target):
    return train_target("sig", members=24, nonmembers=12, test=20, local_steps=6, lr=0.05, seed=3)


def test_run_signals_reproduce_the_engine_evaluation(tiny_run, tmp_path):
    d, man = tiny_run
    run = load_run(d)
    assert (run.role == "member").sum() == 24 and (run.role == "test").sum() == 20
    sig = run_signals(run, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    test = run.role == "test"
    # The engine evaluated the released state on the test set: same mean loss and accuracy.
    assert sig.loss[test].mean() == pytest.approx(man["metrics"]["final"]["loss"], rel=1e-4)
    acc = (sig.logits[test].argmax(1) == run.labels[test]).mean()
    assert acc == pytest.approx(man["metrics"]["final"]["accuracy"])
    # Cached: a second call reads the npz and returns the same values.
    files = list((tmp_path / "cache").glob("signals-*.npz"))
    assert len(files) == 1
    again = run_signals(run, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    np.testing.assert_array_equal(again.logits, sig.logits)
    # Another max_length (or other data) is another key.
    cfg = run.config
    adapter_signals(
        d / "adapter", cfg["model"], run.texts[:5], run.labels[:5], 8, device="cpu",
        seed=cfg["seed"], cache_dir=tmp_path / "cache", progress=False,
    )  # fmt: skip
    assert len(list((tmp_path / "cache").glob("signals-*.npz"))) == 2


def test_adapter_that_does_not_fit_names_the_module(tiny_run, tmp_path):
    from safetensors.torch import load_file, save_file

    d, _ = tiny_run
    bad = tmp_path / "bad"
    shutil.copytree(d / "adapter", bad)
    t = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in t if "layer.0.attention.self.query.lora_A" in k)
    t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 3)
    save_file(t, str(bad / "adapter_model.safetensors"))
    with pytest.raises(UsageError, match=r"bert\.encoder\.layer\.0\.attention\.self\.query"):
        adapter_signals(bad, "tiny-bert", ["a b"], [0], 8, device="cpu", seed=3)
    # A GPT-2 base has no BERT modules at all.
    with pytest.raises(UsageError, match="does not have"):
        adapter_signals(d / "adapter", "tiny-gpt2", ["a b"], [0], 8, device="cpu")
    # Pickled weights are refused, never unpickled.
    pk = tmp_path / "pickled"
    pk.mkdir()
    shutil.copy(d / "adapter" / "adapter_config.json", pk)
    (pk / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(UsageError, match="safetensors"):
        adapter_signals(pk, "tiny-bert", ["a b"], [0], 8, device="cpu")
    # A head with the wrong number of labels.
    with pytest.raises(UsageError, match="classifier"):
        adapter_signals(d / "adapter", "tiny-bert", ["a b"], [0], 8, num_labels=3, seed=3)


def test_load_run_errors(tmp_path, tiny_run):
    with pytest.raises(UsageError, match="not found"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="manifest"):
        load_run(tmp_path / "empty")
    d, _ = tiny_run
    bad = tmp_path / "badsplit"
    shutil.copytree(d, bad, ignore=shutil.ignore_patterns("checkpoint"))
    sp = json.loads((bad / "splits.json").read_text())
    sp["members"][0] = "synthetic:999999"
    (bad / "splits.json").write_text(json.dumps(sp))
    with pytest.raises(UsageError, match="999999"):
        load_run(bad)


def test_load_run_leaves_out_ids_touched_by_canaries(tmp_path, tiny_run):
    d, _ = tiny_run
    c = tmp_path / "canary"
    shutil.copytree(d, c, ignore=shutil.ignore_patterns("checkpoint"))
    sp = json.loads((c / "splits.json").read_text())
    replaced, source = sp["members"][3], sp["nonmembers"][0]
    sp["canaries"] = [
        {"id": "canary:0", "source_id": source, "text": "x", "label": 1, "included": True,
         "position": 3},
        {"id": "canary:1", "source_id": sp["nonmembers"][1], "text": "y", "label": 0,
         "included": False, "position": None},
    ]  # fmt: skip
    (c / "splits.json").write_text(json.dumps(sp))
    run = load_run(c)
    assert replaced not in run.ids and source not in run.ids
    assert sp["nonmembers"][1] not in run.ids
    assert (run.role == "member").sum() == 23 and (run.role == "nonmember").sum() == 10
