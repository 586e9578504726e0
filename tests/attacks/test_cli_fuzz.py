"""Fuzzing the numeric flags of `fedlora attack`, `fedlora analyze ...` and the numeric
fields of `fedlora audit --claim`: 0, negative, NaN, inf, huge and non-numbers give either
a result or one line on stderr with exit code 2, never a traceback. Bad values are refused
before any model is loaded (the attack cases use a fake adapter and config-only models)."""

import json
import math

import pytest

from pipeline.cli import main

HUGE = str(10**30)
CASES = ("0", "-3", "nan", "inf", HUGE, "abc")

#: flag → values it accepts among CASES (the others must be refused naming the flag)
ATTACK_FLAGS = {
    "--shadows": {"0"},
    "--workers": {"0"},
    "--seed": {"0"},
    "--rmia-a": {"0"},
    "--bootstrap": {"0"},
    "--min-k": set(),
    "--client-fpr": {"0"},
    "--max-length": set(),
    "--base-seed": {"0"},
    "--batch-size": set(),
}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.fixture(scope="module")
def fake_adapter(tmp_path_factory):
    """An adapter folder whose config is valid and whose weights are one head tensor:
    enough for every check made before the base model is loaded."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("fake") / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "SEQ_CLS", "r": 4, "lora_alpha": 8,
         "target_modules": ["query", "value"]}))  # fmt: skip
    save_file({"base_model.model.classifier.modules_to_save.default.weight": torch.zeros(2, 64)},
              str(d / "adapter_model.safetensors"))  # fmt: skip
    rows = [{"text": f"text {i}", "label": i % 2} for i in range(4)]
    for name in ("members", "nonmembers"):
        (d.parent / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def _attack_argv(adapter, model="tiny-bert", **flags):
    argv = ["attack", "--adapter", str(adapter), "--model", model,
            "--members", str(adapter.parent / "members.jsonl"),
            "--nonmembers", str(adapter.parent / "nonmembers.jsonl")]  # fmt: skip
    for k, v in flags.items():
        argv += [k, v]
    return argv


@pytest.mark.parametrize("flag", sorted(ATTACK_FLAGS))
@pytest.mark.parametrize("value", CASES)
def test_attack_numeric_flags(flag, value, tmp_path, capsys, monkeypatch):
    import attacks.run

    # a value that passes every check reaches the attack itself: stop it there (the
    # point here is the checks, which all run before it)
    def reached(*a, **k):
        raise SystemExit(0)

    monkeypatch.setattr(attacks.run, "attack", reached)
    adapter = tmp_path / "missing-adapter"  # valid values then stop at "not found"
    argv = _attack_argv(adapter, **{flag: value, "--out": str(tmp_path / "o")})
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own one-line error (exit 2)
        rc = exc.code
    assert rc == 2
    line = _one_line(capsys)
    if value not in ATTACK_FLAGS[flag]:
        name = flag.lstrip("-")
        assert name in line or name.replace("-", "_") in line, line
    else:
        assert "adapter folder not found" in line, line


@pytest.mark.parametrize(
    "model, max_length, limit",
    [("tiny-bert", "1000", 256), ("tiny-gpt2", "257", 256), ("minilm", "1000", 512),
     ("gpt2-128", "500", 128)],
)  # fmt: skip
def test_max_length_above_the_models_positions_is_refused(
    fake_adapter, tmp_path, capsys, model, max_length, limit
):
    if model == "gpt2-128":  # a local GPT-2 folder with 128 positions (config only)
        from transformers import GPT2Config

        model = str(tmp_path / "gpt2-128")
        GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=128).save_pretrained(model)
    argv = _attack_argv(fake_adapter, model, **{"--max-length": max_length})
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert f"--max-length {max_length} exceeds the {limit} token positions" in line, line
    assert f"use --max-length {limit} or less" in line


# ------------------------------------------------------------------ fedlora audit --claim
CLAIM = dict(level="sample", noise_multiplier=1.0, clipping_norm=1.0, sampling="poisson",
             batch_size=64, dataset_size=1000, steps_per_round=10, rounds=2,
             claimed_epsilon=3.0, delta=1e-5, noise_source="csprng")  # fmt: skip
CLAIM_FIELDS = ("noise_multiplier", "clipping_norm", "batch_size", "dataset_size",
                "sample_rate", "steps_per_round", "rounds", "clients_per_round",
                "total_clients", "claimed_epsilon", "delta")  # fmt: skip


@pytest.mark.parametrize("field", CLAIM_FIELDS)
@pytest.mark.parametrize("value", [0, -3, math.nan, math.inf, 10**30, 1e300, "abc"])
def test_claim_numeric_fields(field, value, tmp_path, capsys):
    doc = dict(CLAIM)
    if field == "sample_rate":
        doc.pop("batch_size"), doc.pop("dataset_size")
    doc[field] = value
    p = tmp_path / "claim.json"
    # JSON has no NaN / Infinity: write them as Python's json does (NaN, Infinity)
    p.write_text(json.dumps(doc))
    rc = main(["audit", "--claim", str(p), "--json"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    if rc == 2:
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and field in lines[0], lines
    else:
        assert rc in (0, 1) and json.loads(out.out)["claimed_epsilon"] is not None


# ------------------------------------------------------------------ fedlora analyze
#: sub-command → its numeric flags
ANALYZE_FLAGS = {
    "amplification": ("--seed", "--trials", "--powerdp-trials", "--lr", "--clip"),
    "exactness": ("--seed", "--m", "--n", "--rank"),
    "hetero": ("--seed", "--m", "--n", "--rounds", "--steps", "--lr"),
    "refactorization": (
        "--seed",
        "--m",
        "--n",
        "--rank",
        "--clients",
        "--delta",
        "--iters",
        "--trials",
    ),  # fmt: skip
}
ANALYZE_CASES = [(a, f) for a, flags in ANALYZE_FLAGS.items() for f in flags]


#: the integer flags (argparse refuses NaN, inf and text for them itself)
ANALYZE_INT = {"--seed", "--trials", "--powerdp-trials", "--m", "--n", "--rank", "--rounds",
               "--steps", "--clients", "--iters"}  # fmt: skip


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc", "1e400", "0", "-3", "1e30"])
@pytest.mark.parametrize("analysis, flag", ANALYZE_CASES)
def test_analyze_bad_numbers_refused(analysis, flag, value, tmp_path, capsys):
    """Every numeric flag of every analysis: text, NaN, ±inf, 0 (except the seed), negative
    and huge values are refused by the parser before anything runs: one line naming the
    flag, exit 2."""
    if flag == "--seed" and value == "0":
        return  # seed 0 is valid (the default); every other case of --seed is not
    with pytest.raises(SystemExit) as exc:
        main(["analyze", analysis, flag, value, "--out", str(tmp_path), "--no-figure"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "analysis, flag, value",
    [
        ("amplification", "--sigmas", "0.1,nan"),
        ("amplification", "--sigmas", "-1"),
        ("amplification", "--shapes", "64x64x100"),
        ("exactness", "--clients", "2,0"),
        ("hetero", "--ranks", "2,inf"),
        ("refactorization", "--epsilons", "1,1e30"),
    ],
)
def test_analyze_bad_lists_refused(analysis, flag, value, tmp_path, capsys):
    rc = main(["analyze", analysis, flag, value, "--out", str(tmp_path), "--no-figure"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and flag in err[0], err
