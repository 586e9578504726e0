"""--task causal-lm: framing and loss masking, the sequence loss and per-example DP
gradients against slow references, perplexity, runs (plain text and instruction data,
non-private and sample-level DP), the released adapter under peft, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl.data.lm import IGNORE, LmTokenizedData, load_lm_dataset
from fl.errors import UsageError
from fl.models.base import LoraSpec, load_tokenizer, wrap_lora
from fl.models.causal_lm import (
    adapter_off,
    evaluate,
    load_causal_lm,
    sequence_loss_sum,
    token_logprobs,
)
from fl.run.engine import train
from fl.run.lm_run import load_run_lm
from fl.testing import tiny_lm_config, write_instruction_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-gpt2")


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("ins") / "ins.jsonl"
    write_instruction_jsonl(path, n=120)
    return path


def _lora_lm(seed=0, rank=4):
    model = wrap_lora(load_causal_lm("tiny-gpt2", seed=seed), LoraSpec(rank, 8.0), seed=seed)
    # B = 0 at init: give the adapter an effect so that adapter on/off differ
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def test_instruction_framing_masks_the_prompt(tok):
    prompts = ["repeat k3 w1 w2", "say hello to the world"]
    texts = ["k3 k3", "hello world"]
    data = LmTokenizedData(texts, tok, 24, prompts=prompts)
    for i, (p, t) in enumerate(zip(prompts, texts)):
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ti = tok(t, add_special_tokens=False)["input_ids"]
        want = [tok.cls_token_id, *pi, *ti, tok.sep_token_id]
        n = len(want)
        assert data.input_ids[i, :n].tolist() == want
        assert data.attention_mask[i].tolist() == [1] * n + [0] * (24 - n)
        # targets: the response and the closing token; bos, prompt and padding are -100
        assert data.labels[i].tolist() == [IGNORE] * (1 + len(pi)) + [*ti, tok.sep_token_id] + [
            IGNORE
        ] * (24 - n)
        assert int(data.targets[i]) == len(ti) + 1
    plain = LmTokenizedData(texts, tok, 24)
    ti = tok(texts[0], add_special_tokens=False)["input_ids"]
    assert plain.labels[0, : len(ti) + 2].tolist() == [IGNORE, *ti, tok.sep_token_id]


def test_a_long_prompt_loses_its_start_not_the_response(tok):
    prompt = " ".join(f"w{i}" for i in range(40))
    data = LmTokenizedData(["k1 k2 k3"], tok, 16, prompts=[prompt])
    ti = tok("k1 k2 k3", add_special_tokens=False)["input_ids"]
    pi = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = data.input_ids[0].tolist()
    assert len(ids) == 16 and ids[0] == tok.cls_token_id
    assert ids[-len(ti) - 1 :] == [*ti, tok.sep_token_id]  # the whole response is kept
    assert ids[1 : 16 - len(ti) - 1] == pi[len(pi) - (16 - len(ti) - 2) :]  # the prompt's end
    assert int(data.targets[0]) == len(ti) + 1


def test_sequence_loss_equals_a_slow_per_token_reference():
    g = torch.Generator().manual_seed(0)
    b, L, V = 4, 9, 13
    logits = torch.randn(b, L, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (b, L), generator=g)
    labels[0, :4] = IGNORE  # a prompt
    labels[1, 6:] = IGNORE  # padding
    labels[2, ::2] = IGNORE
    ref = 0.0
    for i in range(b):
        nll, count = 0.0, 0
        for t in range(L - 1):
            y = int(labels[i, t + 1])
            if y == IGNORE:
                continue
            logp = logits[i, t] - math.log(sum(math.exp(v) for v in logits[i, t].tolist()))
            nll -= float(logp[y])
            count += 1
        ref += nll / count
    got = float(sequence_loss_sum(logits, labels))
    assert got == pytest.approx(ref, rel=1e-6)


def test_perplexity_and_log_probs_equal_an_unpadded_per_example_computation(tok):
    model = _lora_lm()
    texts = ["the cat sat on the mat", "hello", "a b c d e f g h", "one two"]
    prompts = ["", "say", "letters", "count to two please"]
    data = LmTokenizedData(texts, tok, 20, prompts=prompts)
    ev = evaluate(model, data, batch_size=3, device="cpu")
    lps = token_logprobs(model, data, batch_size=3)
    base = token_logprobs(model, data, batch_size=3, adapter=False)
    nll, count, correct = 0.0, 0, 0
    model.eval()
    for i in range(len(texts)):
        n = int(data.lengths[i])
        ids = data.input_ids[i, :n]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double()
        ref = []
        for t in range(n - 1):
            y = int(data.labels[i, t + 1])
            if y != IGNORE:
                lp = torch.log_softmax(logits[t], -1)
                ref.append(float(lp[y]))
                correct += int(int(logits[t].argmax()) == y)
        np.testing.assert_allclose(lps[i], ref, rtol=1e-5, atol=1e-5)
        nll -= sum(ref)
        count += len(ref)
    assert ev["tokens"] == count
    assert ev["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert ev["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert ev["accuracy"] == pytest.approx(correct / count)
    # adapter off scores the base model: a different function here (B != 0)
    assert not np.allclose(np.concatenate(base), np.concatenate(lps))
    plain = load_causal_lm("tiny-gpt2", seed=0)
    ref0 = token_logprobs(plain, data, batch_size=4)
    np.testing.assert_allclose(np.concatenate(base), np.concatenate(ref0), atol=1e-5)


def test_per_example_gradients_are_those_of_each_sequence_loss(tok):
    """Opacus' per-sample gradient of Σ_i ℓ_i is ∇ℓ_i of each example alone (one
    sequence, all its tokens): clipping then bounds an example, not a token."""
    from opacus import GradSampleModule

    model = _lora_lm(seed=1).train()  # Opacus records train-mode modules only
    for m in model.modules():  # no dropout: both passes compute the same function
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    data = LmTokenizedData(
        ["a b c d e f", "x", "hello there my friend"], tok, 16, prompts=["", "p q", "hi"]
    )
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    batch = data.batch(torch.arange(3), "cpu")
    labels = batch.pop("labels")
    sequence_loss_sum(gsm(**batch).logits, labels).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    per = [p.grad_sample.detach().clone() for p in params]
    gsm.disable_hooks()
    for i in range(3):
        n = int(data.lengths[i])
        model.zero_grad()
        for p in params:
            p.grad_sample = None
        logits = model(input_ids=data.input_ids[i : i + 1, :n]).logits
        sequence_loss_sum(logits, data.labels[i : i + 1, :n]).backward()
        for p, g in zip(params, per):
            torch.testing.assert_close(g[i], p.grad, rtol=1e-4, atol=1e-6)
    gsm.remove_hooks()


@pytest.fixture(scope="module")
def instruction_runs(jsonl, tmp_path_factory):
    """A non-private and a sample-level DP run on the instruction file; the DP run's
    engine is kept (its model holds the released state after the run)."""
    from fl.run.engine import Engine

    root = tmp_path_factory.mktemp("lmruns")
    common = dict(dataset=str(jsonl), members=60, nonmembers=20, test=20, rounds=2)
    nodp = train(tiny_lm_config(**common), root / "nodp", quiet=True)
    cfg = tiny_lm_config(**common, noise_multiplier=1.0, insecure_deterministic_noise=True)
    eng = Engine(cfg, root / "dp", quiet=True)
    dp = eng.run()
    return root, nodp, dp, eng


def test_instruction_runs_record_the_task_and_keep_the_split_contract(instruction_runs, jsonl):
    from audit.bundle.audit import audit_run

    root, nodp, dp, _ = instruction_runs
    for man in (nodp, dp):
        assert man["model"]["task"] == "causal-lm"
        assert man["model"]["lm_format"] == "instruction"
        assert man["model"]["prefix_cache"] is False
        final = man["metrics"]["final"]
        assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))
    pub = json.loads((root / "dp" / "release" / "manifest.json").read_text())
    assert pub["model"]["task"] == "causal-lm" and pub["config"]["task"] == "causal-lm"
    splits = json.loads((root / "dp" / "splits.json").read_text())
    ids = [json.loads(line)["id"] for line in jsonl.read_text().splitlines()]
    parts = [set(splits[k]) for k in ("members", "nonmembers", "test")]
    assert [len(p) for p in parts] == [60, 20, 20]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert set().union(*parts) <= set(ids)
    assert sorted(sum(splits["clients"].values(), [])) == sorted(parts[0])
    res = audit_run(root / "dp")
    assert res["recomputed"]["config"]["pld"] == pytest.approx(dp["privacy"]["epsilon"]["pld"])
    assert res["recomputed"]["ledger"]["pld"] == pytest.approx(dp["privacy"]["epsilon"]["pld"])
    assert dp["privacy"]["epsilon"]["pld"] > 0


def test_the_released_adapter_loads_with_peft_and_gives_the_engine_logits(instruction_runs):
    from peft import PeftModel
    from safetensors.torch import load_file

    root, _, man, eng = instruction_runs
    flat = load_file(str(root / "dp" / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k for k in flat) and not any("score" in k for k in flat)
    assert any(float(t.abs().max()) > 0 for k, t in flat.items() if "lora_B" in k)
    base = load_causal_lm(eng.cfg.model, seed=eng.cfg.seed)
    peft_model = PeftModel.from_pretrained(base, str(root / "dp" / "adapter")).eval()
    engine_model = eng.trainer.model.eval()
    batch = eng.test_data.batch(torch.arange(len(eng.test_data)), "cpu")
    batch.pop("labels")
    with torch.no_grad():
        a = engine_model(**batch).logits
        b = peft_model(**batch).logits
        run_model, _, _ = load_run_lm(root / "dp" / "release")
        c = run_model(**batch).logits
        with eng.trainer.model.disable_adapter():
            off = engine_model(**batch).logits
    assert torch.max((a - b).abs()) <= 1e-5
    assert torch.max((a - c).abs()) <= 1e-5
    assert torch.max((a - off).abs()) > 1e-4  # the adapter changes the model


def test_bf16_autocast_is_selectable_and_trains(tmp_path):
    man = train(
        tiny_lm_config(precision="bf16", noise_multiplier=1.0, insecure_deterministic_noise=True),
        tmp_path / "bf16",
        quiet=True,
    )
    assert man["model"]["precision"] == "bf16"
    assert math.isfinite(man["metrics"]["final"]["loss"])


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"prompt": "a", "response": "b"}, {"prompt": "c"}], "row 2 has no field 'response'"),
        ([{"prompt": "a", "response": " "}], "row 1: field 'response' is empty"),
        ([{"prompt": "a", "response": 3}], "must be a string"),
        ([{"text": "x"}, {"txt": "y"}], "row 2 has no field 'text'"),
    ],
)
def test_bad_jsonl_gives_clear_errors(tmp_path, rows, match):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(UsageError, match=match):
        load_lm_dataset(str(path))


def test_empty_or_broken_files_and_impossible_setups_give_clear_errors(tmp_path, jsonl):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(UsageError, match="empty"):
        load_lm_dataset(str(empty))
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    with pytest.raises(UsageError, match=r"b.jsonl:2: invalid JSON"):
        load_lm_dataset(str(broken))
    with pytest.raises(UsageError, match="plain text"):
        load_lm_dataset("synthetic", lm_format="instruction")
    with pytest.raises(UsageError, match="classification head"):
        train(tiny_lm_config(method="probe"), tmp_path / "probe", quiet=True)
    with pytest.raises(UsageError, match="random_text"):
        train(tiny_lm_config(canaries=2), tmp_path / "can", quiet=True)
    with pytest.raises(UsageError, match="not a causal LM"):
        train(tiny_lm_config(model="tiny-bert"), tmp_path / "bert", quiet=True)


def test_a_checkpoint_written_before_the_task_fields_resumes(tmp_path):
    """Checkpoints of runs started before ``task``/``lm_format``/... existed lack them:
    they mean the defaults, so such a run resumes; a really changed field still refuses."""
    from fl.run.engine import Engine
    from fl.testing import tiny_config

    cfg = tiny_config(rounds=1)
    train(cfg, tmp_path / "run", quiet=True)
    meta = tmp_path / "run" / "checkpoint" / "meta-00001.json"
    doc = json.loads(meta.read_text())
    for k in ("task", "lm_format", "prompt_field", "response_field", "precision"):
        del doc["config"][k]
    meta.write_text(json.dumps(doc))
    Engine(cfg, tmp_path / "run", resume=True, quiet=True).run()  # no refusal
    changed = tiny_config(rounds=1, precision="bf16")
    with pytest.raises(UsageError, match=r"different configuration \(fields \['precision'\]"):
        Engine(changed, tmp_path / "run", resume=True, quiet=True).run()


def test_a_runs_splits_can_be_scored_with_the_adapter_on_and_off(instruction_runs):
    from fl.run.lm_run import run_split_data

    root, _, man, eng = instruction_runs
    model, tok, cfg = load_run_lm(root / "dp")
    data, ids = run_split_data(root / "dp", "test", tok, cfg)
    assert ids == json.loads((root / "dp" / "splits.json").read_text())["test"]
    on = evaluate(model, data, 8, "cpu")
    assert on["loss"] == pytest.approx(man["metrics"]["final"]["loss"], rel=1e-5)
    with torch.no_grad(), adapter_off(model):
        off = evaluate(model, data, 8, "cpu")
    base = evaluate(load_causal_lm(cfg.model, seed=cfg.seed), data, 8, "cpu")
    assert off["loss"] == pytest.approx(base["loss"], rel=1e-6)
    with pytest.raises(UsageError, match="no readable splits.json"):
        run_split_data(root / "dp" / "release", "test", tok, cfg)
