"""The numeric flags of `fedlora base pretrain` and `fedlora run` (the other commands' are
fuzzed in tests/fl/test_fuzz.py and tests/attacks/test_cli_fuzz.py): 0, negative, NaN,
±inf, huge and text are one line naming the flag, exit 2, and nothing is written."""

import pytest

from pipeline.cli import main

PRETRAIN_INT = ("--vocab-size", "--n-embd", "--n-layer", "--n-head", "--seq-len",
                "--batch-size", "--steps", "--log-every")  # fmt: skip
PRETRAIN_FLOAT = ("--lr", "--warmup", "--weight-decay", "--test-frac")


def _one_line_exit_2(argv, capsys, flag):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refuses what it cannot parse
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, (argv, err)
    name = flag.lstrip("-").replace("-", "_")
    assert flag in err[0] or name in err[0], err
    return err[0]


@pytest.mark.parametrize("value", ["0", "-3", "1e30", "abc", "nan", "inf"])
@pytest.mark.parametrize("flag", PRETRAIN_INT + ("--max-docs", "--seed", "--threads"))
def test_pretrain_int_flags(flag, value, tmp_path, capsys):
    if value == "0" and flag in ("--max-docs", "--seed", "--threads"):
        return  # 0 is valid there (all documents, seed 0, torch's default threads)
    out = tmp_path / "base"
    _one_line_exit_2(["base", "pretrain", flag, value, "--out", str(out)], capsys, flag)
    assert not out.exists()


@pytest.mark.parametrize("value", ["-3", "1e30", "abc", "nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", PRETRAIN_FLOAT)
def test_pretrain_float_flags(flag, value, tmp_path, capsys):
    if value == "1e30" and flag == "--weight-decay":
        value = "-1e30"  # any finite decay >= 0 is valid
    out = tmp_path / "base"
    _one_line_exit_2(["base", "pretrain", flag, value, "--out", str(out)], capsys, flag)
    assert not out.exists()


@pytest.mark.parametrize("value", ["-3", "1e30", "abc", "nan", "99999999999999999999"])
def test_run_seed(value, tmp_path, capsys):
    out = tmp_path / "job"
    _one_line_exit_2(["run", "--preset", "quick", "--seed", value, "--out", str(out)], capsys,
                     "--seed")  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "1", "-3", "1e30", "abc", "nan", "inf"])
def test_audit_alpha(value, tmp_path, capsys):
    """`fedlora audit RUN --alpha A`: A outside (0, 1) is refused before the run is read."""
    line = _one_line_exit_2(["audit", str(tmp_path / "no-such-run"), "--alpha", value], capsys,
                            "--alpha")  # fmt: skip
    assert "Traceback" not in line and not (tmp_path / "no-such-run").exists()
