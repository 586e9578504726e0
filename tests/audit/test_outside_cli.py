"""`fedlora canaries new` and `fedlora audit --canaries`: what they write, and what they
refuse (one line, exit 2, nothing written)."""

import json
import stat

import numpy as np
import pytest

from audit.canaries import canary_set as CS
from audit.canaries import observations as OB
from audit.canaries import outside as O
from audit.canaries.draw import group_of_name
from pipeline.cli import main

HEAVY = ("torch", "matplotlib", "transformers", "peft", "opacus", "scipy", "flwr", "ray")
PARAMS = {
    "params": [
        {"name": "l0.lora_A.default.weight", "shape": [4, 16]},
        {"name": "l0.lora_B.default.weight", "shape": [16, 4]},
        {"name": "head.weight", "shape": [2, 16]},
    ]
}


@pytest.fixture
def params(tmp_path):
    p = tmp_path / "params.json"
    p.write_text(json.dumps(PARAMS))
    return p


def _one_line_exit_2(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refuses what it cannot parse
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (argv, err)
    assert "Traceback" not in err[0]
    return err[0]


# `canaries --help` imports nothing heavy: tests/pipeline/test_cli_help.py


def test_gradient_set_files(params, tmp_path, capsys):
    out = tmp_path / "set"
    rc = main(["canaries", "new", "--kind", "gradient", "--count", "60", "--params",
               str(params), "--clip", "0.5", "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "canaries.json").read_text())
    assert doc["kind"] == "gradient" and doc["count"] == 60
    assert '"included"' not in json.dumps(doc)  # no bit in the public file
    co = doc["gradient"]["coordinates"]
    assert len({(c["param"], c["index"]) for c in co}) == 60
    # stratified: every group has canaries (at least min(M/G, size) each)
    groups = {p["name"]: group_of_name(p["name"]) for p in PARAMS["params"]}
    per = {g: sum(groups[c["param"]] == g for c in co) for g in ("lora_A", "lora_B", "other")}
    assert per == {"lora_A": 20, "lora_B": 20, "other": 20}
    priv = out / "private"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o700
    for f in ("inclusion.json", "noise.key"):
        assert stat.S_IMODE((priv / f).stat().st_mode) == 0o600
    cs = CS.load_canary_set(out)  # re-derived from the key and checked
    assert cs.included.shape == (60,) and 10 < cs.included.sum() < 50


def test_key_file_is_used_not_copied(params, tmp_path):
    from fl.privacy.rng import NoiseKey

    key = NoiseKey.generate()
    (tmp_path / "k").mkdir()
    kp = key.write(tmp_path / "k")
    out = tmp_path / "set"
    assert main(["canaries", "new", "--kind", "input", "--count", "30", "--num-classes", "3",
                 "--key", str(kp), "--out", str(out)]) == 0  # fmt: skip
    assert not (out / "private" / "noise.key").exists()
    doc = json.loads((out / "canaries.json").read_text())
    assert doc["key_id"] == key.key_id
    cs = CS.load_canary_set(out, key_file=kp)
    assert cs.key.key_id == key.key_id
    # the same key makes the same set
    out2 = tmp_path / "set2"
    CS.new_canary_set("input", 30, out2, key_file=kp, num_classes=3)
    assert (out2 / "canaries.json").read_bytes() == (out / "canaries.json").read_bytes()


def test_tampered_bits_refused(params, tmp_path, capsys):
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0)
    bp = out / "private" / "inclusion.json"
    d = json.loads(bp.read_text())
    d["included"][0] = 1 - d["included"][0]
    bp.write_text(json.dumps(d))
    with pytest.raises(O.UsageError, match="do not derive from the set's key"):
        CS.load_canary_set(out)


@pytest.mark.parametrize(
    "extra",
    [
        ["--kind", "gradient", "--count", "0", "--clip", "1"],
        ["--kind", "gradient", "--count", "-5", "--clip", "1"],
        ["--kind", "gradient", "--count", "abc", "--clip", "1"],
        ["--kind", "gradient", "--count", "1000", "--clip", "1"],  # > 192 coordinates
        ["--kind", "gradient", "--count", "10", "--clip", "nan"],
        ["--kind", "gradient", "--count", "10", "--clip", "-1"],
        ["--kind", "gradient", "--count", "10", "--clip", "inf"],
        ["--kind", "gradient", "--count", "10"],  # no --clip
        ["--kind", "banana", "--count", "10", "--clip", "1"],
        ["--kind", "gradient", "--count", "10", "--clip", "1", "--num-classes", "3"],
        ["--kind", "input", "--count", "10", "--num-classes", "1"],
        ["--kind", "input", "--count", "10"],
        ["--kind", "client", "--count", "10", "--clip", "1", "--dim", "0"],
        ["--kind", "client", "--count", "10", "--clip", "1", "--dim", "50", "--rate", "2"],
        [
            "--kind",
            "client",
            "--count",
            "10",
            "--clip",
            "1",
            "--dim",
            "50",
            "--participation",
            "poisson",
        ],  # fmt: skip
        ["--kind", "client", "--count", "10", "--clip", "1", "--dim", "50", "--rate", "0.5"],
    ],
)
def test_refusals_write_nothing(extra, params, tmp_path, capsys):
    out = tmp_path / "set"
    argv = ["canaries", "new", "--out", str(out)] + extra
    if extra[1] == "gradient":
        argv += ["--params", str(params)]
    _one_line_exit_2(argv, capsys)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["params.json"]


def test_refuses_existing_folder_and_bad_params(params, tmp_path, capsys):
    out = tmp_path / "set"
    out.mkdir()
    (out / "x").write_text("keep")
    line = _one_line_exit_2(["canaries", "new", "--kind", "gradient", "--count", "5",
                             "--params", str(params), "--clip", "1", "--out", str(out)],
                            capsys)  # fmt: skip
    assert "--out" in line and sorted(p.name for p in out.iterdir()) == ["x"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [{"name": "a", "shape": [0]}]}')
    line = _one_line_exit_2(["canaries", "new", "--kind", "gradient", "--count", "5",
                             "--params", str(bad), "--clip", "1", "--out", str(tmp_path / "n")],
                            capsys)  # fmt: skip
    assert "shape" in line and not (tmp_path / "n").exists()
    line = _one_line_exit_2(["canaries", "new", "--kind", "gradient", "--count", "5",
                             "--params", str(tmp_path / "none.json"), "--clip", "1",
                             "--out", str(tmp_path / "n")], capsys)  # fmt: skip
    assert "--params" in line and not (tmp_path / "n").exists()


def _claim(tmp_path, name="claim.json", **kw):
    c = dict(level="sample", noise_multiplier=2.0, clipping_norm=1.0, sampling="poisson",
             sample_rate=0.5, steps_per_round=4, rounds=1, claimed_epsilon=3.0, delta=1e-5,
             noise_source="keyed_csprng")  # fmt: skip
    c.update(kw)
    p = tmp_path / name
    p.write_text(json.dumps(c))
    return p


def _obs(tmp_path, cs, **kw):
    f = dict(kind="gradient", set_sha256=cs.sha256, obs=np.zeros((4, cs.count)), sigma=2.0,
             clip=1.0, q=0.5)  # fmt: skip
    f.update(kw)
    return OB.write_observations(tmp_path / "obs.npz", f)


@pytest.mark.parametrize(
    "change, words",
    [
        # a q, C or count of steps other than the claim's is a finding (exit 1), not a
        # usage error: tests/audit/test_hook_slips.py
        (dict(obs=np.zeros((4, 19))), ["shape"]),
        (dict(sigma=np.nan), ["sigma", "not finite"]),
        (dict(set_sha256="0" * 64), ["another canary set"]),
        (dict(kind="client"), ["kind"]),
    ],
)
def test_audit_refuses_inconsistent_observations(change, words, params, tmp_path, capsys):
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0)
    cs = CS.load_canary_set(out)
    obs = _obs(tmp_path, cs, **change)
    line = _one_line_exit_2(["audit", "--canaries", str(out), "--observations", str(obs),
                             "--claim", str(_claim(tmp_path))], capsys)  # fmt: skip
    for w in words:
        assert w in line, line


def test_audit_flag_combinations(params, tmp_path, capsys):
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0)
    cs = CS.load_canary_set(out)
    obs, claim = _obs(tmp_path, cs), _claim(tmp_path)
    _one_line_exit_2(["audit", "--canaries", str(out), "--claim", str(claim)], capsys)
    _one_line_exit_2(["audit", "--canaries", str(out), "--observations", str(obs)], capsys)
    _one_line_exit_2(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
                      str(claim), "--alpha", "1.5"], capsys)  # fmt: skip
    line = _one_line_exit_2(["audit", "--canaries", str(out), "--observations", str(obs),
                             "--claim", str(_claim(tmp_path, "c2.json", level="client",
                             clients_per_round=2, total_clients=2))], capsys)  # fmt: skip
    assert "sample-level" in line
    # zeros everywhere: no noise at all, which the conformance tests see (exit 1), a JSON
    # document; the one-run bound alone would not
    assert main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
                 str(claim), "--json"]) == 1  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "does not implement its claim" and doc["epsilon_lb"] <= 3.0
    assert not doc["leaks_more_than_claimed"] and not doc["conformance"]["passed"]
    assert any(f["code"] == "mechanism_mismatch" for f in doc["findings"])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_release_that_is_not_finite_is_a_finding_not_a_crash(bad, params, tmp_path, capsys):
    """NaN or Inf in what was released (a noisy step): the finding release_nonfinite (error),
    the noise-implied ε ∞, exit 1 with a JSON document; the finite steps are still scored."""
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0)
    cs = CS.load_canary_set(out)
    x = np.random.default_rng(0).normal(size=(4, 20)) * 2.0
    x[2, 3] = bad
    obs = _obs(tmp_path, cs, obs=x)
    rc = main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
               str(_claim(tmp_path)), "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["verdict"] == "does not implement its claim"
    (f,) = [f for f in doc["findings"] if f["code"] == "release_nonfinite"]
    assert f["severity"] == "error" and "1 step(s) (first: 2)" in f["message"]
    c = doc["conformance"]
    assert not c["performed"] and c["implied_epsilon"] == "inf" and "NaN or Inf" in c["reason"]
    assert doc["observations"]["steps"] == 4 and doc["epsilon_lb"] >= 0
    # the human output says it too, without a traceback
    assert main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
                 str(_claim(tmp_path))]) == 1  # fmt: skip
    text = capsys.readouterr().out
    assert "release_nonfinite" in text and "DOES NOT IMPLEMENT ITS CLAIM" in text


