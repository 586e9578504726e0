import contextlib
import io
import json

import pytest

from analysis import claims
from analysis.schemas import SCHEMAS, SchemaError, validate
from pipeline.cli import main


@pytest.fixture(scope="module")
def doc():
    return claims.run(seed=0)


def test_verdicts(doc):
    validate(doc)
    v = {c["id"]: c["holds"] for c in doc["claims"]}
    assert v["fedask_exact"] is True
    assert v["fedask_linear_noise"] is True
    assert v["fedask_updates_both"] is False  # rowspace(A) never moves
    assert v["plora_zero_init_noise"] is True
    assert v["flora_zero_agg_noise"] is True
    # FlexLoRA as trained keeps the exact average on the server: no aggregation noise
    assert v["hetlora_flexlora_both_noises"] is False
    assert v["fedpower_exact_before_refactorization"] is True
    assert v["output_perturbation_far_worse"] is True
    c = {c["id"]: c for c in doc["claims"]}
    assert c["fedask_updates_both"]["measured"]["max_rowspace_angle_rad"] < 1e-10
    assert min(c["fedask_updates_both"]["measured"]["relative_change_of_A_by_round"]) > 0.01
    ex = c["fedask_exact"]["measured"]
    assert ex["independent_a_min_exact_oversketch"] == ex["independent_a_theory_min_oversketch"]


def _cli(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def test_cli_json_only(tmp_path):
    rc, out = _cli(
        [
            "analyze",
            "hetero",
            "--json",
            "--rounds",
            "2",
            "--m",
            "10",
            "--n",
            "10",
            "--ranks",
            "1,2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    doc = json.loads(out)  # the whole stdout is one JSON document
    validate(doc)
    assert json.loads((tmp_path / "hetero.json").read_text()) == doc
    for ext in ("png", "svg"):
        assert (tmp_path / f"hetero.{ext}").stat().st_size > 0


def test_cli_table_and_each_analysis(tmp_path):
    cases = {
        "amplification": [
            "--shapes",
            "12x10x2",
            "--sigmas",
            "0.01,1,10",
            "--trials",
            "4",
            "--powerdp-trials",
            "2",
        ],
        "exactness": ["--m", "10", "--n", "8", "--rank", "2", "--clients", "2"],
        "refactorization": [
            "--m",
            "12",
            "--n",
            "10",
            "--rank",
            "2",
            "--epsilons",
            "1,8",
            "--trials",
            "1",
        ],
    }
    for name, extra in cases.items():
        rc, out = _cli(["analyze", name, "--json", "--out", str(tmp_path / name), *extra])
        assert rc == 0, name
        validate(json.loads(out))
        rc, out = _cli(["analyze", name, "--out", str(tmp_path / name), "--no-figure", *extra])
        assert rc == 0 and "wrote" in out


def test_cli_bad_input(capsys):
    assert main(["analyze", "exactness", "--clients", "x"]) == 2
    assert main(["analyze", "amplification", "--runs", "a"]) == 2
    assert main(["analyze", "hetero", "--runs", "/nonexistent/run"]) == 2
    assert "error" in capsys.readouterr().err


def test_schema_validator_rejects():
    good = {
        "analysis": "hetero",
        "rows": [{"method": "x", "round": 0, "init_noise": 0.0, "agg_noise": None}],
    }
    validate(good)
    for bad in (
        {"analysis": "hetero", "rows": []},
        {"analysis": "hetero", "rows": [{"method": "x", "round": 0, "init_noise": 0.0}]},
        {
            "analysis": "hetero",
            "rows": [{"method": "x", "round": "0", "init_noise": 0.0, "agg_noise": 1.0}],
        },
        {
            "analysis": "hetero",
            "rows": [{"method": "x", "round": 0, "init_noise": float("nan"), "agg_noise": 1.0}],
        },
        {
            "analysis": "amplification",
            "rows": [{"scheme": "b", "sigma": 1.0, "noise_power": 1.0, "closed_form": 1.0}],
            "fits": {"b": {}},
        },
    ):
        with pytest.raises(SchemaError):
            validate(bad)


def test_schemas_are_valid_json_schema(doc):
    import jsonschema

    assert set(SCHEMAS) == {"amplification", "exactness", "hetero", "refactorization", "claims"}
    for s in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(s)  # raises SchemaError if malformed
    jsonschema.validate(json.loads(json.dumps(doc)), SCHEMAS["claims"])
    broken = {k: v for k, v in json.loads(json.dumps(doc)).items() if k != "claims"}
    with pytest.raises(jsonschema.ValidationError, match="claims"):
        jsonschema.validate(broken, SCHEMAS["claims"])  # the schema really constrains


def test_claims_read_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"method": "plora", "config": {}}))
    rows = [
        {"round": 1, "init_noise": 0.0, "agg_noise": 0.1, "a_rowspace_angle": 0.3},
        {"round": 2, "init_noise": 0.0, "agg_noise": 0.1, "a_rowspace_angle": 0.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = claims.run(runs=[run], figure=False)
    validate(d)
    c = {x["id"]: x for x in d["claims"]}
    assert c["fedask_updates_both"]["measured"]["runs_max_a_rowspace_angle_rad"] == 0.5
    assert c["fedask_updates_both"]["holds"] is True  # the run's row space did move
    assert c["plora_zero_init_noise:run"]["holds"] is True
