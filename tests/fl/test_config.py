"""TrainConfig field metadata: choices (validate, CLI) and the fields that do not change
results (resume, checkpoint, Flower ClientApp fingerprint)."""

import argparse
import dataclasses

import pytest

from fl.cli.train import add_config_flags
from fl.errors import UsageError
from fl.run.config import (
    RUNTIME_FIELDS,
    TrainConfig,
    field_choices,
    result_fields,
    runtime_fields,
)

CHOICE_FIELDS = [f for f in dataclasses.fields(TrainConfig) if field_choices(f) is not None]


def test_choice_fields_are_the_expected_ones():
    names = {f.name for f in CHOICE_FIELDS}
    assert names == {
        "method",
        "client_sampling",
        "optimizer",
        "lr_schedule",
        "partition",
        "dp_level",
        "accountant",
        "canary_kind",
        "transport",
        "pooling",
        "head_init",
        "dropout",
        "task",
        "lm_format",
        "precision",
    }
    assert "fedavg" in field_choices(next(f for f in CHOICE_FIELDS if f.name == "method"))


@pytest.mark.parametrize("f", CHOICE_FIELDS, ids=lambda f: f.name)
def test_every_choice_field_is_validated(f):
    assert f.default in field_choices(f)
    with pytest.raises(UsageError, match=rf"unknown {f.name} 'nope'; choose one of \["):
        TrainConfig(**{f.name: "nope"}).validate()
    for value in field_choices(f):
        kw = {f.name: value}
        if f.name == "dp_level" and value not in ("none", "auto"):
            kw["noise_multiplier"] = 1.0
        TrainConfig(**kw).validate()


def test_epsilon_or_sigma_without_dp_level_means_sample_level():
    assert TrainConfig(epsilon=8.0).validate().dp_level == "sample"
    assert TrainConfig(noise_multiplier=1.0).validate().dp_level == "sample"
    assert TrainConfig().validate().dp_level == "none"
    assert TrainConfig.from_dict({"epsilon": 3}).validate().dp_level == "sample"
    assert TrainConfig(dp_level="client", epsilon=8.0).validate().dp_level == "client"
    with pytest.raises(UsageError, match="--dp-level none"):
        TrainConfig(dp_level="none", epsilon=8.0).validate()
    cfg = TrainConfig()
    cfg.dp_level, cfg.epsilon = "auto", 3.0  # set after construction: resolved by validate
    assert cfg.validate().dp_level == "sample"


def test_cli_passes_static_choices_to_argparse():
    p = argparse.ArgumentParser()
    add_config_flags(p)
    actions = {a.dest: a for a in p._actions}
    for f in CHOICE_FIELDS:
        want = None if f.name == "method" else list(field_choices(f))
        assert (list(actions[f.name].choices) if actions[f.name].choices else None) == want
    assert "choices: sgd | adamw" in actions["optimizer"].help
    assert "e.g. minilm | tiny-bert" in actions["model"].help
    with pytest.raises(SystemExit):
        p.parse_args(["--optimizer", "adam"])
    assert p.parse_args(["--device", "cuda:1"]).device == "cuda:1"  # not a closed set


def test_runtime_fields():
    assert set(RUNTIME_FIELDS) == {"device", "progress", "eval_nonmembers"}
    assert set(runtime_fields("client")) == {"device", "progress", "eval_nonmembers", "transport"}
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(result_fields() + RUNTIME_FIELDS) == sorted(names)
    with pytest.raises(ValueError):
        runtime_fields("server")


def test_client_fingerprint_ignores_client_runtime_fields_only():
    from fl.flower.clientapp import config_key

    base = TrainConfig().to_dict()
    key = config_key(base)
    for k, v in (("device", "cpu"), ("progress", False), ("transport", "flower")):
        assert config_key({**base, k: v}) == key
    assert config_key({**base, "lr": 0.1}) != key


def test_clients_per_round_takes_a_fraction_or_a_count_from_files_and_flags():
    """clients_per_round is a float field with the integer default 0: a config.json or
    TOML value 0.5 (client-level grids write one) and ``--clients-per-round 0.5`` load; a
    count stays an int, so config.json round-trips unchanged."""
    from fl.run.config import TrainConfig

    assert TrainConfig.from_dict({"clients": 10, "clients_per_round": 0.5}).clients_per_round == 0.5
    c = TrainConfig.from_dict({"clients": 10, "clients_per_round": 3})
    assert c.clients_per_round == 3 and isinstance(c.clients_per_round, int)
    assert TrainConfig.from_dict(c.to_dict()).to_dict() == c.to_dict()
    with pytest.raises(UsageError, match="clients_per_round"):
        TrainConfig.from_dict({"clients_per_round": "half"})
    p = argparse.ArgumentParser()
    add_config_flags(p)
    assert p.parse_args(["--clients-per-round", "0.25"]).clients_per_round == 0.25
    n = p.parse_args(["--clients-per-round", "4"]).clients_per_round
    assert n == 4 and isinstance(n, int)
    with pytest.raises(SystemExit):
        p.parse_args(["--clients-per-round", "half"])


def test_config_file_may_be_a_runs_config_json(tmp_path):
    """--config takes TOML or a run directory's config.json (an object of fields, which
    round-trips to the same TrainConfig); a broken or non-object JSON file is a
    UsageError naming the file."""
    import json

    from fl.run.config import load_toml

    cfg = TrainConfig.from_dict(
        {"method": "ffa", "clients": 7, "epsilon": 3.0, "dp_level": "sample"}
    )
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg.to_dict()))
    assert TrainConfig.from_dict(load_toml(str(p))).to_dict() == cfg.to_dict()
    t = tmp_path / "run.toml"
    t.write_text('[train]\nmethod = "ffa"\nclients = 7\n')
    assert load_toml(str(t)) == {"method": "ffa", "clients": 7}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="bad.json: invalid JSON"):
        load_toml(str(bad))
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(UsageError, match="object of fields"):
        load_toml(str(arr))


def test_head_clip_share_is_validated_and_sample_level_only():
    ok = TrainConfig(epsilon=8.0, head_clip_share=0.8).validate()
    assert ok.dp_level == "sample" and ok.head_clip_share == 0.8
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(UsageError, match=r"head_clip_share must be in \[0, 1\)"):
            TrainConfig(epsilon=8.0, head_clip_share=bad).validate()
    with pytest.raises(UsageError, match="needs --dp-level sample"):
        TrainConfig(head_clip_share=0.5).validate()
    with pytest.raises(UsageError, match="needs --dp-level sample"):
        TrainConfig(dp_level="client", epsilon=3.0, head_clip_share=0.5).validate()
