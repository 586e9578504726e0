"""A released adapter is reloaded with the pooling it was trained with (the manifest's
model block), so the attacks score the model that was trained."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attacks.signals import adapter_pooling, load_adapter_model, model_logits
from fl.data.datasets import load_dataset, split_dataset
from fl.models.base import load_tokenizer
from fl.run.engine import train
from fl.testing import tiny_config


def test_mean_pooled_run_reloads_with_mean_pooling(tmp_path):
    cfg = tiny_config(pooling="mean", lora_layers=1, rounds=1)
    out = tmp_path / "run"
    man = train(cfg, out, quiet=True)
    assert man["model"]["pooling"] == "mean"
    assert adapter_pooling(out / "adapter") == "mean"
    assert adapter_pooling(out / "release" / "adapter") == "mean"
    assert adapter_pooling(tmp_path) == "cls"  # no manifest beside it: a foreign adapter
    ds = load_dataset(cfg.dataset)
    split = split_dataset(len(ds), cfg.members, cfg.nonmembers, cfg.test, cfg.seed)
    texts = [ds.texts[i] for i in split.test]
    labels = ds.labels[split.test]
    model = load_adapter_model(out / "adapter", cfg.model, 2, seed=cfg.seed)
    logits = model_logits(model, load_tokenizer(cfg.model), texts, cfg.max_length, "cpu")
    acc = float(np.mean(logits.argmax(-1) == labels))
    assert acc == man["metrics"]["final"]["accuracy"]
    # the same adapter read through a CLS pooler is a different model
    wrong = load_adapter_model(out / "adapter", cfg.model, 2, seed=cfg.seed, pooling="cls")
    other = model_logits(wrong, load_tokenizer(cfg.model), texts, cfg.max_length, "cpu")
    assert not np.allclose(logits, other, atol=1e-4)
    assert json.loads((out / "manifest.json").read_text())["model"]["pooling"] == "mean"


@pytest.mark.parametrize("top_layers", [None, 1])
def test_model_logits_sorted_batches_equal_one_text_at_a_time(top_layers):
    """model_logits batches texts shortest first and puts the logits back in the
    texts' order: each row equals the text scored alone (no padding at all). With LoRA
    on the top layer only, it runs over the frozen-prefix cache, built once per process
    for these texts."""
    import torch

    from attacks import signals
    from fl.models.base import LoraSpec, load_base_model, wrap_lora

    net = load_base_model("tiny-bert", 2, seed=0, pooling="mean", head_init="random")
    model = wrap_lora(net, LoraSpec(4, 8.0, top_layers=top_layers), seed=0).eval()
    with torch.no_grad():  # non-zero B: the adapter changes the logits
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    tok = load_tokenizer("tiny-bert")
    texts = [
        "a much longer sentence that goes on and on about nothing in particular",
        "short",
        "the cat sat on the mat",
        "yes",
        "federated learning with differential privacy and adapters",
    ] * 3
    got = model_logits(model, tok, texts, 24, "cpu", batch_size=4)
    with torch.no_grad():
        ref = np.concatenate(
            [
                model(**tok([t], truncation=True, max_length=24, return_tensors="pt"))
                .logits.float()
                .numpy()
                for t in texts
            ]
        )
    assert got.shape == (len(texts), 2)
    assert np.allclose(got, ref, atol=1e-5)
    via_prefix = signals._prefix_logits(model, tok, texts, 24, "cpu", 4)
    assert (via_prefix is None) == (top_layers is None)
    assert model_logits(model, tok, [], 24, "cpu").shape == (0, 2)
