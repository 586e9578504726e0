"""A noise key reused on another configuration is refused (its noise would cancel against
the first run's), or with --allow-key-reuse recorded as NOT private and never exported;
the same configuration replays bit for bit and stays private (issue 37, item 4)."""

import json
import stat

import pytest

from fl.run.config import config_sha256
from fl.testing import tiny_config, tiny_flags
from pipeline.cli import main

SMALL = dict(members=60, nonmembers=20, test=20, max_length=16, clients=2, rounds=1,
             local_steps=2, batch_size=8)  # fmt: skip
# σ 3, not 1: the runs' PLDs at σ 1 are most of their time, and nothing here (the binding,
# the refusals, the NOT-private marks, the bit-exact replay) depends on σ
SIGMA = 3.0


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """One private run (fresh key): its directory and config."""
    from fl.run.engine import train

    d = tmp_path_factory.mktemp("keyreuse") / "first"
    cfg = tiny_config(**SMALL, noise_multiplier=SIGMA)
    train(cfg, d, quiet=True)
    return d, cfg


def _adapter(run):
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_binding_file_is_operator_only_and_names_the_config(first):
    run, cfg = first
    path = run / "private" / "key_binding.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    m = json.loads((run / "manifest.json").read_text())
    assert doc["key_id"] == m["privacy"]["noise"]["key_id"]
    assert doc["config_sha256"] == config_sha256(cfg)
    assert m["privacy"]["noise"]["private"] is True


def test_reuse_on_another_config_is_refused(first, tmp_path, capsys):
    run, cfg = first
    out = tmp_path / "second"
    flags = tiny_flags(**{**SMALL, "members": 59}, noise_multiplier=SIGMA)
    rc = main(["train", *flags, "--noise-key", str(run / "private" / "noise.key"),
               "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    changed = config_sha256(tiny_config(**{**SMALL, "members": 59}, noise_multiplier=SIGMA))
    assert config_sha256(cfg) in err[0] and changed in err[0]
    assert "--allow-key-reuse" in err[0]
    assert not out.exists()  # a refused start leaves nothing


def test_key_without_binding_is_refused(first, tmp_path, capsys):
    run, _ = first
    lone = tmp_path / "keys"
    lone.mkdir()
    (lone / "noise.key").write_bytes((run / "private" / "noise.key").read_bytes())
    (lone / "noise.key").chmod(0o600)
    rc = main(["train", *tiny_flags(**SMALL, noise_multiplier=SIGMA), "--noise-key",
               str(lone / "noise.key"), "--out", str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "unknown configuration" in err
    assert not (tmp_path / "o").exists()


def test_allowed_reuse_is_marked_not_private_and_export_refuses(first, tmp_path, capsys):
    run, cfg = first
    out = tmp_path / "second"
    flags = tiny_flags(**{**SMALL, "members": 59}, noise_multiplier=SIGMA)
    rc = main(["train", *flags, "--noise-key", str(run / "private" / "noise.key"),
               "--allow-key-reuse", "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    noise = json.loads((out / "manifest.json").read_text())["privacy"]["noise"]
    assert noise["private"] is False
    assert noise["reused_key"]["original_config_sha256"] == config_sha256(cfg)
    assert "NOT PRIVATE" in noise["warning"]
    assert "NOT private" in (out / "run.log").read_text()
    # a resume keeps it not private (the binding carries the record)
    binding = json.loads((out / "private" / "key_binding.json").read_text())
    assert binding["reused_key"]["original_config_sha256"] == config_sha256(cfg)
    capsys.readouterr()
    bundle = tmp_path / "bundle"
    assert main(["export", str(out), "--out", str(bundle)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NOT private" in err[0], err
    assert not bundle.exists()
    # the bundle the run wrote carries the original config's hash, and the audit flags it
    pub = json.loads((out / "release" / "manifest.json").read_text())["privacy"]["noise"]
    assert pub["private"] is False
    assert pub["reused_key"]["original_config_sha256"] == config_sha256(cfg)
    from audit.bundle.audit import audit_run

    for target in (out, out / "release"):
        res = audit_run(target)
        assert "key_reused" in {f["code"] for f in res["findings"]}
    # and the reused run's key cannot be reused again without the flag, even on its config
    rc = main(["train", *flags, "--noise-key", str(out / "private" / "noise.key"),
               "--out", str(tmp_path / "third")])  # fmt: skip
    assert rc == 2 and not (tmp_path / "third").exists()


def test_same_config_replays_bit_exactly_and_stays_private(first, tmp_path, capsys):
    run, cfg = first
    out = tmp_path / "replay"
    rc = main(["train", *tiny_flags(**SMALL, noise_multiplier=SIGMA), "--noise-key",
               str(run / "private" / "noise.key"), "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    a, b = _adapter(run), _adapter(out)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    noise = json.loads((out / "manifest.json").read_text())["privacy"]["noise"]
    assert noise["private"] is True and "reused_key" not in noise
    assert main(["export", str(out), "--out", str(tmp_path / "bundle")]) == 0


def test_insecure_run_is_not_exported(tmp_path, capsys):
    from fl.run.engine import train

    run = tmp_path / "insecure"
    train(tiny_config(**SMALL, noise_multiplier=SIGMA, insecure_deterministic_noise=True), run,
          quiet=True)  # fmt: skip
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "public seed" in err[0]
    assert not (tmp_path / "b").exists()


def test_audit_replay_with_a_key_object_stays_private(first, tmp_path):
    from fl.privacy.rng import NoiseKey
    from fl.run.engine import train

    run, cfg = first
    m = train(cfg, tmp_path / "r", quiet=True,
              noise_key=NoiseKey.read(run / "private" / "noise.key"))  # fmt: skip
    assert m["privacy"]["noise"]["private"] is True
