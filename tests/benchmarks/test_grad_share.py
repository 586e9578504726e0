"""benchmarks.perf.grad_share: the head's per-example gradient norm against its closed form
(a linear softmax head: ‖∂L/∂W‖² + ‖∂L/∂b‖² = ‖p − y‖²(‖h‖² + 1) for pooled features h)."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.perf.grad_share import gradient_norms, main
from fl.run.engine import train
from fl.testing import tiny_config


def test_head_norms_match_the_closed_form_and_lora_share_is_a_fraction(tmp_path, capsys):
    from attacks.rundata import load_run
    from attacks.signals import load_adapter_model
    from fl.models.base import load_tokenizer

    cfg = tiny_config(pooling="mean", lora_layers=1, rounds=1, lr=0.05)
    out = tmp_path / "run"
    train(cfg, out, quiet=True)
    res = gradient_norms(str(out), examples=6)
    assert res["examples"] == 6 and len(res["head"]) == 6
    # closed form, from the pooled features the classifier reads
    rd = load_run(out)
    model = load_adapter_model(out / "adapter", cfg.model, 2, seed=cfg.seed)
    tok = load_tokenizer(cfg.model)
    clf = [m for n, m in model.named_modules() if n.endswith("modules_to_save.default")][0]
    feats = []
    clf.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    for k, i in enumerate(np.where(rd.role == "member")[0][:6]):
        enc = tok(rd.texts[i], truncation=True, max_length=cfg.max_length, return_tensors="pt")
        with torch.no_grad():
            p = torch.softmax(model(**enc).logits.double(), -1)[0]
        y = torch.nn.functional.one_hot(torch.tensor(int(rd.labels[i])), 2).double()
        h = feats[-1][0].double()
        want = float((p - y).norm() * (h.pow(2).sum() + 1).sqrt())
        assert abs(res["head"][k] - want) <= 1e-4 * max(want, 1e-3)
    s = res["summary"]
    assert 0.0 <= s["lora_share_of_squared_norm_median"] <= 1.0
    assert s["lora_norm_median"] > 0  # a trained head sends gradient into the factors
    assert 0.0 < s["head_kept_by_joint_clip_median"] <= 1.0
    assert main([str(out), "--examples", "3"]) == 0
    assert "lora_share_of_squared_norm_median" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run directory not found" in err[0]
