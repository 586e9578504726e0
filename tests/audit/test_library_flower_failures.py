"""audit.libraries.flower (#47): clients that raise or time out are handled as Flower handles
them, fewer replies than the noise assumes and zero or non-finite releases are findings of
their own, never exceptions; the verdict is ``pass`` only when every part was tested; the
supported flwr releases are stated and checked.

Each training is the benchmark's logistic regression (10 clients + 16 canaries, cohorts of
6, 10 rounds), in process: a fraction of a second each."""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("flwr")

from audit.bounds.hypothesis import gdp_epsilon  # noqa: E402
from audit.coverage import EXIT_INCOMPLETE, PARTS  # noqa: E402
from audit.libraries.flower import ClientFailure, FlowerCanaries, FlowerRun  # noqa: E402
from audit.libraries.flower.compat import SUPPORTED, check_version  # noqa: E402
from benchmarks.auditing.libraries_flower import M, build  # noqa: E402


def _run(mode, failures=(), **kw):
    b = build(mode, quick=True)
    claim = b.pop("claim")
    b.update(kw)
    run = FlowerRun(**b, canaries=FlowerCanaries(m=M, seed=0), seed=0, inject_failures=failures)
    return run.run(), claim


def _audit(mode, failures=(), **kw):
    run, claim = _run(mode, failures, **kw)
    return run.audit(claim, permutations=199, seed=0)


def _codes(res) -> dict[str, str]:
    return {f["code"]: f.get("severity", "error") for f in res["findings"]}


@pytest.mark.parametrize(
    "mode,kind", [("legacy_server_fixed", "raise"), ("legacy_server_fixed", "timeout"),
                  ("message_client_fixed", "raise")],
)  # fmt: skip
def test_a_failed_reply_skips_the_round_as_flowers_wrappers_do(mode, kind):
    """Legacy: fit_clients collects the failure and the DP wrapper's aggregate_fit returns
    None; Message API: validate_replies refuses an error reply. The round releases nothing:
    9 of the 10 claimed rounds, a warning, and ε recomputed for the 9."""
    run, claim = _run(mode, [ClientFailure(3, None, kind)])
    rec = next(r for r in run.records if r.round == 3)
    assert rec.after is None and len(rec.failed) == 1
    (why,) = rec.failed.values()
    assert why.startswith("timeout" if kind == "timeout" else ("raised", "error"))
    res = run.audit(claim, permutations=199, seed=0)
    codes = _codes(res)
    assert codes == {"client_failures": "warning", "fewer_rounds_than_claimed": "warning"}
    assert "rounds_mismatch" not in codes
    assert res["verdict"] == "pass" and res["exit_code"] == 0
    assert res["run"]["rounds"] == 9 and res["run"]["rounds_configured"] == 10
    assert res["recomputed_epsilon"] == pytest.approx(gdp_epsilon(2 * math.sqrt(9) / 4, 1e-5))
    msg = next(f["message"] for f in res["findings"] if f["code"] == "client_failures")
    assert "round 3" in msg and "no release" in msg


def test_fewer_replies_than_sampled_under_the_message_api_is_under_noising():
    """Without an accountant the Message API wrapper aggregates the 5 replies it got under
    the noise σ·C/6: each weighs 1/5, the noise is 5/6 of what a contribution needs."""
    res = _audit("message_client_fixed", [ClientFailure(2, None, "timeout")])
    codes = _codes(res)
    assert codes["fewer_replies_than_sampled"] == "error" and res["verdict"] == "fail"
    msg = next(f["message"] for f in res["findings"] if f["code"] == "fewer_replies_than_sampled")
    assert "(2, 5)" in msg and "1/5, not 1/6" in msg
    assert "unequal_weights" not in codes  # the sizes are equal: the count is the cause
    assert res["run"]["replies_min"] == 5 and res["run"]["rounds"] == 10
    # ε at 5 replies: every round at multiplier σ·5/6 (a fixed cohort: sensitivity 2)
    mu = 2 * (6 / 5) * math.sqrt(10) / 4.0
    assert res["recomputed_epsilon"] == pytest.approx(gdp_epsilon(mu, 1e-5), rel=1e-6)
    assert res["recomputed_epsilon"] > res["claimed_epsilon"]


