"""audit.libraries.flower: canary clients that travel Flower's own DP path (#43).

Each training is logistic regression (numpy) on synthetic data, 10 clients + 16 canary
clients, cohorts of 6, in this process (no Ray): well under a second each."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("dp_accounting")

from audit.bounds.hypothesis import gdp_epsilon  # noqa: E402
from audit.libraries.flower import FlowerCanaries, FlowerRun, audit_flower  # noqa: E402
from audit.libraries.flower_audit import worst_weight  # noqa: E402
from benchmarks.auditing.libraries_flower import CASES, M, build, run_case  # noqa: E402


def _codes(res: dict) -> set[str]:
    return {f["code"] for f in res["findings"]}


def _scale(res: dict) -> dict:
    return next(t for t in res["conformance"]["tests"] if t["test"] == "scale")


@pytest.mark.parametrize(
    "mode", ["legacy_server_fixed", "message_server_fixed", "message_client_fixed"]
)
def test_correct_fixed_clipping_passes_on_both_apis(mode):
    res = run_case(mode, quick=True, permutations=199)
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    assert res["library"] == "flower" and res["mode"].endswith(mode.split("_", 1)[1])
    run = res["run"]
    assert run["clients_per_round"] == 6 and run["cohort_sizes"] == [6]
    assert run["nodes"] == 10 + M and run["sampling"] == "fixed_batch"
    # a fixed cohort of 6 under add/remove: 10 plain Gaussians at σ/2, μ = 2·√10/σ (σ = 4)
    assert res["recomputed_epsilon"] == pytest.approx(gdp_epsilon(2 * math.sqrt(10) / 4, 1e-5))
    assert 0.8 < _scale(res)["observed_over_claimed"] < 1.25
    # an included canary adds C/m per draw: the aggregation weighed it 1/m
    ci = res["canary_contribution"]["ci999"]
    assert ci[0] < 1 < ci[1]
    assert res["canary_contribution"]["weights_applied"] == pytest.approx([1.0, 1.0])


def test_message_api_accountant_is_reported_beside_the_recomputed_epsilon():
    res = run_case("message_server_fixed", quick=True, permutations=199)
    # Flower's RDP accountant composes 10 Gaussians at σ (no-amplification, add/remove);
    # a fixed cohort lets an added client displace another: σ/2 per round, larger ε
    mu_flower = math.sqrt(10) / 4.0
    assert res["accountant_epsilon"] >= gdp_epsilon(mu_flower, 1e-5)
    assert res["accountant_epsilon"] < res["recomputed_epsilon"]
    assert "no-amplification" in res["accountant_note"]
    claimed = run_case("claims_flower_epsilon", quick=True, permutations=199)
    assert claimed["claimed_epsilon"] == pytest.approx(res["accountant_epsilon"])
    assert "epsilon_understated" in _codes(claimed) and claimed["exit_code"] == 1


def test_unequal_client_sizes_are_flagged_with_the_largest_clients_epsilon():
    res = run_case("legacy_unequal_weights", quick=True, permutations=199)
    assert res["verdict"] == "fail" and res["exit_code"] == 1
    assert {"unequal_weights", "epsilon_understated"} <= _codes(res)
    # sizes 20…400, m = 6: the 400-client with the five smallest weighs 6·400/600 = 4 × 1/m
    assert res["run"]["weight_worst_case"] == pytest.approx(4.0)
    mu = 2 * 4 * math.sqrt(10) / 4.0  # sensitivity 2 (displacement) × a = 4, σ = 4
    assert res["recomputed_epsilon"] == pytest.approx(gdp_epsilon(mu, 1e-5))
    assert res["recomputed_epsilon"] > 5 * res["claimed_epsilon"]
    # the weights the aggregation applied to the canaries (they report the largest size)
    assert res["canary_contribution"]["weights_applied"][1] > 1.2


def test_block_equals_the_canaries_clipped_and_weighted_without_noise():
    """σ = 0 (Flower's legacy wrapper allows it): the released block is exactly the
    drawn canaries' clipped updates C·e_j (10⁻⁹·C for an excluded one) weighted 1/m; the
    real clients' replies leave it untouched; the recorded weights are the reports."""
    import flwr.server.strategy as ls

    kw = _kw()
    kw.pop("claim")
    inner = kw["strategy"].strategy
    kw["strategy"] = ls.DifferentialPrivacyServerSideFixedClipping(inner, 0.0, 0.5, 6)
    can = FlowerCanaries(m=M, seed=3)
    run = FlowerRun(**{**kw, "rounds": 4}, canaries=can, seed=3).run()
    nodes = {n: j for j, n in enumerate(run.canary_nodes)}
    for rec in run.records:
        expect = np.zeros(M)
        for n in rec.cohort:
            if n in nodes:
                j = nodes[n]
                expect[j] = 0.5 * (1.0 if can.included[j] else 1e-9) / 6
        np.testing.assert_allclose(rec.after - rec.before, expect, atol=1e-12)
        assert rec.clip == rec.noise_clip == 0.5
        assert sorted(w for _, w in rec.weights) == [200.0] * 6


def test_worst_weight_closed_form():
    assert worst_weight([5, 5, 5, 5], 3) == pytest.approx(1.0)
    assert worst_weight([1, 2, 3, 10], 2) == pytest.approx(2 * 10 / 11)
    assert worst_weight([1, 2, 3, 10], 4) == pytest.approx(4 * 10 / 16)


def test_sigma_halved_after_the_claim_is_flagged_from_the_data():
    res = run_case("sigma_halved", quick=True, permutations=199)
    assert res["exit_code"] == 1
    assert {"noise_multiplier_mismatch", "epsilon_understated", "conformance_rejected"} <= _codes(
        res
    )
    scale = _scale(res)
    assert scale["rejected"] and 0.4 < scale["observed_over_claimed"] < 0.6
    assert res["noise_factor"] < 0.7


def test_noise_repeated_by_seeded_clients_is_caught_by_the_freshness_test():
    res = run_case("seeded_clients", quick=True, permutations=199)
    assert res["exit_code"] == 1
    assert "canary:fresh" in res["conformance_rejected"]
    assert "noise_reused" in _codes(res)


@pytest.mark.parametrize("mode", ["legacy_server_adaptive", "legacy_client_adaptive"])
def test_adaptive_clipping_is_judged_over_datasets_not_this_runs_path(mode):
    """Flower noises round t at the clip it has just updated; the clip can fall on some
    dataset, so the nominal ε is not what the wrapper gives even when it rose in this run:
    the recomputed ε uses the worst next clip (closed form), and a claim at that ε passes."""
    from scipy import stats

    from audit.libraries.flower import FlowerCanaries, FlowerRun
    from benchmarks.auditing.libraries_flower import M, build

    kw = build(mode, quick=True)
    claim = kw.pop("claim")
    run = FlowerRun(**kw, canaries=FlowerCanaries(m=M, seed=0), seed=0).run()
    bad = run.audit(claim, permutations=199, seed=0)
    clips, noise = (
        np.array(bad["run"]["clipping_norm"]),
        np.array(bad["run"]["noise_clipping_norm"]),
    )
    assert len(clips) == 10 and (np.diff(clips) > 0).all()  # C rising in this run
    assert np.allclose(noise[:-1], clips[1:])  # the noise used the next round's clip
    assert {"noise_at_next_clip", "epsilon_understated"} <= _codes(bad), bad["findings"]
    s = kw["strategy"]
    m, T = s.num_sampled_clients, 10
    z = stats.norm.isf(claim["delta"] / (2 * T))
    r_min = math.exp(
        -s.clip_norm_lr * (1 - s.target_clipped_quantile + z * s.clipped_count_stddev / m)
    )
    assert bad["run"]["noise_ratio_worst_case"] == pytest.approx(r_min, rel=1e-9)
    assert bad["recomputed_epsilon"] > claim["claimed_epsilon"]
    assert any("clipped-count" in u for u in bad["untested"])
    # a claim at the worst-case ε: only the structural warning-free error remains
    ok = run.audit(
        {**claim, "claimed_epsilon": bad["recomputed_epsilon"] * 1.001}, permutations=199
    )
    assert "epsilon_understated" not in _codes(ok) and "noise_at_next_clip" in _codes(ok)


@pytest.mark.parametrize("mode", ["message_local_dp", "legacy_local_dp"])
def test_local_dp_mod_checked_against_its_own_epsilon(mode):
    ok = run_case(mode, quick=True, permutations=199)
    assert ok["verdict"] == "pass", ok["findings"]
    assert ok["mode"] == mode.replace("_", ":", 1)
    std = 2.0 * math.sqrt(2 * math.log(1.25e5))  # sensitivity 2, ε = 1
    assert ok["run"]["noise_std"] == pytest.approx(std)
    # a client may be drawn in each of the 10 rounds: its releases compose (√10·μ)
    assert ok["recomputed_epsilon"] == pytest.approx(gdp_epsilon(math.sqrt(10) * 2 / std, 1e-5))
    assert ok["run"]["releases_composed"] == 10
    bad = run_case("local_dp_sensitivity", quick=True, permutations=199)
    assert "epsilon_understated" in _codes(bad)
    assert bad["recomputed_epsilon"] > 1.5 * bad["claimed_epsilon"]


def test_local_dp_mod_claimed_per_release_is_understated():
    """The mod's (ε, δ) is per release: a claim of that ε for a 10-round training fails."""
    from audit.libraries.flower import FlowerCanaries, FlowerRun
    from benchmarks.auditing.libraries_flower import M, build

    kw = build("message_local_dp", quick=True)
    claim = kw.pop("claim")
    run = FlowerRun(**kw, canaries=FlowerCanaries(m=M, seed=0), seed=0).run()
    per_release = {**claim, "claimed_epsilon": 1.0}
    res = run.audit(per_release, permutations=199)
    assert "epsilon_understated" in _codes(res) and res["verdict"] == "fail"
    assert run.audit({**claim, "rounds": 3}, permutations=199)["verdict"] == "fail"  # rounds


def test_an_aggregator_the_epsilon_does_not_cover_is_refused_before_training():
    import flwr.server.strategy as ls

    from audit.libraries.flower import FlowerRun
    from benchmarks.auditing.libraries_flower import build

    kw = build("legacy_server_fixed", quick=True)
    kw.pop("claim")
    for inner in (ls.Krum(), ls.FedMedian(), ls.FedAvgM()):
        wrapped = ls.DifferentialPrivacyServerSideFixedClipping(inner, 4.0, 0.5, 6)
        with pytest.raises(ValueError, match=f"{type(inner).__name__} is not covered"):
            FlowerRun(**{**kw, "strategy": wrapped})


def test_client_side_wrapper_without_its_mod_is_named_from_the_data():
    res = run_case("client_side_without_mod", quick=True, permutations=199)
    assert "canary_not_clipped" in _codes(res)
    assert "fixedclipping_mod" in next(
        f["message"] for f in res["findings"] if f["code"] == "canary_not_clipped"
    )


def test_result_fills_the_library_benchmark_row():
    from benchmarks.auditing.libraries import row

    res = run_case("message_local_dp", quick=True, permutations=199)
    r = row(res, "correct", "LocalDpMod", res["version"])
    assert r["verdict"] == "pass" and r["steps"] == 10 and r["noise_ratio"] is not None


def test_cases_are_listed_once():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names))
    assert {k for _, k, _ in CASES} == {"correct", "misuse", "library flaw"}


