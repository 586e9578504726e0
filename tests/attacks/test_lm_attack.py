"""`fedlora attack` on a causal-LM run (tiny-gpt2): every LM signal, the shadow attacks on
per-sequence losses, the client level; the scores agree with fl.models.causal_lm's own scoring."""

import json

import numpy as np
import pytest

from fl.errors import UsageError
from pipeline.cli import main

LM = dict(model="tiny-gpt2", task="causal-lm", members=24, nonmembers=24, test=8, clients=3,
          max_length=16, min_client_size=4)  # fmt: skip
SIGNALS = ["loss", "perplexity", "reference", "zlib", "lowercase", "min_k", "min_k_pp"]


@pytest.fixture(scope="module")
def lm_run(train_target):
    return train_target("lm", seed=3, **LM)


@pytest.fixture(scope="module")
def run_attack(lm_run, tmp_path_factory):
    """``fedlora attack RUN --attacks loss,lm --client-level --json --min-k 0.5``, once:
    (its output folder, the JSON it printed)."""
    import contextlib
    import io

    run_dir, _ = lm_run
    out = tmp_path_factory.mktemp("lm-attack") / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["attack", str(run_dir), "--attacks", "loss,lm", "--client-level", "--json",
                   "--out", str(out), "--device", "cpu", "--bootstrap", "10",
                   "--min-k", "0.5"])  # fmt: skip
    assert rc == 0
    return out, json.loads(printed.getvalue())


def test_lm_signals_end_to_end(lm_run, run_attack):
    import torch

    from attacks import lm_signals as lm
    from attacks.lm_target import lm_adapter_signals
    from attacks.rundata import load_run
    from fl.data.lm import LmTokenizedData
    from fl.models.causal_lm import token_logprobs
    from fl.run.lm_run import load_run_lm

    run_dir, man = lm_run
    out, doc = run_attack
    assert list(doc["attacks"]) == SIGNALS
    assert doc["target"]["task"] == "causal-lm" and doc["lm"]["min_k"] == 0.5
    # the adapter's test perplexity is the run's own evaluation of it
    ppl = doc["lm"]["perplexity"]
    assert ppl["test"]["adapter"] == pytest.approx(man["metrics"]["final"]["perplexity"], 1e-6)
    assert set(ppl) == {"member", "nonmember", "test"} and ppl["member"]["base"] > 0
    # scores against fl.models.causal_lm's independent per-token log-probs (adapter on and off)
    run = load_run(run_dir)
    model, tok, cfg = load_run_lm(run_dir)
    texts = list(np.asarray(run.texts)[run.role != "test"])
    data = LmTokenizedData(texts, tok, cfg.max_length)
    on = token_logprobs(model, data, adapter=True)
    off = token_logprobs(model, data, adapter=False)
    low = token_logprobs(model, LmTokenizedData([t.lower() for t in texts], tok, 16))
    z = np.load(out / "scores.npz")
    loss = np.array([-x.mean() for x in on])
    np.testing.assert_allclose(z["loss"], -loss, rtol=1e-5)
    np.testing.assert_allclose(z["perplexity"], -np.exp(loss), rtol=1e-5)
    np.testing.assert_allclose(z["reference"], -(loss - [-x.mean() for x in off]), atol=1e-5)
    np.testing.assert_allclose(z["lowercase"], -loss / [-x.mean() for x in low], rtol=1e-5)
    np.testing.assert_allclose(z["zlib"], -loss / lm.zlib_bytes(texts), rtol=1e-5)
    mink = [np.sort(x)[: int(np.ceil(0.5 * len(x) - 1e-9))].mean() for x in on]
    np.testing.assert_allclose(z["min_k"], mink, rtol=1e-5)
    # min-k%++ from the model's full distributions, recomputed here one sequence at a time
    # (min-k%++ reads the adapter's pass only: the base's and the lowercased are not made)
    sig = lm_adapter_signals(run_dir / "adapter", "tiny-gpt2", texts, None, 16, "cpu", 3, 0.5,
                             extras=False)  # fmt: skip
    with torch.no_grad():
        b = data.batch([0], "cpu")
        labels = b.pop("labels")
        logits = model(**b).logits[:, :-1]
        st = lm.token_stats(logits, labels[:, 1:].clamp_min(0), labels[:, 1:] != -100)
    assert sig.min_k_pp[0] == pytest.approx(lm.min_k_plus_plus(st, 0.5)[0], rel=1e-6)
    np.testing.assert_allclose(z["min_k_pp"], sig.min_k_pp, rtol=1e-9)
    # the client level on a causal-LM run: 3 participants and their twins
    cl = doc["client_level"]
    assert cl["n_participating"] == 3 and 1 <= cl["n_nonparticipating"] <= 3
    assert set(cl["attacks"]) == set(SIGNALS)


def test_lm_shadow_attacks_read_sequence_losses(lm_run, tmp_path):
    from attacks.config import AttackConfig
    from attacks.run import attack
    from attacks.target import Target

    run_dir, _ = lm_run
    # LiRA needs 4 shadows (2 IN and 2 OUT per example): refused at 2, before any training
    two = AttackConfig(attacks="calibration,lira", shadows=2, device="cpu", progress=False)
    with pytest.raises(UsageError, match="LiRA needs --shadows >= 4"):
        attack(Target.from_run(run_dir), two, out=tmp_path / "no")
    assert not (tmp_path / "no").exists()
    cfg = AttackConfig(attacks="calibration,rmia,shadow", shadows=2, device="cpu",
                       bootstrap=0, progress=False)  # fmt: skip
    doc = attack(Target.from_run(run_dir), cfg, out=tmp_path / "sh")
    # Shokri's attack reads class logits, which a causal LM has not: not run
    assert list(doc["attacks"]) == ["calibration", "rmia_online", "rmia_offline"]
    assert doc["shadows"]["k"] == 2
    for r in doc["attacks"].values():
        assert 0.0 <= r["auc"] <= 1.0


def test_foreign_causal_adapter_matches_run_mode(lm_run, run_attack, tmp_path):
    """The run's adapter attacked as a foreign one (its texts in two files, the base made
    from --base-seed) scores every LM signal as the run mode does (run_attack: the same
    --attacks and --min-k)."""
    from attacks.rundata import load_run

    run_dir, _ = lm_run
    run = load_run(run_dir)
    files = {}
    for role in ("member", "nonmember"):
        files[role] = tmp_path / f"{role}s.jsonl"
        rows = [json.dumps({"text": str(t)}) for t in np.asarray(run.texts)[run.role == role]]
        files[role].write_text("\n".join(rows) + "\n")
    out = tmp_path / "foreign"
    rc = main(["attack", "--adapter", str(run_dir / "adapter"), "--model", "tiny-gpt2",
               "--members", str(files["member"]), "--nonmembers", str(files["nonmember"]),
               "--max-length", "16", "--base-seed", "3", "--attacks", "loss,lm", "--min-k", "0.5",
               "--out", str(out), "--device", "cpu", "--bootstrap", "0"])  # fmt: skip
    assert rc == 0
    a, b = (np.load(d / "scores.npz") for d in (out, run_attack[0]))
    for name in SIGNALS:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-9)
    doc = json.loads((out / "attacks.json").read_text())
    assert doc["target"]["task"] == "causal-lm"