def test_a_run_whose_every_round_failed_is_incomplete_not_an_exception():
    res = _audit("legacy_server_fixed", [(1, None, "raise"), (2, None, "timeout")], rounds=2)
    assert res["verdict"] == "incomplete" and res["exit_code"] == EXIT_INCOMPLETE
    assert res["coverage"]["untested"] == ["sampling", "clipping", "noise"]
    assert res["recomputed_epsilon"] == 0.0 and res["conformance"]["tests"] == []
    assert _codes(res) == {"client_failures": "warning", "fewer_rounds_than_claimed": "warning"}


def test_with_flowers_accountant_a_short_round_is_skipped_not_under_noised():
    res = _audit("message_server_fixed", [ClientFailure(2, None, "timeout")])
    assert "fewer_replies_than_sampled" not in _codes(res)
    assert res["run"]["rounds"] == 9 and res["verdict"] == "pass"


@pytest.mark.parametrize("mode", ["message_local_dp", "legacy_local_dp"])
def test_local_dp_fedavg_aggregates_the_replies_it_has(mode):
    run, claim = _run(mode, [ClientFailure(2, None, "raise"), ClientFailure(3, None, "timeout")])
    assert all(r.after is not None for r in run.records)  # FedAvg drops failures, goes on
    res = run.audit(claim, permutations=199, seed=0)
    assert _codes(res) == {"client_failures": "warning"} and res["verdict"] == "pass"
    assert res["coverage"]["not_applicable"].keys() == {"sampling"}


def test_a_nan_reply_is_a_finding_not_an_exception():
    """NaN passes Flower's clip (min(1, C/NaN) = 1): the release is NaN from then on, and
    the canaries, which copy the NaN model, reach the aggregate unclipped."""
    res = _audit("legacy_server_fixed", [ClientFailure(4, None, "nan")])
    assert {"release_nonfinite", "canary_not_clipped"} <= _codes(res).keys()
    assert res["verdict"] == "fail" and res["implied_epsilon"] == math.inf
    msg = next(f["message"] for f in res["findings"] if f["code"] == "release_nonfinite")
    assert "rounds [4" in msg


def test_local_dp_noise_that_never_reaches_the_reply_is_noise_absent(monkeypatch):
    import flwr.clientapp.mod.localdp_mod as ldp

    monkeypatch.setattr(ldp, "add_gaussian_noise_inplace", lambda arrays, std: None)
    res = _audit("message_local_dp")
    codes = _codes(res)
    assert "noise_absent" in codes and "noise_reused" not in codes
    assert res["implied_epsilon"] == math.inf and res["verdict"] == "fail"


def test_a_wrapper_at_sigma_zero_is_noise_absent_with_infinite_epsilon():
    import flwr.server.strategy as ls

    inner = build("legacy_server_fixed", quick=True)["strategy"].strategy
    res = _audit(
        "legacy_server_fixed",
        strategy=ls.DifferentialPrivacyServerSideFixedClipping(inner, 0.0, 0.5, 6),
    )
    assert {"noise_absent", "noise_multiplier_mismatch"} <= _codes(res).keys()
    assert res["recomputed_epsilon"] == res["implied_epsilon"] == math.inf
    assert res["verdict"] == "fail" and res["conformance"]["tests"] == []