# --- misuse of the call: clear errors


def _kw(mode="legacy_server_fixed"):
    return build(mode, quick=True)


def test_a_strategy_without_dp_is_refused():
    import flwr.server.strategy as ls

    kw = _kw()
    kw["strategy"] = ls.FedAvg()
    with pytest.raises(ValueError, match="not a Flower DP wrapper"):
        audit_flower(**kw)


def test_wrong_client_kind_and_bad_arguments_are_refused():
    kw = _kw()
    claim = kw.pop("claim")
    train = build("message_server_fixed", quick=True)["train"]
    with pytest.raises(ValueError, match="needs client_fn, not train"):
        FlowerRun(**{**kw, "client_fn": None, "train": train})
    with pytest.raises(ValueError, match="rounds must be an int >= 2"):
        FlowerRun(**{**kw, "rounds": 1})
    with pytest.raises(ValueError, match="floating point"):
        FlowerRun(**{**kw, "initial_arrays": [np.zeros(3, dtype=int)]})
    with pytest.raises(ValueError, match="FlowerCanaries.m"):
        FlowerCanaries(m=1)
    with pytest.raises(RuntimeError, match="call run"):
        FlowerRun(**kw).audit(claim)
    with pytest.raises(ValueError, match="level 'client'"):
        audit_flower(
            **kw,
            claim={**claim, "level": "sample", "steps_per_round": 1, "sample_rate": 0.1},
        )