def _fixed_key(tmp_path):
    """A fixed key (tests only: reproducible draws)."""
    from fl.privacy.rng import NoiseKey

    (tmp_path / "k").mkdir(exist_ok=True)
    return NoiseKey(bytes(range(32))).write(tmp_path / "k", overwrite=True)


@pytest.mark.parametrize(
    "stated, rc, verdict, severity",
    [
        (2.0, 4, "incomplete", None),
        (0.5, 1, "claim not supported", "error"),
        (3.0, 4, "incomplete", "warning"),
    ],
)
def test_audit_reports_a_different_sigma(stated, rc, verdict, severity, params, tmp_path, capsys):
    """Observations with the claim's noise (σ = 2) and the canaries' C where their coins say:
    a σ the file states otherwise is a finding naming both (not exit 2); the tests use the
    claim's σ. Nothing wrong found, but the claim's Poisson sampling at q = 0.5 was never
    observed (the hook's coins are not the sampler's): incomplete, exit 4."""
    kp = _fixed_key(tmp_path)
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0, key_file=kp)
    cs = CS.load_canary_set(out, key_file=kp)
    coins = O.gradient_coins(cs.key, 4, 20, 0.5)
    x = np.random.default_rng(0).normal(size=(4, 20)) * 2.0 + (coins & cs.included)
    obs = _obs(tmp_path, cs, obs=x, sigma=stated)
    got = main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
                str(_claim(tmp_path)), "--key", str(kp), "--json"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert got == rc and doc["verdict"] == verdict
    if rc == 4:
        assert doc["coverage"]["untested"] == ["sampling"]
        assert "sampler was not observed" in doc["coverage"]["why"]["sampling"]
    c = doc["conformance"]
    assert c["passed"] and c["sigma"] == 2.0 and c["coins"].startswith("re-drawn")
    found = [f for f in doc["findings"] if f["code"] == "stated_sigma_differs"]
    if severity is None:
        assert not found
    else:
        (f,) = found
        assert f["severity"] == severity
        assert f"σ = {stated:g}" in f["message"] and "noise_multiplier = 2" in f["message"]