def test_coverage_pass_only_when_every_part_was_tested():
    ok = _audit("legacy_server_fixed")
    assert ok["coverage"]["untested"] == [] and ok["verdict"] == "pass"
    assert all(ok["coverage"]["tested"][p] for p in PARTS)
    # adaptive clipping: the clipped-count release's noise is not observed, so a claim at
    # the worst-case ε is incomplete (exit 4), never pass
    run, claim = _run("legacy_server_adaptive")
    bad = run.audit(claim, permutations=199, seed=0)
    res = run.audit({**claim, "claimed_epsilon": bad["recomputed_epsilon"] * 1.001},
                    permutations=199, seed=0)  # fmt: skip
    assert not [f for f in res["findings"] if f.get("severity", "error") == "error"]
    assert res["verdict"] == "incomplete" and res["exit_code"] == EXIT_INCOMPLETE
    assert res["coverage"]["untested"] == ["noise"]
    assert res["untested"][0].startswith("noise untested: the clipped-count release")


def test_injected_failures_are_checked():
    with pytest.raises(ValueError, match="kind must be one of"):
        ClientFailure(1, 0, "crash")
    with pytest.raises(ValueError, match="round must be an int >= 1"):
        ClientFailure(0)
    with pytest.raises(ValueError, match="10 real clients"):
        _run("legacy_server_fixed", [(2, 10, "raise")])


def test_versions_outside_the_range_are_one_clear_line():
    import flwr

    with pytest.raises(RuntimeError) as err:
        check_version("1.7.0")
    msg = str(err.value)
    assert "1.7.0" in msg and SUPPORTED in msg and "\n" not in msg
    assert check_version("1.8.0") == "1.8.0" and check_version() == flwr.__version__
    with pytest.warns(RuntimeWarning, match="1.50.0 is newer"):
        check_version("1.50.0")


def test_an_old_flwr_is_refused_before_training(monkeypatch):
    import flwr

    b = build("legacy_server_fixed", quick=True)
    b.pop("claim")
    monkeypatch.setattr(flwr, "__version__", "1.7.0")
    with pytest.raises(RuntimeError, match="supports flwr >= 1.8.*installed flwr is 1.7.0"):
        FlowerRun(**b)
    # the benchmark's case code asks the audit first, so its refusal is the one a user sees
    with pytest.raises(RuntimeError, match="supports flwr >= 1.8.*installed flwr is 1.7.0"):
        build("legacy_server_fixed", quick=True)


def test_legacy_api_runs_where_the_message_api_modules_do_not_exist(monkeypatch):
    """flwr 1.20 has no flwr.serverapp.strategy and no flwr.clientapp.mod: the legacy audit
    imports what the release has (simulated by hiding the two packages)."""
    b = build("legacy_local_dp", quick=True)  # the benchmark's builder imports both
    claim = b.pop("claim")
    for name in ("flwr.serverapp.strategy", "flwr.clientapp.mod"):
        monkeypatch.setitem(sys.modules, name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = FlowerRun(**b, canaries=FlowerCanaries(m=M, seed=0), seed=0).run()
        res = run.audit(claim, permutations=199, seed=0)
    assert res["verdict"] == "pass" and res["mode"] == "legacy:local_dp"
    assert np.isfinite(res["recomputed_epsilon"])


def test_the_local_proxy_of_flwr_1_8_gives_what_flowers_own_proxy_gives(monkeypatch):
    """flwr 1.8's DriverClientProxy speaks gRPC, so the audit sends FitIns through
    its own proxy there; on this flwr it must reproduce Flower's proxy exactly (same
    records, failures included)."""
    import audit.libraries.flower.run as run_mod
    from audit.libraries.flower.compat import local_proxy

    fails = [ClientFailure(3, None, "raise"), ClientFailure(5, None, "timeout")]
    own, claim = _run("legacy_local_dp", fails)
    monkeypatch.setattr(run_mod, "grid_proxy", local_proxy)
    ours, _ = _run("legacy_local_dp", fails)
    for a, b in zip(own.records, ours.records, strict=True):
        np.testing.assert_array_equal(a.after, b.after)
        assert a.failed.keys() == b.failed.keys() and a.weights == b.weights
    assert ours.audit(claim, permutations=199, seed=0)["verdict"] == "pass"
