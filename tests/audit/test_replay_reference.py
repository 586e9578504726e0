"""The job's client-local replay without a reference pass (``dropout = "off"``): a training
free of dropout is its own reference, so each neighbour costs one retraining of its client.

The shortcut is sound only if a pass on D would give back exactly what the training
recorded; the first test checks that bit for bit against the reference pass it replaces,
the others that the one-pass replay still sees what the reference pass saw.
"""

import pytest
import torch

from audit.replay.engine import replay_recorded
from audit.replay.record import Recorder
from fl.errors import UsageError
from fl.models.base import active_dropout, dropout_off
from fl.privacy import tap
from fl.testing import tiny_config


def _recorded(root, name, **kw):
    from fl.run.engine import train

    # two local steps, not TINY's four: a round still chains steps, and every replay
    # pass retrains the client
    cfg = tiny_config(
        **{"dp_level": "sample", "noise_multiplier": 1.0, "dropout": "off", "local_steps": 2} | kw
    )
    rec = Recorder()
    rec.keep_deliveries = True
    with tap.tapped(rec):
        train(cfg, root / name, quiet=True)
    return cfg, rec, root / name


@pytest.mark.parametrize("level", ["sample", "client"])
def test_a_dropout_free_training_is_its_own_reference(tmp_path, level):
    cfg, rec, run = _recorded(tmp_path, level, dp_level=level)
    recorded = [{k: v.clone() for k, v in r.value.items()} for r in rec.releases]
    one = replay_recorded(cfg, run, rec, kinds=("remove",))
    assert one["reference"] == "the recorded training (no dropout)"
    assert list(one["seconds"]) == ["N0"]  # one pass: the neighbour's
    both = replay_recorded(cfg, run, rec, kinds=("remove",), reference="always")
    assert both["reference"] == "a pass on D, dropout off"
    # the reference pass adopted its own q(D): bit for bit what the training recorded
    assert len(recorded) == len(rec.releases) > 0
    for r, v in zip(rec.releases, recorded, strict=True):
        assert set(r.value) == set(v) and all(torch.equal(r.value[k], v[k]) for k in v)
    assert one["verdict"] == both["verdict"] == "pass", (one["findings"], both["findings"])
    assert one["neighbours"][0]["comparison"] == both["neighbours"][0]["comparison"]
    assert one["neighbours"][0]["public_diffs"] == both["neighbours"][0]["public_diffs"] == []


def test_one_pass_still_sees_unclipped_records_and_data_dependent_releases(tmp_path, monkeypatch):
    from fl.run.engine import Engine

    # one round each: an unclipped record and the leaked metric are in every round's
    # releases (the two-round trajectory is the first test's)
    cfg, rec, run = _recorded(tmp_path, "no_clip", inject_fault="no_clip", rounds=1)
    res = replay_recorded(cfg, run, rec, kinds=("remove",))
    assert res["reference"] == "the recorded training (no dropout)"
    assert res["verdict"] == "fail"
    assert {f["code"] for f in res["findings"]} == {"sensitivity_exceeded"}

    # a planted leak: the number of training records published as a public metric, unnoised
    append = Engine._append_metrics

    def leaky(self, row):
        append(self, dict(row, loss=float(sum(map(len, self.client_positions.values())))))

    monkeypatch.setattr(Engine, "_append_metrics", leaky)
    cfg, rec, run = _recorded(tmp_path, "leaky", rounds=1)
    res = replay_recorded(cfg, run, rec, kinds=("remove",))
    assert res["reference"] == "the recorded training (no dropout)"
    assert res["verdict"] == "fail"
    assert "data_dependent_release" in {f["code"] for f in res["findings"]}
    diffs = res["neighbours"][0]["public_diffs"]
    # the leaked field, nothing else: the recorded run and the pass on D′ agree elsewhere
    assert diffs and all(d.endswith(".loss") for d in diffs), diffs


def test_a_training_with_dropout_gets_its_reference_pass(tmp_path):
    # one round: which reference the replay takes depends on the configuration only
    cfg, rec, run = _recorded(tmp_path, "model", dropout="model", rounds=1)
    res = replay_recorded(cfg, run, rec, kinds=("remove",))
    assert res["reference"] == "a pass on D, dropout off"
    assert res["verdict"] == "pass", res["findings"]
    with pytest.raises(ValueError, match="reference must be"):
        replay_recorded(cfg, run, rec, kinds=("remove",), reference="never")


def test_dropout_off_reaches_every_dropout_and_refuses_lora_dropout():
    from fl.run.trainer import LocalTrainer

    on = LocalTrainer(tiny_config(), 2, torch.device("cpu"), frozen_encoder=False)
    assert active_dropout(on.model)  # tiny-bert's config drops out (hidden, attention)
    off = LocalTrainer(tiny_config(dropout="off"), 2, torch.device("cpu"), frozen_encoder=False)
    assert active_dropout(off.model) == []
    with pytest.raises(UsageError, match="lora_dropout must be 0"):
        tiny_config(dropout="off", lora_dropout=0.1).validate()
    with pytest.raises(UsageError, match="dropout"):
        tiny_config(dropout="sometimes").validate()

    class Attention(torch.nn.Module):  # Llama's and Qwen2's: a float handed to sdpa
        def __init__(self):
            super().__init__()
            self.attention_dropout = 0.1
            self.drop = torch.nn.Dropout(0.2)
            self.kept = torch.nn.Dropout(0.0)

    m = torch.nn.Sequential(Attention())
    assert active_dropout(m) == ["0", "0.drop"]
    assert dropout_off(m) == 2
    assert active_dropout(m) == [] and m[0].attention_dropout == 0.0 and m[0].drop.p == 0.0
