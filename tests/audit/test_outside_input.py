"""Input canaries for an outside training: the records the training adds, the loss file,
and the audit's relation at sample and client level."""

import json

import numpy as np
import pytest

from audit.canaries import canary_set as CS
from audit.canaries import outside as O
from audit.canaries.hooks import input_canaries, write_input_observations
from audit.claims.check import check_claim


def _claim(level="sample"):
    """A correct claim (ε = its recomputed PLD figure: about 0.7 and 1.2)."""
    c = dict(level=level, noise_multiplier=1.0, sampling="poisson", sample_rate=0.01,
             steps_per_round=100, rounds=1, claimed_epsilon=1.0, delta=1e-5,
             noise_source="keyed_csprng")  # fmt: skip
    if level == "client":
        c = dict(level="client", noise_multiplier=10.0, sampling="all", rounds=10,
                 clients_per_round=10, total_clients=10, claimed_epsilon=1.0, delta=1e-5,
                 noise_source="keyed_csprng")  # fmt: skip
    c["claimed_epsilon"] = check_claim(c)["epsilon_pld"]
    return c


def test_random_text_records(tmp_path):
    out = CS.new_canary_set("input", 300, tmp_path / "set", num_classes=4, words=5)
    doc = json.loads((out / "canaries.json").read_text())
    recs = doc["input"]["records"]
    assert len(recs) == 300 and all(len(r["text"].split()) == 5 for r in recs)
    assert {r["label"] for r in recs} == {0, 1, 2, 3}
    bits = json.loads((out / "private" / "inclusion.json").read_text())["included"]
    got = input_canaries(out)
    assert got == [(r["text"], r["label"]) for r, b in zip(recs, bits) if b]


def test_mislabel_from_source(tmp_path):
    src = tmp_path / "pool.jsonl"
    src.write_text("".join(json.dumps({"text": f"t{i}", "label": i % 3}) + "\n" for i in range(50)))
    out = CS.new_canary_set("input", 20, tmp_path / "set", num_classes=3, source=str(src))
    recs = json.loads((out / "canaries.json").read_text())["input"]["records"]
    assert len({r["text"] for r in recs}) == 20
    assert all(r["label"] != int(r["text"][1:]) % 3 for r in recs)  # every label moved
    with pytest.raises(O.UsageError, match="need 60 records"):
        CS.new_canary_set("input", 60, tmp_path / "s2", num_classes=3, source=str(src))
    assert not (tmp_path / "s2").exists()


@pytest.mark.parametrize("level", ["sample", "client"])
def test_input_audit(level, tmp_path):
    out = CS.new_canary_set("input", 1000, tmp_path / "set", num_classes=2)
    cs = CS.load_canary_set(out)
    rng = np.random.default_rng(0)
    # memorized canaries: included ones have a far lower loss
    loss = np.where(cs.included, 0.01, 3.0) + rng.normal(0, 0.01, 1000)
    obs = write_input_observations(tmp_path / "obs.json", out, losses=loss)
    claim = _claim(level)
    eps = claim["claimed_epsilon"]
    res = O.audit_outside(out, obs, claim)
    assert (
        res["verdict"] == "leaks more than claimed"
        and res["epsilon_lb"] > 1.5 * res["allowed_epsilon"]
    )
    if level == "client":  # one record changes one client's data: 2ε, (1 + e^ε)δ
        assert res["allowed_epsilon"] == pytest.approx(2 * eps)
        assert res["delta_bound"] == pytest.approx((1 + np.exp(eps)) * 1e-5)
    else:
        assert res["allowed_epsilon"] == eps and res["delta_bound"] == 1e-5
    # losses that say nothing: consistent, but input canaries (one loss each after training)
    # test neither the noise nor the clipping, nor what ran against the claim: incomplete
    obs = write_input_observations(tmp_path / "obs2.npz", out, losses=rng.normal(size=1000))
    res = O.audit_outside(out, obs, claim)
    assert res["verdict"] == "incomplete" and res["epsilon_lb"] < eps and O.exit_code(res) == 4
    assert {"noise", "clipping", "accounting"} <= set(res["coverage"]["untested"])
    assert "no per-step release" in res["coverage"]["why"]["noise"]
