"""Fuzzing every parser and the CLI's argument layer: bad input must surface as a
UsageError (one line, exit 2), never as a traceback."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl.cli import build_parser, main
from fl.cli_train import config_from_args
from fl.config import TrainConfig, load_toml
from fl.data import load_local
from fl.errors import UsageError
from fl.io import read_json
from fl.privacy.accounting import Ledger

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

FLAGS = ["--method", "--model", "--dataset", "--clients", "--clients-per-round", "--rounds",
         "--local-steps", "--batch-size", "--lr", "--rank", "--alpha", "--partition",
         "--dirichlet-alpha", "--dp-level", "--epsilon", "--noise-multiplier", "--delta", "--clip",
         "--seed", "--device", "--opt", "--members", "--max-length", "--client-sampling",
         "--optimizer", "--local-epochs", "--accountant", "--canaries"]  # fmt: skip
VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1", "1e-5", "nan", "inf", "-inf", "0.5", "1.0", "fedavg", "ffa", "x",
                     "sample", "client", "none", "iid", "dirichlet", "poisson", "a=b", "mu=-1", "", "1e309"]),
    st.text(max_size=8),
)  # fmt: skip


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FLAGS), VALUES), max_size=6))
def test_train_flags_never_traceback(pairs):
    argv = ["train"] + [x for p in pairs for x in p]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse rejects with exit 2, one line
        assert e.code == 2
        return
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(cfg, TrainConfig)


@FUZZ
@given(st.binary(max_size=300))
def test_toml_config_never_traceback(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("c") / "c.toml"
    p.write_bytes(data)
    try:
        cfg = TrainConfig.from_dict(load_toml(str(p))).validate()
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert isinstance(cfg, TrainConfig)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from([f.name for f in TrainConfig.__dataclass_fields__.values()] + ["bogus"]),
        st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5), st.booleans(),
                  st.none(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
        max_size=6,
    )
)  # fmt: skip
def test_config_dict_never_traceback(d):
    try:
        cfg = TrainConfig.from_dict(d).validate()
    except UsageError as e:
        assert str(e)
        return
    assert set(d) <= set(cfg.to_dict())


@FUZZ
@given(st.binary(max_size=400), st.sampled_from([".csv", ".jsonl", ".tsv", ".txt"]))
def test_dataset_files_never_traceback(tmp_path_factory, data, suffix):
    p = tmp_path_factory.mktemp("d") / f"d{suffix}"
    p.write_bytes(data)
    try:
        ds = load_local(str(p))
    except UsageError:
        return
    assert len(ds.texts) == len(ds.labels) > 0


JSONISH = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 3),
        st.floats(allow_nan=False),
        st.text(max_size=6),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(JSONISH)
def test_ledger_never_traceback(obj):
    for doc in (obj, {"version": 1, "level": "sample", "delta": 1e-5, "events": obj},
                {"version": 1, "level": "sample", "delta": 1e-5, "events": [obj]}):  # fmt: skip
        try:
            eps = Ledger.from_state_dict(doc).epsilon()
        except UsageError as e:
            assert str(e)
            continue
        assert eps >= 0.0


@FUZZ
@given(st.binary(max_size=200))
def test_read_json_never_traceback(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("j") / "m.json"
    p.write_bytes(data)
    try:
        doc = read_json(p)
    except UsageError as e:
        assert str(p) in str(e) or "not found" in str(e)
        continue_ok = False
    else:
        continue_ok = True
    if continue_ok:
        assert doc == json.loads(data.decode("utf-8"))


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--resume", "/nonexistent"],
        ["train", "--config", "/dev/null"],
        ["nonsense"],
        ["train", "--rounds", "abc"],
    ],
)
def test_cli_entry_one_line_exit_2(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedlora: error:")


def test_manifest_ledger_from_json_roundtrip(tmp_path):
    led = Ledger("sample", 1e-5)
    p = tmp_path / "l.json"
    p.write_text(json.dumps(led.state_dict()))
    assert Ledger.from_state_dict(read_json(p)).epsilon() == 0.0


BAD_VALUES = st.sampled_from(
    ["/nonexistent/x", "nan", "-1", "", "0", "{}", "bogus", "1e309", "-inf"]
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    cmd=st.sampled_from(["analyze", "attack", "audit", "report", "bench", "train"]),
    extra=st.lists(st.tuples(st.sampled_from(["--json", "--out", "--seed", "--runs", "--shadows",
                                              "--attacks", "--claim", "--one-run", "--device", "--bogus"]),
                             BAD_VALUES), max_size=3),
)  # fmt: skip
def test_every_cli_entry_rejects_bad_input_with_one_line(cmd, extra, capsys, tmp_path_factory):
    """Every sub-command, given a nonexistent target and hostile values, exits 2 with one
    line — never a traceback."""
    target = {
        "analyze": ["no-such-analysis"],
        "attack": ["/nonexistent/run"],
        "audit": ["/nonexistent/run"],
        "report": ["/nonexistent/run", "--out", str(tmp_path_factory.mktemp("rep"))],
        "bench": ["no-such-benchmark"],
        "train": ["--resume", "/nonexistent/run"],
    }[cmd]
    argv = [cmd, *target] + [x for pair in extra for x in pair]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("fedlora: error:"), (argv, err)
    assert not any("Traceback" in line for line in err)
