"""--task causal-lm under every registered method and DP level it allows (tiny-gpt2's
GPT-2 with a small vocabulary, one or two rounds), Llama/Qwen layouts (tiny random
configs) and ``fedlora base pretrain`` on a slice of the corpus."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl.data.lm import LmTokenizedData
from fl.errors import UsageError
from fl.methods import registry
from fl.models.base import LoraSpec, load_tokenizer, wrap_lora
from fl.models.causal_lm import load_causal_lm, token_logprobs
from fl.run.engine import train
from fl.testing import tiny_lm_config

#: per-method settings a run needs (heterogeneous ranks)
EXTRA = {"flexlora": dict(client_ranks_list="2,4"), "hetlora": dict(client_ranks_list="2,4")}
CASES = [
    (name, level)
    for name in registry.names()
    if name != "probe"
    for level in registry.get(name).dp_levels
]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    """tiny-gpt2's model (its config, ``fl.models.causal_lm.tiny_gpt2_lm``: GPT-2 of width
    64, 2 layers, LoRA on the Conv1D ``c_attn``) saved as a folder with a 300-token
    byte-level BPE tokenizer, as ``fedlora base pretrain`` writes one, rather than with
    MiniLM's 30,522 tokens: the vocabulary's projection took most of each run (a case
    trains in a quarter of the time), and nothing a case checks (the method's rounds at its
    DP level, a finite loss and factors, the audit's ε) depends on the vocabulary. The
    built-in tiny-gpt2 (seeded random init, MiniLM tokenizer) is trained by
    tests/fl/test_causal_lm.py and tests/attacks/test_lm_attack.py."""
    from transformers import GPT2LMHeadModel

    from fl.models.causal_lm import tiny_gpt2_lm
    from fl.models.decoders import default_texts
    from fl.models.pretrain import EOT, train_tokenizer

    tok = train_tokenizer(default_texts(), 300)
    config = tiny_gpt2_lm(len(tok))
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tok.convert_tokens_to_ids(EOT)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2") / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def test_every_method_is_covered_and_the_head_only_probe_is_refused(tmp_path):
    assert {n for n, _ in CASES} | {"probe"} == set(registry.names())
    with pytest.raises(UsageError, match="classification head"):
        train(tiny_lm_config(method="probe"), tmp_path / "probe", quiet=True)


@pytest.mark.parametrize("method,level", CASES, ids=lambda v: str(v))
def test_every_method_trains_a_causal_lm(gpt2, tmp_path, method, level):
    kw = dict(EXTRA.get(method, {}), model=gpt2)
    if level != "none":
        kw.update(dp_level=level, noise_multiplier=1.0, insecure_deterministic_noise=True)
    if level == "client":
        kw.update(clip=0.5)
    man = train(tiny_lm_config(method=method, **kw), tmp_path / "r", quiet=True)
    assert man["model"]["task"] == "causal-lm" and man["privacy"]["level"] == level
    final = man["metrics"]["final"]
    assert math.isfinite(final["loss"]) and final["perplexity"] == pytest.approx(
        math.exp(final["loss"])
    )
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "r" / "adapter" / "adapter_model.safetensors"))
    assert flat and all("lora_" in k for k in flat)  # LoRA factors only, no head
    assert all(torch.isfinite(t).all() for t in flat.values())
    if level != "none":
        from audit.bundle.audit import audit_run

        res = audit_run(tmp_path / "r")
        eps = man["privacy"]["epsilon"]["pld"]
        assert eps > 0
        assert res["recomputed"]["config"]["pld"] == pytest.approx(eps, rel=1e-6)
        assert res["recomputed"]["ledger"]["pld"] == pytest.approx(eps, rel=1e-6)


def _tiny_folder(tmp_path, kind: str):
    """A random-init Llama, Qwen2 or Mistral causal LM saved as a Hugging Face folder (with the
    MiniLM tokenizer, whose vocabulary it uses)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = load_tokenizer("tiny-gpt2")
    common = dict(
        # transformers picks the tokenizer class of the model type (Qwen2's adds an
        # <|endoftext|> token to the saved vocabulary): leave room for added tokens
        vocab_size=tok.vocab_size + 8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    net = model_cls(config_cls(**common))
    path = tmp_path / kind
    net.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_llama_and_qwen_layouts_get_q_and_v_targets(tmp_path, kind):
    path = _tiny_folder(tmp_path, kind)
    net = load_causal_lm(path)
    model = wrap_lora(net, LoraSpec(4, 8.0, top_layers=1))
    lora = sorted({n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_" in n})
    assert lora == [
        "base_model.model.model.layers.1.self_attn.q_proj",
        "base_model.model.model.layers.1.self_attn.v_proj",
    ]
    tok = load_tokenizer(path)
    data = LmTokenizedData(["hello world", "a b c"], tok, 16)
    lps = token_logprobs(model, data, batch_size=2)
    assert all(len(a) == int(t) for a, t in zip(lps, data.targets))


def test_a_llama_folder_trains_with_sample_level_dp(tmp_path):
    path = _tiny_folder(tmp_path, "llama")
    cfg = tiny_lm_config(
        model=path, noise_multiplier=1.0, insecure_deterministic_noise=True, lora_layers=1
    )
    man = train(cfg, tmp_path / "run", quiet=True)
    assert man["privacy"]["epsilon"]["pld"] > 0
    with pytest.raises(UsageError, match="exceeds the model's context"):
        train(tiny_lm_config(model=path, max_length=65), tmp_path / "long", quiet=True)


def test_base_pretrain_writes_a_folder_that_train_accepts(tmp_path):
    from pipeline.cli import main

    out = tmp_path / "base"
    rc = main(
        [
            "base",
            "pretrain",
            "--out",
            str(out),
            "--max-docs",
            "24",
            "--vocab-size",
            "400",
            "--n-embd",
            "32",
            "--n-layer",
            "2",
            "--n-head",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--steps",
            "3",
            "--no-progress",
        ]
    )
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "fedlora_base.json"} <= names
    info = json.loads((out / "fedlora_base.json").read_text())
    assert info["parameters"] == sum(p.numel() for p in load_causal_lm(str(out)).parameters())
    assert info["test_perplexity"] == pytest.approx(math.exp(info["test_loss"]))
    assert info["train_documents"] + info["test_documents"] == 24
    tok = load_tokenizer(str(out))
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"
    assert tok.decode(tok("The economy grew.")["input_ids"]) == "The economy grew."
    man = train(
        tiny_lm_config(model=str(out), dataset="tweets", members=40, max_length=32),
        tmp_path / "run",
        quiet=True,
    )
    assert man["model"]["task"] == "causal-lm" and math.isfinite(man["metrics"]["final"]["loss"])
    log = (tmp_path / "run" / "run.log").read_text()
    assert "pretrained on" not in log  # tweets are not the pretraining corpus
    train(
        tiny_lm_config(model=str(out), dataset="bbc", members=20, max_length=32),
        tmp_path / "bbc",
        quiet=True,
    )
    assert "pretrained on 'bbc'" in (tmp_path / "bbc" / "run.log").read_text()
    assert main(["base", "pretrain", "--out", str(out), "--steps", "1", "--no-progress"]) == 2
