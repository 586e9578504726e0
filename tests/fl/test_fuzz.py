"""Fuzzing every parser and the CLI's argument layer: bad input must surface as a
UsageError (one line, exit 2), never as a traceback."""

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl.cli.train import config_from_args
from fl.data.datasets import load_local
from fl.errors import UsageError
from fl.io import read_json
from fl.privacy.ledger import Ledger
from fl.run.config import TrainConfig, load_toml
from pipeline.cli import build_parser, main

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


@functools.cache
def _parser():
    return build_parser()


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FLAGS), VALUES), max_size=6))
def test_train_flags_never_traceback(pairs):
    argv = ["train"] + [x for p in pairs for x in p]
    parser = _parser()  # built once: parse_args does not change the parser (150 builds: ~1 s)
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


# --------------------------------------------------------------------------- numeric flags
# Every numeric flag of `fedlora train` with 0, negative, NaN, inf, huge values and
# non-numbers: each bad one is one line on stderr, exit 2, and nothing in --out (issue 37,
# item 7; issue 36, item 2). Config-level checks reject before any model loads; the
# data-dependent ones (empty clients, too many members) before the tokenizer loads.
HUGE = str(10**30)
BAD_NUMERIC = [
    *[(f, v) for f in ("--max-length", "--members", "--test", "--clients", "--rounds",
                       "--batch-size", "--rank", "--eval-every", "--eval-batch-size")
      for v in ("0", "-1", "nan", "inf", "1e300", HUGE, "x")],
    *[(f, v) for f in ("--nonmembers", "--canaries", "--lora-layers", "--min-client-size",
                       "--head-warmup-rounds", "--seed")
      for v in ("-1", "nan", "inf", HUGE, "x")],
    *[("--local-steps", v) for v in ("0", "-1", "nan", HUGE, "x")],
    *[(f, v) for f in ("--lr", "--alpha", "--clip", "--dirichlet-alpha")
      for v in ("0", "-1", "nan", "inf", "-inf", "x")],
    *[(f, v) for f in ("--head-lr", "--weight-decay", "--local-epochs", "--lora-dropout",
                       "--head-clip-share")
      for v in ("-1", "nan", "inf", "x")],
    ("--clip", "1e300"), ("--local-epochs", "1e300"), ("--lora-dropout", "1"),
    ("--head-clip-share", "1"), ("--max-length", "1000"),  # > tiny-bert's 256 positions
    *[("--clients-per-round", v) for v in ("-1", "nan", "inf", "1e300", "x", "0.5x")],
    *[("--epsilon", v) for v in ("0", "-1", "nan", "inf", "-inf", "1e300", "x")],
    *[("--noise-multiplier", v) for v in ("-1", "-0.5", "nan", "inf", "1e300", "x")],
    *[("--delta", v) for v in ("0", "-1", "1", "nan", "inf", "1e-300", "x")],
]  # fmt: skip
# flags that need DP to be checked at all
_NEEDS_DP = {"--delta", "--clip", "--head-clip-share"}


def _train_argv(flag, value, out):
    from fl.testing import tiny_flags

    base = tiny_flags(members=40, nonmembers=10, test=10, max_length=16, rounds=1,
                      local_steps=1, batch_size=8)  # fmt: skip
    extra = ["--noise-multiplier", "1.0"] if flag in _NEEDS_DP else []
    return ["train", *base, *extra, flag, value, "--out", str(out)]


@pytest.mark.parametrize(("flag", "value"), BAD_NUMERIC, ids=lambda x: str(x)[:12])
def test_bad_numeric_flag_is_one_line_exit_2_and_leaves_nothing(flag, value, tmp_path, capsys):
    out = tmp_path / "run"
    try:
        rc = main(_train_argv(flag, value, out))
    except SystemExit as e:  # argparse: not a number
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (flag, value, err)
    assert len(err) == 1 and err[0].startswith("fedlora: error:"), err
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        # many clients, few members, Dirichlet with a tiny α: some client gets nothing
        ["--clients", "30", "--partition", "dirichlet", "--dirichlet-alpha", "0.01",
         "--min-client-size", "0", "--epsilon", "8"],
        ["--clients", "40", "--partition", "dirichlet", "--dirichlet-alpha", "0.001",
         "--min-client-size", "0"],
        ["--members", "100000"],  # more than the data set holds
        ["--noise-multiplier", "1", "--delta", "0.5"],  # δ >= 1/n
        ["--dataset", "missing.csv"],
        ["--model", "/nonexistent/model"],
        ["--method", "nope"],
        ["--opt", "bogus=1"],
    ],
    ids=["dirichlet-empty", "dirichlet-empty-nodp", "members", "delta-1/n",
         "dataset", "model", "method", "opt"],
)  # fmt: skip
def test_start_failing_on_data_or_options_leaves_nothing(argv, tmp_path, capsys):
    from fl.testing import tiny_flags

    base = tiny_flags(members=40, nonmembers=10, test=10, max_length=16, rounds=1,
                      local_steps=1, batch_size=8)  # fmt: skip
    for out in (tmp_path / "new" / "run", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
            (out / ".keep").write_text("x")  # a hidden file that was there stays
        rc = main(["train", *base, *argv, "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("fedlora: error:"), err
        if out.name == "empty":
            assert sorted(p.name for p in out.iterdir()) == [".keep"]
        else:
            assert not (tmp_path / "new").exists()
