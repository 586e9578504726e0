"""A foreign adapter (trained elsewhere): shadows copy its LoRA and head pooling, one-label
candidate files are pooled, format errors name the files, and loading a causal-LM adapter
prints no transformers FutureWarning."""

import json
import warnings

import numpy as np
import pytest
import torch

from attacks.target import Target
from fl.errors import UsageError


def _adapter(d, **cfg):
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    doc = {"peft_type": "LORA", "task_type": "SEQ_CLS", "r": 4, "lora_alpha": 8,
           "lora_dropout": 0.1, "target_modules": ["value", "query"], **cfg}  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(doc))
    head = "base_model.model.classifier.modules_to_save.default.weight"
    save_file({head: torch.zeros(2, 384)}, str(d / "adapter_model.safetensors"))
    return d


def _rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def files(tmp_path):
    mem = _rows(tmp_path / "m.jsonl", [{"text": f"a {i}", "label": 1} for i in range(3)])
    non = _rows(tmp_path / "n.jsonl", [{"text": f"b {i}", "label": 0} for i in range(3)])
    return mem, non


@pytest.mark.parametrize("layers, expect", [([5], 1), ([3, 4, 5], 3), (None, 0), ([4], 2)])
def test_shadows_copy_the_adapters_lora_and_pooling(tmp_path, files, layers, expect):
    ad = _adapter(tmp_path / "ad", layers_to_transform=layers)
    t = Target.from_adapter(ad, "minilm", *files, max_length=32)
    s = t.shadow_config
    # a Hugging Face classification head reads the CLS pooler (minilm's own default is mean)
    assert s.pooling == "cls"
    assert s.lora_layers == expect  # the top layers down to the lowest adapted one
    assert (s.rank, s.alpha, s.lora_dropout) == (4, 8.0, 0.1)
    assert s.target_modules == "query,value"
    # --shadow-config still wins
    t2 = Target.from_adapter(ad, "minilm", *files, max_length=32,
                             shadow_config={"pooling": "mean", "lora_layers": 2})  # fmt: skip
    assert (t2.shadow_config.pooling, t2.shadow_config.lora_layers) == ("mean", 2)


def test_one_label_per_file_is_pooled(tmp_path, files):
    ad = _adapter(tmp_path / "ad")
    t = Target.from_adapter(ad, "minilm", *files, max_length=32)
    assert t.labels.tolist() == [1, 1, 1, 0, 0, 0] and t.num_labels == 2
    same = _rows(tmp_path / "s.jsonl", [{"text": "c", "label": 1}])
    with pytest.raises(UsageError, match="at least 2 distinct labels across the member and non"):
        Target.from_adapter(ad, "minilm", files[0], same, max_length=32)


def test_text_and_label_columns(tmp_path):
    ad = _adapter(tmp_path / "ad")
    m = _rows(tmp_path / "m.jsonl", [{"tweet": "x", "y": "pos"}, {"tweet": "z", "y": "neg"}])
    n = _rows(tmp_path / "n.jsonl", [{"tweet": "w", "y": "pos"}])
    t = Target.from_adapter(ad, "minilm", m, n, max_length=32, text_column="tweet",
                            label_column="y")  # fmt: skip
    assert t.texts == ("x", "z", "w") and t.labels.tolist() == [1, 0, 1]


def test_mixed_formats_name_each_file(tmp_path):
    ad = _adapter(tmp_path / "ad", task_type="CAUSAL_LM", target_modules=["c_attn"])
    m = _rows(tmp_path / "plain.jsonl", [{"text": "hello"}])
    n = _rows(tmp_path / "instr.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(UsageError) as e:
        Target.from_adapter(ad, "tiny-gpt2", m, n, max_length=32)
    msg = str(e.value)
    assert f"{m} is text" in msg and f"{n} is prompt/response" in msg, msg


def test_causal_adapter_loads_without_future_warning(tmp_path):
    from peft import LoraConfig, get_peft_model

    from attacks.lm_target import lm_adapter_signals
    from fl.models.causal_lm import load_causal_lm

    net = load_causal_lm("tiny-gpt2", seed=0)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # making the adapter is not under test
        get_peft_model(net, cfg).save_pretrained(str(tmp_path / "lm"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pytest's ini filter would hide it otherwise
        sig = lm_adapter_signals(tmp_path / "lm", "tiny-gpt2", ["one two", "three"], None, 16,
                                 device="cpu", seed=0, extras=False)  # fmt: skip
    assert np.isfinite(sig.loss).all()
    bad = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert not bad, [str(w.message) for w in bad]
