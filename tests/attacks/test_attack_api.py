"""The attack settings, target record and registry: `fedlora attack`'s flags are the
AttackConfig / TargetSpec fields with their defaults; validation; which signals each kind
of target evaluates and uses as RMIA's population; the registry's names and order."""

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from attacks.cli import register
from attacks.config import FAMILIES, AttackConfig, from_args
from attacks.registry import REGISTRY, select
from attacks.target import Target
from attacks.target_spec import TargetSpec
from fl.errors import UsageError


def _parse(argv):
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["attack", *argv])


def test_no_flags_give_the_dataclass_defaults():
    args = _parse([])
    assert from_args(AttackConfig, args) == AttackConfig()
    assert from_args(TargetSpec, args) == TargetSpec()
    assert AttackConfig().attacks is None  # the target's default (all / loss)
    assert AttackConfig(attacks="").attacks is None  # `--attacks ""`, as before
    assert (AttackConfig().shadows, AttackConfig().bootstrap, AttackConfig().rmia_a) == (
        8, 200, 0.3,
    )  # fmt: skip


def test_every_flag_reaches_its_field():
    args = _parse(["--attacks", "rmia,loss,rmia", "--shadows", "3", "--device", "cpu",
                   "--seed", "2", "--rmia-a", "0.5", "--global-variance", "no",
                   "--bootstrap", "7", "--adapter", "A", "--model", "M", "--members", "m",
                   "--nonmembers", "n", "--max-length", "16", "--base-seed", "5",
                   "--shadow-config", "s.toml", "R"])  # fmt: skip
    cfg = from_args(AttackConfig, args, progress=False)
    assert cfg == AttackConfig(attacks=("rmia", "loss"), shadows=3, device="cpu", seed=2,
                               rmia_a=0.5, global_variance="no", bootstrap=7, progress=False)  # fmt: skip
    spec = from_args(TargetSpec, args)
    assert spec == TargetSpec("R", "A", "M", "m", "n", 16, 5, "s.toml")
    # one flag per field, except those marked cli=False
    flags = {a.dest for a in register_actions()}
    for cls in (AttackConfig, TargetSpec):
        for f in dataclasses.fields(cls):
            assert (f.name in flags) == (f.metadata.get("cli") is not False), f.name


def register_actions():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    register(sub)
    return [a for a in sub.choices["attack"]._actions if a.option_strings]


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(attacks="loss,nope"), "unknown attack"),
        (dict(attacks=[]), "unknown attack"),
        (dict(global_variance="maybe"), "global_variance"),
        (dict(bootstrap=-1), "bootstrap"),
        (dict(rmia_a=1.5), "offline parameter a"),
        (dict(rmia_gamma=0.5), "gamma"),
    ],
)
def test_invalid_settings_are_usage_errors(kw, msg):
    with pytest.raises(UsageError, match=msg):
        AttackConfig(**kw)


def test_global_variance():
    assert AttackConfig(shadows=15).lira_global_variance() is True
    assert AttackConfig(shadows=16).lira_global_variance() is False
    assert AttackConfig(shadows=64, global_variance="yes").lira_global_variance() is True
    assert AttackConfig(shadows=4, global_variance="no").lira_global_variance() is False
    for api, cli in ((None, "auto"), (True, "yes"), (False, "no")):
        assert AttackConfig.with_variance(api).global_variance == cli


def test_registry_names_families_and_order():
    lm = ["perplexity", "reference", "zlib", "lowercase", "min_k", "min_k_pp"]
    assert list(REGISTRY) == ["loss", "loss_class", "calibration", "shadow", "shadow_single",
                              "lira_online", "lira_offline", "rmia_online", "rmia_offline",
                              *lm]  # fmt: skip
    assert {a.family for a in REGISTRY.values()} == set(FAMILIES)
    assert [a.name for a in REGISTRY.values() if not a.needs_shadows] == ["loss", "loss_class", *lm]
    # a classifier gets no LM signal and a causal LM no Shokri attack (it has no logits)
    assert [a.name for a in select(FAMILIES)] == list(REGISTRY)[:9]
    assert "shadow" not in [a.name for a in select(FAMILIES, "causal-lm")]
    assert "loss_class" not in [a.name for a in select(FAMILIES, "causal-lm")]
    assert [a.name for a in select(("lm",), "causal-lm")] == lm
    # results follow the registry's order, not the order asked for
    assert [a.name for a in select(("rmia", "loss"))] == [
        "loss", "loss_class", "rmia_online", "rmia_offline"
    ]  # fmt: skip
    cfg = AttackConfig(rmia_a=0.25, shadows=4)
    assert REGISTRY["rmia_offline"].threat_model(cfg).endswith(" (offline a=0.25)")
    assert REGISTRY["lira_online"].threat_model(cfg).endswith(" (global variance: True)")


def _target(kind):
    role = np.array(["member", "nonmember", "member", "test", "test"])
    if kind != "run":
        role = role[:3]
    n = len(role)
    return Target(
        kind=kind, source="src", adapter_dir=Path("src/adapter"), base_model="tiny-bert",
        max_length=16, base_seed=0, num_labels=2, batch_size=8,
        ids=tuple(f"i{k}" for k in range(n)), texts=tuple("t" for _ in range(n)),
        labels=np.zeros(n, np.int64), role=role, shadow_config=None, pool_note="p",
    )  # fmt: skip


def test_target_views_by_kind():
    run = _target("run")
    np.testing.assert_array_equal(run.eval_idx, [0, 1, 2])
    np.testing.assert_array_equal(run.is_member, [True, False, True])
    np.testing.assert_array_equal(run.z_idx, [3, 4])  # the attacker's own examples
    assert run.default_attacks == FAMILIES and run.default_out == Path("src/attacks")
    assert list(run.document()) == ["run_dir", "model", "dataset", "method", "dp_level",
                                    "n_members", "n_nonmembers"]  # fmt: skip
    ad = _target("adapter")
    np.testing.assert_array_equal(ad.z_idx, [0, 1, 2])  # the whole pool
    assert ad.default_attacks == ("loss",)
    assert ad.document() == {"adapter": "src", "model": "tiny-bert", "n_members": 2,
                             "n_nonmembers": 1}  # fmt: skip
    b = dataclasses.replace(ad, kind="bundle", members_from="m.jsonl")
    assert b.document()["adapter"] == str(Path("src/adapter"))
    assert b.document()["members_from"] == "m.jsonl" and b.document()["bundle"] == "src"
    with pytest.raises(ValueError, match="one entry per example"):
        dataclasses.replace(ad, ids=("x",))
