"""Llama and Qwen2 folders end to end (issue #48): tiny random decoders built from configs
(GQA, tied embeddings, RoPE, RMSNorm, a byte-level BPE tokenizer, safetensors) and loaded
by ``--model DIR`` as a user's checkpoint; per-example gradients against batch-size-1
autograd; every LoRA-training method at the DP levels it allows; classification heads
(``score``); the adapters under ``peft.PeftModel.from_pretrained`` on the original folder;
per-example gradient memory of the adapter, not of the base model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl.data.lm import LmTokenizedData
from fl.data.tokenized import TokenizedData
from fl.methods import registry
from fl.models.base import LoraSpec, head_module, load_base_model, load_tokenizer, wrap_lora
from fl.models.causal_lm import load_causal_lm, sequence_loss_sum
from fl.models.decoders import DecoderShape, decoder_shape, write_decoder_folder
from fl.run.engine import train
from fl.testing import tiny_config, tiny_lm_config

KINDS = ("llama", "qwen2")
SHAPE = DecoderShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, context=64)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the methods that train LoRA factors (issue #48's list) and their extra settings
METHODS = ("fedavg", "ffa", "fedsa", "fedask", "fedpower", "plora", "flora", "flexlora", "hetlora")
EXTRA = {"flexlora": dict(client_ranks_list="2,4"), "hetlora": dict(client_ranks_list="2,4")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    tok = None
    out = {}
    for kind in KINDS:
        info = write_decoder_folder(root / kind, kind, SHAPE, vocab_size=300, tokenizer=tok)
        tok = tok or load_tokenizer(info["path"])
        out[kind] = info["path"]
    return out


def _perturb_b(model, seed=3):
    """B = 0 at init: give every LoRA B a value so that every factor has a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_is_an_ordinary_checkpoint_with_gqa_tied_embeddings(folders, kind):
    path = folders[kind]
    cfg = json.loads(open(f"{path}/config.json").read())
    assert cfg["model_type"] == kind and cfg["tie_word_embeddings"] is True
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    names = set(__import__("os").listdir(path))
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= names
    net = load_causal_lm(path)
    assert net.lm_head.weight is net.model.embed_tokens.weight  # tied after loading
    assert type(net.model.norm).__name__.endswith("RMSNorm")
    tok = load_tokenizer(path)
    text = "w3 w17 c1m3 hello, world"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless
    assert len(tok) <= net.config.vocab_size


def _per_example_reference(model, loss_fn, batch, lengths, params):
    """Each example's gradient alone (batch of one, its own length: no padding)."""
    out = []
    for i in range(len(lengths)):
        n = int(lengths[i])
        model.zero_grad()
        one = {k: v[i : i + 1, :n] if v.dim() == 2 else v[i : i + 1] for k, v in batch.items()}
        labels = one.pop("labels")
        loss_fn(model(**one).logits, labels).backward()
        out.append([p.grad.detach().clone() for p in params])
    return out


def _check_grad_samples(model, loss_fn, batch, lengths):
    from opacus import GradSampleModule

    params = [p for p in model.parameters() if p.requires_grad]
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    inputs = dict(batch)
    labels = inputs.pop("labels")
    loss_fn(gsm(**inputs).logits, labels).backward()
    per = [p.grad_sample.detach().clone() for p in params]
    gsm.disable_hooks()
    for p in params:
        p.grad_sample = None
    ref = _per_example_reference(model, loss_fn, batch, lengths, params)
    gsm.remove_hooks()
    for i, grads in enumerate(ref):
        for g, r in zip(per, grads):
            torch.testing.assert_close(g[i], r, rtol=1e-4, atol=1e-6)
    return params


