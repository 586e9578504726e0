"""Pooling, zero-init heads, separate learning rates and the frozen-prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl.data.tokenized import TokenizedData
from fl.models.base import LoraSpec, load_base_model, load_tokenizer, resolve_pooling, wrap_lora
from fl.models.heads import BertClassifier, FrozenPrefix, folder_pooling, mean_pool

TEXTS = [
    "the cat sat on the mat",
    "a much longer sentence that goes on and on about nothing in particular at all",
    "short",
    "federated learning with differential privacy",
    "yes",
    "another example of moderate length here",
]


def _data(n_rep: int = 1) -> TokenizedData:
    texts = TEXTS * n_rep
    labels = np.arange(len(texts)) % 2
    return TokenizedData(texts, labels, load_tokenizer("minilm"), 32)


def test_mean_pool_matches_a_loop():
    torch.manual_seed(0)
    h = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    got = mean_pool(h, mask)
    for b in range(3):
        rows = [h[b, t] for t in range(5) if mask[b, t]]
        assert torch.allclose(got[b], sum(rows) / len(rows), atol=1e-6)


def test_pooling_defaults_come_from_the_model_folder(tmp_path):
    assert resolve_pooling("minilm", "auto") == "mean"
    assert resolve_pooling("tiny-bert", "auto") == "cls"
    assert resolve_pooling("minilm", "cls") == "cls"
    assert folder_pooling(tmp_path) == "cls"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    assert folder_pooling(tmp_path) == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text("not json")
    assert folder_pooling(tmp_path) == "cls"


def test_zero_head_and_random_head():
    z = load_base_model("tiny-bert", 3, seed=0)
    assert (
        float(z.classifier.weight.detach().abs().sum()) == 0.0
        and float(z.classifier.bias.detach().abs().sum()) == 0.0
    )
    r = load_base_model("tiny-bert", 3, seed=0, head_init="random")
    assert float(r.classifier.weight.detach().abs().sum()) > 0.0


def test_cls_pooling_equals_hugging_face_head():
    """Our forward with pooling cls computes Hugging Face's BertForSequenceClassification."""
    from transformers import BertForSequenceClassification

    net = load_base_model("tiny-bert", 2, seed=0, head_init="random").eval()
    ref = BertForSequenceClassification(net.config).eval()
    ref.load_state_dict(net.state_dict())
    b = _data().batch(torch.arange(len(TEXTS)), "cpu")
    b.pop("labels")
    assert torch.allclose(net(**b).logits, ref(**b).logits, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("frozen_encoder", [False, True])
def test_prefix_cache_gives_the_uncached_outputs_and_gradients(pooling, frozen_encoder):
    """Training-mode logits and the trainable parameters' gradients agree with and
    without the cache (the frozen prefix runs without dropout in both)."""

    def build():
        net = load_base_model("tiny-bert", 2, seed=0, pooling=pooling, head_init="random")
        model = wrap_lora(net, LoraSpec(4, 8.0, top_layers=1), seed=0)
        with torch.no_grad():  # non-zero B so that the LoRA path matters
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        return model, net

    outs = []
    for use_cache in (False, True):
        model, net = build()
        prefix = FrozenPrefix(model, net, frozen_encoder=frozen_encoder, use_cache=use_cache)
        assert prefix.depth == (2 if frozen_encoder else 1)
        data = _data(2)
        if frozen_encoder:
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.requires_grad_(False)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.zero_()
            prefix = FrozenPrefix(model, net, frozen_encoder=True, use_cache=use_cache)
        prefix.check(data)
        assert (data.cache is not None) == use_cache
        model.train()
        net.dropout.p = 0.0  # the head's own dropout is random: off for the comparison
        for layer in net.bert.encoder.layer[prefix.depth :]:
            for m in layer.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        b = data.batch(torch.tensor([0, 1, 2, 7, 9]), "cpu")
        labels = b.pop("labels")
        assert ("input_ids" in b) != use_cache
        logits = model(**b).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((logits.detach(), grads))
    (l0, g0), (l1, g1) = outs
    assert torch.allclose(l0, l1, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-5), k


def test_prefix_guard_refuses_changed_factors_below_the_cut():
    net = load_base_model("tiny-bert", 2, seed=0)
    model = wrap_lora(net, LoraSpec(4, 8.0), seed=0)
    prefix = FrozenPrefix(model, net, frozen_encoder=True, use_cache=True)
    assert prefix.kind == "features" and prefix.depth == 2
    data = _data()
    prefix.check(data)
    assert data.cache.shape == (len(TEXTS), 64)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    with pytest.raises(RuntimeError, match="below the frozen cut"):
        prefix.check(data)


def test_frozen_prefix_has_no_dropout_in_train_mode():
    net = load_base_model("tiny-bert", 2, seed=0)
    assert isinstance(net, BertClassifier)
    net.set_frozen_depth(1)
    net.train()
    assert not net.bert.embeddings.training and not net.bert.encoder.layer[0].training
    assert net.bert.encoder.layer[1].training and net.classifier.training


def test_encoded_data_is_reused_only_for_the_same_prefix_and_ids():
    net = load_base_model("tiny-bert", 2, seed=0)
    model = wrap_lora(net, LoraSpec(4, 8.0, top_layers=1), seed=0)
    prefix = FrozenPrefix(model, net, frozen_encoder=False, use_cache=True)
    a = prefix.encode_cached(_data())
    assert prefix.encode_cached(_data()) is a  # the same ids: reused
    assert torch.equal(a, prefix.encode(_data()))  # and bit-identical to encoding again
    assert prefix.encode_cached(_data(2)) is not a  # other ids
    net2 = load_base_model("tiny-bert", 2, seed=1)  # other frozen weights
    model2 = wrap_lora(net2, LoraSpec(4, 8.0, top_layers=1), seed=1)
    other = FrozenPrefix(model2, net2, frozen_encoder=False, use_cache=True)
    assert other.fingerprint() != prefix.fingerprint()
    assert not torch.equal(other.encode_cached(_data()), a)
