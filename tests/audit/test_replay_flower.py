"""audit.replay.flower: neighbour replay of Flower trainings at client level (#47).

Each training is the Flower benchmark's logistic regression (numpy, 10 clients, cohorts of
m = 6, 10 rounds, σ = 4, C = 0.5), trained in this process through the Flower audit's driver
(:mod:`audit.libraries.replay_glue`): a second or two per replay of two neighbours."""

from __future__ import annotations

import functools
import logging

import pytest

pytest.importorskip("flwr")

from audit.libraries.replay_glue import replay_flower_case  # noqa: E402
from audit.replay.flower import DEFAULT_FLOWER, change_update, summary  # noqa: E402
from benchmarks.auditing.libraries_flower import build  # noqa: E402

logging.getLogger("flwr").setLevel(logging.ERROR)
# flwr's DP modules imported at collection (a few seconds), not inside the first test
build("legacy_server_fixed", quick=True)
build("message_server_fixed", quick=True)


def _replay(mode: str, neighbours=None, build_fn=None, **kw):
    b = build_fn or functools.partial(build, mode, quick=True)
    return replay_flower_case(b, neighbours=neighbours, seed=0, **kw)


def _codes(res: dict) -> set[str]:
    return {f["code"] for f in res["findings"]}


def _by_kind(res: dict) -> dict:
    return {n["neighbour"]: n for n in res["neighbours"]}


@pytest.mark.parametrize("mode", ["legacy_server_fixed", "message_server_fixed"])
def test_correct_server_side_fixed_clipping_passes_within_2C_over_m(mode):
    res = _replay(mode)
    assert res["verdict"] == "pass", res["findings"]
    assert res["releases"] == 10 and not res["findings"]
    assert [n["neighbour"] for n in res["neighbours"]] == list(DEFAULT_FLOWER)
    for n in res["neighbours"]:
        cmp = n["comparison"]
        assert cmp["passed"] and cmp["compared"] >= 1 and cmp["max_ratio"] <= 1 + 1e-4
    # the update norm 10³·C is clipped to C: the aggregate moves by at most 2C/m, and the
    # opposite huge update moves it by more than the replaced one (it is clipped to exactly C)
    k = _by_kind(res)
    assert k["huge"]["comparison"]["max_ratio"] > k["replace"]["comparison"]["max_ratio"]
    assert summary(res) == {"verdict": "pass", "neighbours": 2, "releases": 10, "findings": []}


def test_the_bound_is_2C_over_m_from_the_strategy_and_the_claim():
    """The declared bound of each central release is 2·std/σ = 2C/m; with C = 0.01 every
    update is clipped, so a client replaced by its opposite meets it with equality."""

    def small_clip():
        kw = build("legacy_server_fixed", quick=True)
        kw["strategy"].clipping_norm = 0.01
        kw["claim"]["clipping_norm"] = 0.01
        return kw

    res = _replay("", neighbours="replace,huge", build_fn=small_clip)
    assert res["verdict"] == "pass", res["findings"]
    for n in res["neighbours"]:
        assert n["comparison"]["max_ratio"] == pytest.approx(1.0, abs=1e-4)


def test_huge_num_examples_moves_fedavg_far_beyond_2C_over_m():
    res = _replay("legacy_server_fixed", neighbours="examples")
    assert res["verdict"] == "fail"
    assert "sensitivity_exceeded" in _codes(res)
    assert res["max_ratio"] > 1.2  # the reported size weighs the client ~1, not 1/m


def test_planted_unclipped_aggregate_is_sensitivity_exceeded(monkeypatch):
    """The legacy wrapper's clip planted away (the update passed through as is): the huge
    client moves the aggregate by about 10³·C/m."""
    import flwr.server.strategy.dp_fixed_clipping as dfc

    monkeypatch.setattr(dfc, "compute_clip_model_update", lambda p1, p2, c: None)
    res = _replay("legacy_server_fixed", neighbours="huge")
    assert res["verdict"] == "fail" and "sensitivity_exceeded" in _codes(res)
    assert res["max_ratio"] > 100
    msg = next(f["message"] for f in res["findings"] if f["code"] == "sensitivity_exceeded")
    assert "flower:central" in msg and "round" in msg


def test_sigma_below_the_claim_shrinks_the_bound():
    """The wrapper built with σ/2 while the claim says σ: its noise protects only C/m, so a
    replaced client (2C/m when clipped) exceeds it."""
    res = _replay("sigma_halved", neighbours="replace")
    assert res["verdict"] == "fail" and "sensitivity_exceeded" in _codes(res)


def test_nonfinite_update_and_empty_client_are_findings_not_crashes():
    res = _replay("legacy_server_fixed", neighbours="nan,empty")
    k = _by_kind(res)
    # Flower's clip factor min(1, C/NaN) is 1: the NaN reaches the aggregate
    assert k["nan"]["comparison"]["violations"][0]["nonfinite"]
    # a zero update: Flower's server-side clip divides C by its norm (ZeroDivisionError)
    assert "ZeroDivisionError" in k["empty"]["exception"]
    assert {"sensitivity_exceeded", "data_dependent_release"} <= _codes(res)


def test_local_dp_mod_held_to_its_own_sensitivity():
    ok = _replay("message_local_dp")
    assert ok["verdict"] == "pass", ok["findings"]
    assert ok["releases"] > 10  # one release per client reply
    bad = _replay("local_dp_sensitivity", neighbours="huge")
    assert bad["verdict"] == "fail" and "sensitivity_exceeded" in _codes(bad)


def test_change_update_kinds():
    import numpy as np

    u = [np.array([3.0, 4.0]), np.array([0.0])]
    assert np.allclose(change_update("replace", u, 1.0)[0], [-3, -4])
    huge = change_update("huge", u, 2.0)
    assert np.sqrt(sum(float((a**2).sum()) for a in huge)) == pytest.approx(2000.0)
    assert all((a == 0).all() for a in change_update("empty", u, 1.0))
    assert np.isnan(change_update("nan", u, 1.0)[0]).all()


def test_flower_is_unpatched_after_a_replay():
    import flwr.server.strategy.dp_fixed_clipping as legacy
    import flwr.serverapp.strategy.dp_fixed_clipping as message
    import flwr.supercore.differential_privacy as sdp

    _replay("legacy_server_fixed", neighbours="replace")
    for mod in (sdp, message):
        assert not hasattr(mod.add_gaussian_noise_inplace, "__wrapped__")
    assert legacy.add_gaussian_noise_to_params is sdp.add_gaussian_noise_to_params