@pytest.mark.parametrize("kind", KINDS)
def test_per_example_gradients_of_every_linear_equal_batch_of_one_autograd(folders, kind):
    """GQA (k/v projections narrower than q), RoPE, RMSNorm and the tied LM head under
    Opacus: the per-example gradient of each LoRA factor on every linear layer equals the
    gradient of that example's sequence loss alone, padding included."""
    path = folders[kind]
    model = wrap_lora(load_causal_lm(path), LoraSpec(4, 8.0, target_modules=ALL_LINEAR), seed=1)
    _perturb_b(model)
    tok = load_tokenizer(path)
    data = LmTokenizedData(["w1 w2 w3 w4 w5 w6", "w7", "w9 w10"], tok, 24)
    batch = data.batch(torch.arange(3), "cpu")
    assert len(set(data.lengths.tolist())) == 3  # different lengths: padding is exercised
    params = _check_grad_samples(model, sequence_loss_sum, batch, data.lengths)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(lora) == 2 * len(ALL_LINEAR) * SHAPE.layers and all("lora_" in n for n in lora)
    v_b = [p for n, p in model.named_parameters() if "v_proj.lora_B" in n][0]
    assert v_b.shape[0] == SHAPE.hidden // SHAPE.heads * SHAPE.kv_heads  # GQA: narrower v
    assert len(params) == len(lora)


@pytest.mark.parametrize("kind", KINDS)
def test_per_example_gradients_of_the_score_head_and_lora(folders, kind):
    """Sequence classification on the same folder: LoRA factors and the ``score`` head
    (last non-pad token pooling) per example against batch-of-one autograd."""
    path = folders[kind]
    net = load_base_model(path, 2, head_init="random")
    assert head_module(net) is net.score
    model = wrap_lora(net, LoraSpec(4, 8.0))
    _perturb_b(model)
    tok = load_tokenizer(path)
    data = TokenizedData(
        ["w1 w2 w3", "w4 w5 w6 w8 w9", "c1m3 w7"], torch.tensor([0, 1, 1]), tok, 16
    )
    batch = data.batch(torch.arange(3), "cpu")

    def ce(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")

    _check_grad_samples(model, ce, batch, data.lengths)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".score." in n for n in trained) and any(".lora_A" in n for n in trained)


def _method_cases():
    cases = []
    for i, name in enumerate(METHODS):
        levels = [lv for lv in registry.get(name).dp_levels if lv != "none"]
        for j, level in enumerate(levels):
            cases.append((KINDS[(i + j) % 2], name, level))
    return cases


@pytest.mark.parametrize("kind,method,level", _method_cases(), ids=lambda v: str(v))
def test_every_lora_method_trains_the_folder_at_each_dp_level(
    folders, tmp_path, kind, method, level
):
    kw = dict(EXTRA.get(method, {}))
    kw.update(dp_level=level, noise_multiplier=1.0, insecure_deterministic_noise=True)
    if level == "client":
        kw.update(clip=0.5)
    man = train(
        tiny_lm_config(model=folders[kind], method=method, **kw), tmp_path / "r", quiet=True
    )
    assert man["privacy"]["level"] == level and man["privacy"]["epsilon"]["pld"] > 0
    assert math.isfinite(man["metrics"]["final"]["loss"])


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def test_causal_lm_adapter_loads_with_peft_on_the_original_folder(folders, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fl.run.engine import Engine

    path = folders["qwen2"]
    cfg = tiny_lm_config(model=path, noise_multiplier=1.0, insecure_deterministic_noise=True)
    eng = Engine(cfg, tmp_path / "lm", quiet=True)
    eng.run()
    base = AutoModelForCausalLM.from_pretrained(path)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "lm" / "adapter")).eval()
    batch = eng.test_data.batch(torch.arange(len(eng.test_data)), "cpu")
    batch.pop("labels")
    a = _logits(eng.trainer.model.eval(), batch)
    assert torch.max((a - _logits(peft_model, batch)).abs()) <= 1e-5
    adapter_cfg = json.loads((tmp_path / "lm" / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["target_modules"] == ["q_proj", "v_proj"]  # sorted: see below


def test_the_adapter_config_is_written_the_same_in_every_process(tmp_path):
    """peft writes ``target_modules`` in a set's order, which depends on the process's
    hash seed: a replay in another process (``fedlora audit --key --neighbours``) found
    ``release_mismatch`` on half of the runs. The engine sorts it after saving."""
    from fl.run.files import canonical_adapter_config

    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"r": 4, "target_modules": ["v_proj", "q_proj"]}, indent=2))
    canonical_adapter_config(path)
    assert json.loads(path.read_text()) == {"r": 4, "target_modules": ["q_proj", "v_proj"]}