@pytest.mark.parametrize("content", [b"PK\x03\x04junk", b"garbage\x00", b""])
def test_audit_unreadable_observations(content, params, tmp_path, capsys):
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0)
    obs = tmp_path / "obs.npz"
    obs.write_bytes(content)
    line = _one_line_exit_2(["audit", "--canaries", str(out), "--observations", str(obs),
                             "--claim", str(_claim(tmp_path))], capsys)  # fmt: skip
    assert "--observations" in line


def _q1(tmp_path, params, *, noise=2.0, key=True):
    """A gradient set of 20 canaries at q = 1 (every canary in every step), observations with
    ``noise`` × C of Gaussian noise plus the included canaries' C; (set, obs, claim, key)."""
    kp = _fixed_key(tmp_path)
    out = tmp_path / "set"
    CS.new_canary_set("gradient", 20, out, params=str(params), clip=1.0, key_file=kp)
    cs = CS.load_canary_set(out, key_file=kp)
    x = np.random.default_rng(1).normal(size=(6, 20)) * noise + cs.included[None, :]
    obs = _obs(tmp_path, cs, obs=x, q=1.0)
    claim = _claim(tmp_path, "q1.json", sample_rate=1.0, steps_per_round=6, claimed_epsilon=9.0)
    return out, obs, claim, (["--key", str(kp)] if key else [])


