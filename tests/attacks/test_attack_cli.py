"""`fedlora attack`: files written, --json output, the foreign-adapter form, and one-line
errors with exit code 2."""

import json

import numpy as np
import pytest

from pipeline.cli import main


@pytest.fixture(scope="module")
def run_dir(train_target):
    return train_target("cli", seed=5)[0]


def test_cli_writes_results_and_json(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["attack", str(run_dir), "--attacks", "loss", "--json", "--out", str(out),
               "--device", "cpu", "--bootstrap", "10"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)  # --json: stdout is exactly one JSON document
    assert set(doc["attacks"]) == {"loss", "loss_class"}  # the loss family's two results
    assert list(doc) == ["schema_version", "target", "seed", "attacks", "shadows"]
    assert doc["target"] == {"run_dir": str(run_dir), "model": "tiny-bert", "dataset": "synthetic",
                             "method": "fedavg", "dp_level": "none", "n_members": 16,
                             "n_nonmembers": 8}  # fmt: skip
    assert doc["shadows"] is None and doc["seed"] == 0
    assert (
        json.loads((out / "attacks.json").read_text())["attacks"]["loss"]["auc"]
        == doc["attacks"]["loss"]["auc"]
    )
    z = np.load(out / "scores.npz")
    assert z["loss"].shape == (24,) and z["is_member"].sum() == 16
    assert (out / "roc.png").is_file()


def test_cli_foreign_adapter_matches_run_mode(run_dir, tmp_path, capsys):
    from attacks.rundata import load_run

    run = load_run(run_dir)
    files = {}
    for role in ("member", "nonmember"):
        p = tmp_path / f"{role}s.jsonl"
        with open(p, "w") as fh:
            for t, y in zip(np.array(run.texts)[run.role == role], run.labels[run.role == role]):
                fh.write(json.dumps({"text": str(t), "label": int(y)}) + "\n")
        files[role] = p
    out = tmp_path / "foreign"
    rc = main(["attack", "--adapter", str(run_dir / "adapter"), "--model", "tiny-bert",
               "--members", str(files["member"]), "--nonmembers", str(files["nonmember"]),
               "--max-length", "16", "--base-seed", "5", "--out", str(out),
               "--device", "cpu", "--bootstrap", "0"])  # fmt: skip
    assert rc == 0
    assert "loss" in capsys.readouterr().out  # the table
    rc = main(["attack", str(run_dir), "--attacks", "loss", "--out", str(tmp_path / "r"),
               "--device", "cpu", "--bootstrap", "0"])  # fmt: skip
    assert rc == 0
    a = np.load(out / "scores.npz")["loss"]
    b = np.load(tmp_path / "r" / "scores.npz")["loss"]
    np.testing.assert_allclose(a, b, rtol=1e-5)  # same adapter, same examples, same order


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["attack", "/nonexistent/run"], "run directory not found"),
        (["attack"], "give RUN_DIR"),
        (["attack", "{run}", "--attacks", "loss,nope"], "unknown attack"),
        (["attack", "{run}", "--attacks", "lira", "--shadows", "1"], "shadows >= 2"),
        (["attack", "{run}", "--adapter", "x"], "either RUN_DIR"),
    ],
)
def test_cli_errors_are_one_line_exit_2(run_dir, tmp_path, capsys, argv, msg):
    argv = [a.replace("{run}", str(run_dir)) for a in argv]
    if argv[1:2] == [str(run_dir)]:
        argv += ["--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