def test_classification_on_the_folder_trains_the_score_head_and_loads_with_peft(folders, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from fl.run.engine import Engine

    path = folders["llama"]
    cfg = tiny_config(
        model=path,
        members=60,
        nonmembers=20,
        test=20,
        max_length=16,
        local_steps=2,
        rounds=1,
        batch_size=8,
        noise_multiplier=1.0,
        insecure_deterministic_noise=True,
    )
    eng = Engine(cfg, tmp_path / "cls", quiet=True)
    man = eng.run()
    assert man["privacy"]["level"] == "sample" and 0 <= man["metrics"]["final"]["accuracy"] <= 1
    flat = load_file(str(tmp_path / "cls" / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("score.weight") for k in flat) and any("q_proj.lora_A" in k for k in flat)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    base.config.pad_token_id = eng.trainer.model.config.pad_token_id
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "cls" / "adapter")).eval()
    batch = eng.test_data.batch(torch.arange(len(eng.test_data)), "cpu")
    batch.pop("labels")
    a = _logits(eng.trainer.model.eval(), batch)
    assert torch.max((a - _logits(peft_model, batch)).abs()) <= 1e-5


def test_per_example_gradient_memory_is_the_adapters_not_the_base_models(folders):
    """The engine's Opacus wrapper keeps per-example gradients of the trainable LoRA
    factors only: B × (adapter parameters) × 4 bytes, whatever the base's size."""
    from fl.run.config import TrainConfig  # noqa: F401 (the trainer's config type)
    from fl.run.trainer import LocalTrainer

    cfg = tiny_lm_config(model=folders["llama"])
    tr = LocalTrainer(cfg, 0, torch.device("cpu"))
    params = tr._set_trainable({"A", "B"})
    adapter = sum(p.numel() for p in params)
    base = sum(p.numel() for p in tr.model.parameters())
    tok = load_tokenizer(folders["llama"])
    data = LmTokenizedData(["a b c", "d e f g", "h"], tok, 16)
    batch = data.batch(torch.arange(3), "cpu")
    labels = batch.pop("labels")
    tr.gsm.enable_hooks()
    try:
        sequence_loss_sum(tr.gsm(**batch).logits, labels).backward()
        held = {
            n: p.grad_sample.nbytes
            for n, p in tr.model.named_parameters()
            if getattr(p, "grad_sample", None) is not None
        }
    finally:
        tr.gsm.disable_hooks()
        for p in tr.model.parameters():
            p.grad_sample = None
    assert held and all(".lora_" in n for n in held)
    assert sum(held.values()) == 3 * adapter * 4 < 3 * base * 4 / 10


def test_the_shape_family_keeps_gqa_and_grows_depth_with_width():
    small, big = decoder_shape(256), decoder_shape(1024)
    assert small.heads > small.kv_heads and big.heads > big.kv_heads
    assert (small.layers, big.layers) == (4, 16)
    assert small.intermediate % 32 == 0 and small.intermediate >= 8 * 256 / 3


def test_gradient_accumulation_releases_once_per_logical_step(folders, tmp_path):
    """``physical_batch``: a Poisson batch cut into passes of at most 3 examples gives the
    adapter of one pass per batch (to float rounding, the same seeded noise drawn once
    per logical step) and the same ledger."""
    common = dict(
        model=folders["llama"],
        noise_multiplier=1.0,
        insecure_deterministic_noise=True,
        length_buckets=False,
        batch_size=8,
    )
    from safetensors.torch import load_file

    mans, flats = [], []
    for cap in (0, 3):
        out = tmp_path / f"cap{cap}"
        mans.append(train(tiny_lm_config(physical_batch=cap, **common), out, quiet=True))
        flats.append(load_file(str(out / "adapter" / "adapter_model.safetensors")))
    assert mans[0]["privacy"]["ledger"] == mans[1]["privacy"]["ledger"]
    assert mans[0]["privacy"]["epsilon"] == mans[1]["privacy"]["epsilon"]
    for k, v in flats[0].items():
        torch.testing.assert_close(flats[1][k], v, rtol=1e-4, atol=1e-5)
    assert any(float(v.abs().max()) > 0 for k, v in flats[0].items() if "lora_B" in k)