def test_attach_flower_on_a_legacy_strategy_names_the_library_audit(tmp_path):
    import flwr.server.strategy as ls

    from audit.canaries import canary_set as CS
    from audit.canaries.client_hook import ClientCanaryHook
    from fl.errors import UsageError

    out = CS.new_canary_set("client", 4, tmp_path / "set", clip=0.5, dim=10)
    hook = ClientCanaryHook.load(out)
    dp = ls.DifferentialPrivacyServerSideFixedClipping(ls.FedAvg(), 1.0, 0.5, 3)
    with pytest.raises(UsageError, match="audit.libraries.flower"):
        hook.attach_flower(dp)


def test_runs_that_could_not_be_audited_are_refused_before_training():
    import flwr.serverapp.strategy as ms

    from audit.libraries.flower import FlowerCanaries, FlowerRun
    from benchmarks.auditing.libraries_flower import build

    kw = build("message_server_fixed", quick=True)
    kw.pop("claim")
    with pytest.raises(ValueError, match="none of the 2 canary clients"):
        seed = next(s for s in range(100) if not FlowerCanaries(m=2, seed=s).included.any())
        FlowerRun(**kw, canaries=FlowerCanaries(m=2, seed=seed))
    evaluating = ms.DifferentialPrivacyServerSideFixedClipping(
        ms.FedAvg(fraction_train=0.25, fraction_evaluate=1.0), 4.0, 0.5, 6
    )
    with pytest.raises(ValueError, match="fraction_evaluate"):
        FlowerRun(**{**kw, "strategy": evaluating})
    waiting = ms.DifferentialPrivacyServerSideFixedClipping(
        ms.FedAvg(fraction_train=0.25, fraction_evaluate=0.0, min_available_nodes=500), 4.0, 0.5, 6
    )
    with pytest.raises(ValueError, match="min_available_nodes = 500"):
        FlowerRun(**{**kw, "strategy": waiting})


def test_adaptive_noise_below_flowers_own_is_seen_round_by_round(monkeypatch):
    """In adaptive modes the claim's σ is far below the noise Flower adds (σ_Δ·C_(t+1)/C_t),
    so the claim-level scale test is blind to a halved σ_Δ; the per-round group tests each
    round against Flower's own σ_Δ·C_noise/C_t and rejects it."""
    import flwr.server.strategy.dp_adaptive_clipping as dpa

    real = dpa.add_gaussian_noise_to_params

    def halved(params, noise_multiplier, clipping_norm, num_sampled_clients):
        return real(params, noise_multiplier / 2, clipping_norm, num_sampled_clients)

    ok = run_case("legacy_server_adaptive", quick=True, permutations=199)
    per_round = [t for t in ok["conformance"]["tests"] if t["group"] == "canary (round's σ)"]
    assert per_round and not any(t["rejected"] for t in per_round)
    monkeypatch.setattr(dpa, "add_gaussian_noise_to_params", halved)
    bad = run_case("legacy_server_adaptive", quick=True, permutations=199)
    assert "canary (round's σ):scale" in bad["conformance_rejected"]
    assert "canary:scale" not in bad["conformance_rejected"]  # the claim's σ is too low to see it