def test_every_part_tested_is_ok_and_a_missing_clip_test_is_incomplete(params, tmp_path, capsys):
    """q = 1 (sampling does not apply), the key at hand (the clipping test runs): ok, exit 0.
    Without the key the canaries' coins are unknown: the clipping test is skipped, the
    verdict incomplete, exit 4, and the output names the untested part and why."""
    out, obs, claim, key = _q1(tmp_path, params)
    argv = ["audit", "--canaries", str(out), "--observations", str(obs), "--claim", str(claim)]
    assert main(argv + key + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "ok" and doc["coverage"]["untested"] == []
    assert doc["coverage"]["tested"]["clipping"] == ["canaries"]
    assert doc["coverage"]["tested"]["accounting"] == ["claim check"]
    assert "sampling" in doc["coverage"]["not_applicable"]
    assert O.exit_code(doc) == 0
    # the set's key withheld: its private/ copy is what load_canary_set finds, so move it
    (out / "private" / "noise.key").unlink(missing_ok=True)
    assert main(argv) == 4
    text = capsys.readouterr().out
    assert "INCOMPLETE: clipping untested (exit 4)" in text
    assert "clipping: UNTESTED (the clipping test needs the canaries' coins" in text
    assert "noise: canaries" in text and "sampling: not applicable" in text


def test_no_noise_at_all_is_noise_absent_not_a_crash(params, tmp_path, capsys):
    """The canaries' C and nothing else (a noise that never reached the release): the scale
    test rejects, the finding noise_absent (error) names it, the implied ε is ∞, exit 1."""
    out, obs, claim, key = _q1(tmp_path, params, noise=0.0)
    rc = main(["audit", "--canaries", str(out), "--observations", str(obs), "--claim",
               str(claim), "--json"] + key)  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["verdict"] == "does not implement its claim"
    codes = {f["code"]: f["severity"] for f in doc["findings"]}
    assert codes.get("noise_absent") == "error" and "mechanism_mismatch" in codes
    assert (
        doc["conformance"]["implied_factor"] == 0 and doc["conformance"]["implied_epsilon"] == "inf"
    )


def test_audit_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["audit", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for line in ("0  pass:", "1  fail:", "2  bad input:", "4  incomplete:"):
        assert line in text, text[-800:]
    assert "untested" in text


def test_a_run_result_that_says_incomplete_exits_4():
    """The CLI's exit code for a run audit's result: an error wins (1); otherwise a result
    whose verdict is incomplete exits 4, and one without a verdict 0, as before."""
    from audit.cli.audit import exit_code

    err = {"code": "epsilon_understated", "severity": "error", "message": "m"}
    assert exit_code({"findings": []}) == 0
    assert exit_code({"findings": [], "verdict": "incomplete"}) == 4
    assert exit_code({"findings": [err], "verdict": "incomplete"}) == 1
    assert exit_code({"findings": [], "tampered": True, "verdict": "incomplete"}) == 1


def test_canary_clients_with_a_nonfinite_round_are_a_finding(tmp_path):
    """Canary clients: a round whose released update projects to NaN is release_nonfinite
    (exit 1), the other rounds still scored, never a usage error."""
    m, d, rounds = 20, 400, 3
    out = CS.new_canary_set("client", m, tmp_path / "set", clip=0.5, dim=d)
    cs = CS.load_canary_set(out)
    rng = np.random.default_rng(0)
    inner = rng.normal(size=(rounds, m))
    inner[1, 4] = np.nan
    obs = OB.write_observations(tmp_path / "obs.npz", dict(
        kind="client", set_sha256=cs.sha256, inner=inner, norms=np.full(rounds, 3.0),
        final_inner=rng.normal(size=m), final_norm=2.0, sigma=4.0, clip=0.5,
        clients_per_round=5))  # fmt: skip
    claim = dict(level="client", noise_multiplier=4.0, clipping_norm=0.5, sampling="all",
                 rounds=rounds, clients_per_round=5, total_clients=5, claimed_epsilon=5.0,
                 delta=1e-5, noise_source="keyed_csprng")  # fmt: skip
    res = O.audit_outside(out, obs, claim)
    (f,) = [f for f in res["findings"] if f["code"] == "release_nonfinite"]
    assert "1 round(s) (first: 1)" in f["message"] and res["observations"]["nonfinite"] == 1
    assert res["verdict"] == "does not implement its claim" and O.exit_code(res) == 1
    assert not res["conformance"]["performed"] and np.isfinite(res["epsilon_lb"])