def test_bf16_needs_a_device_that_runs_it():
    from fl.errors import UsageError
    from fl.models.causal_lm import bf16_supported, check_precision

    assert bf16_supported(torch.device("cpu"))
    check_precision(torch.device("cpu"), "bf16")
    if not torch.cuda.is_available():
        assert not bf16_supported(torch.device("cuda"))
        with pytest.raises(UsageError, match="does not support bf16"):
            check_precision(torch.device("cuda"), "bf16")
    check_precision(torch.device("cuda"), "fp32")  # fp32 runs anywhere


def test_physical_batch_cuts_each_pass_on_every_device_path(folders):
    from fl.run.trainer import LocalTrainer

    tok = load_tokenizer(folders["llama"])
    data = LmTokenizedData([f"w{i} " * (1 + i % 4) for i in range(8)], tok, 16)
    idx = torch.arange(8)
    for buckets in (False, True):
        cfg = tiny_lm_config(model=folders["llama"], physical_batch=3, length_buckets=buckets)
        parts = LocalTrainer(cfg, 0, torch.device("cpu"))._chunks(data, idx)
        assert max(len(p) for p in parts) <= 3
        assert sorted(torch.cat(parts).tolist()) == list(range(8))
    cfg = tiny_lm_config(model=folders["llama"], length_buckets=False)
    assert len(LocalTrainer(cfg, 0, torch.device("cpu"))._chunks(data, idx)) == 1


def test_fedlora_base_random_writes_a_folder_that_train_accepts(tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "q"
    flags = ["--hidden", "32", "--layers", "2", "--intermediate", "64", "--context", "64"]
    assert main(["base", "random", "--arch", "qwen2", *flags, "--vocab-size", "300",
                 "--out", str(out)]) == 0  # fmt: skip
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["kind"] == "qwen2" and info["vocab_size"] == 300
    man = train(tiny_lm_config(model=str(out)), tmp_path / "run", quiet=True)
    assert math.isfinite(man["metrics"]["final"]["loss"])
    for bad in (["--heads", "3"], ["--vocab-size", "10"], ["--layers", "0"]):
        assert main(["base", "random", *bad, "--out", str(tmp_path / "bad")]) == 2


def test_lm_membership_signals_and_client_level_mia_run_on_a_llama_run(folders, tmp_path, capsys):
    """The attacks read a Llama run as they read any causal-LM run: the loss and the LM
    signals (zlib, min-k, ...) per example, and the client-level loss attack."""
    from pipeline.cli import main

    run = tmp_path / "run"
    # σ = 3, not 1: a smaller PLD for the run's ε; the attacks read the run at any σ
    cfg = tiny_lm_config(model=folders["llama"], clients=4, members=40, noise_multiplier=3.0,
                         insecure_deterministic_noise=True)  # fmt: skip
    train(cfg, run, quiet=True)
    out = tmp_path / "att"
    assert main(["attack", str(run), "--attacks", "loss,lm", "--workers", "1", "--out",
                 str(out)]) == 0  # fmt: skip
    doc = json.loads((out / "attacks.json").read_text())
    assert doc["target"]["task"] == "causal-lm" and {"loss", "zlib", "min_k"} <= set(doc["attacks"])
    assert all(0 <= a["auc"] <= 1 for a in doc["attacks"].values())
    assert main(["attack", str(run), "--attacks", "loss", "--client-level", "--workers", "1",
                 "--out", str(tmp_path / "client")]) == 0  # fmt: skip
    capsys.readouterr()
