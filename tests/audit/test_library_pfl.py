"""audit.libraries.pfl: pfl's central mechanisms audited end to end (#43), and the statistics
it adds (audit.libraries.pfl_stats) against closed forms and simulation."""

from __future__ import annotations

import importlib
import math
import sys
import warnings

import numpy as np
import pytest
from scipy import stats

from audit.libraries.pfl_stats import contribution_test, laplace_epsilon, laplace_tests

# 8 rounds of pfl's simulation a case (12 before: each round simulates every user): at the
# cases' seed 3 every assertion below keeps its margin (the noise scale seen at 1.07 of the
# claim's, Laplace's at 0.995, the low scales at 0.53 / 0.50, the weighted contribution at
# 5.25), and all of them held at seeds 0-2 too (the closest: Laplace's scale 0.885 against
# 0.85, its low scale 0.44 against 0.4, at seed 1)
ROUNDS = 8
SIGMA = 2.0


# --- the missing extra ------------------------------------------------------------------


def test_missing_extra_names_the_extra(monkeypatch):
    for name in list(sys.modules):
        if name == "pfl" or name.startswith("pfl.") or name.startswith("audit.libraries.pfl"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pfl", None)  # import pfl -> ImportError
    with pytest.raises(ImportError) as err:
        importlib.import_module("audit.libraries.pfl")
    msg = str(err.value)
    assert "pip install fedlora-audit[pfl]" in msg and "./scripts/setup.sh" in msg
    assert "\n" not in msg


# --- the statistics against closed forms and simulation ----------------------------------


def test_contribution_test_is_a_t_test_whatever_the_noise_scale():
    rng = np.random.default_rng(1)
    T, M, reps = 12, 16, 1500
    rej, ps = 0, []
    for _ in range(reps):
        k = (rng.random((T, M)) < 0.3).astype(float)
        k[:, M // 2 :] = 0  # excluded canaries
        u = k + 3.0 * rng.normal(size=(T, M))  # noise 3x whatever was claimed: still valid
        t, _ = contribution_test(u, k)
        ps.append(t.p_value)
        rej += t.p_value < 0.05
    # exact under H0: p uniform (false alarms ≈ 5 %, sd 0.6 %)
    assert 0.03 < rej / reps < 0.07
    assert stats.kstest(ps, "uniform").pvalue > 1e-3
    # a draw that adds 2C is seen, and its size estimated
    k = np.ones((T, M))
    k[:, M // 2 :] = 0
    u = 2 * k + 0.5 * rng.normal(size=(T, M))
    t, est = contribution_test(u, k)
    assert t.p_value < 1e-20 and abs(est["contribution"] - 2) < 0.15
    assert est["ci"][0] < est["contribution"] < est["ci"][1]
    assert contribution_test(u, np.zeros_like(u)) == (None, None)
    with pytest.raises(ValueError, match="alike"):
        contribution_test(u, k[:, :3])


def test_laplace_tests_valid_with_a_data_term_and_powerful():
    rng = np.random.default_rng(2)
    T, M, b, reps = 12, 16, 2.0, 1500
    alarms_pure = alarms_data = 0
    for _ in range(reps):
        z = rng.laplace(scale=b, size=(T, M))
        pure = laplace_tests(z, b)
        alarms_pure += pure[0].p_value < 0.05
        # a data term independent of the fresh noise (drift and its own noise): |Z + W| ≥_st |Z|
        w = 0.7 * rng.normal(size=(T, M)) + np.linspace(0, 1, T)[:, None]
        with_data = laplace_tests(z + w, b)
        alarms_data += with_data[0].p_value < 0.05 or with_data[1].p_value < 0.05 / 2
    # Σ|Z|/b ~ Gamma(N, 1) exactly: ≈ 5 % false alarms; with a data term at most that
    assert 0.03 < alarms_pure / reps < 0.07
    assert alarms_data / reps < 0.05
    # the Gamma law itself: the mean of Σ|Z|/b is N
    s = [float(np.sum(np.abs(rng.laplace(scale=b, size=(T, M))))) / b for _ in range(400)]
    assert abs(np.mean(s) - T * M) < 4 * math.sqrt(T * M / 400)
    # 0.7 × the scale, and a draw reused at the next round, are seen
    small = laplace_tests(rng.laplace(scale=0.7 * b, size=(T, M)), b)
    assert small[0].p_value < 1e-6 and 0.6 < small[0].ratio < 0.8
    z = rng.laplace(scale=b, size=(T, M))
    z[1::2] = z[0::2]  # every other round repeats the one before: half the differences 0
    assert laplace_tests(z, b)[1].p_value < 0.01
    z[:] = z[0]  # one draw for every round
    assert laplace_tests(z, b)[1].p_value < 1e-10
    with pytest.raises(ValueError, match="positive"):
        laplace_tests(z, 0.0)
    with pytest.raises(ValueError, match="rounds"):
        laplace_tests(z[:1], b)


def test_laplace_epsilon_closed_form():
    # one Laplace release of scale b, sensitivity 1: δ(ε) = 1 − exp((ε − 1/b)/2)
    for b, delta in ((1.0, 0.1), (0.5, 0.05)):
        exact = 1 / b + 2 * math.log(1 - delta)
        assert abs(laplace_epsilon(b, 1, delta) - exact) < 2e-3
    # T releases: below basic composition T/b, above one release
    e = laplace_epsilon(2.0, 20, 1e-5)
    assert laplace_epsilon(2.0, 1, 1e-5) < e < 20 / 2.0
    assert laplace_epsilon(2.0, 20, 1e-5, sens=2) > e
    assert laplace_epsilon(0.0, 3, 1e-5) == math.inf


# --- end to end through pfl -----------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("pfl")
    from benchmarks.auditing.libraries_pfl import simulate

    cache: dict = {}

    def get(mode: str, sim: bool = False):
        """The audit's result of one case (``sim``: the instrumented run and its claim)."""
        if mode not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                audit, claim = simulate(mode, seed=3, rounds=ROUNDS, sigma=SIGMA)
                cache[mode] = (audit, claim, audit.audit(claim, permutations=199, seed=0))
        return cache[mode][:2] if sim else cache[mode][2]

    return get


def _codes(res):
    return {f["code"] for f in res["findings"]}


def _test(res, name):
    return next(t for t in res["conformance"]["tests"] if f"{t['group']}:{t['test']}" == name)


def test_correct_full_participation_passes_and_matches_pfls_accountant(runs):
    res = runs("full_accountant")
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    run = res["run"]
    assert run["sampling"] == "all" and run["steps"] == ROUNDS and run["population"] > 20
    assert run["noise_multiplier"] == pytest.approx(SIGMA, rel=1e-6)
    # every user every round: pfl's PLD at q = 1 and the toolkit's closed form agree
    assert res["accountant_epsilon"] == pytest.approx(res["recomputed_epsilon"], rel=0.01)
    assert 0.85 < _test(res, "canary:scale")["observed_over_claimed"] < 1.15
    assert res["accountant"]["mismatches"] == []
    assert res["accountant"]["understates_run"] is False
    # each included canary user was drawn every round and clipped to C
    assert res["canary_contribution"]["draws"] == ROUNDS * run["included"]
    assert abs(res["canary_contribution"]["contribution"] - 1) < 0.5
    assert res["lower_bound"] is not None and res["epsilon_lower_bound"] < res["claimed_epsilon"]
    # the released model's block moves by the noised sum / the cohort (central SGD, lr 1)
    rel = res["released_model"]
    assert rel["consistent"] and rel["rounds"] == ROUNDS
    assert rel["step_factor"] == pytest.approx([1.0, 1.0], rel=1e-4)
    assert not any("released model" in u for u in res["untested"])


def test_released_model_through_a_stateful_optimizer_is_named_untested():
    pytest.importorskip("pfl")
    from benchmarks.auditing.libraries_pfl import simulate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        audit, claim = simulate(
            "full_accountant", seed=4, rounds=6, sigma=SIGMA, central_optimizer="adam"
        )
        res = audit.audit(claim, permutations=199, seed=0)
    assert res["verdict"] == "pass", res["findings"]  # the mechanism is fine
    assert res["released_model"]["consistent"] is False
    assert any("central optimizer with state" in u for u in res["untested"])


def test_correct_laplace_passes(runs):
    res = runs("laplace_full")
    assert res["verdict"] == "pass", res["findings"]
    assert res["mode"] == "laplace" and res["accountant_epsilon"] is None
    assert 0.85 < _test(res, "laplace:scale")["observed_over_claimed"] < 1.15
    assert any("Gaussian conformance" in u for u in res["untested"])


def test_hand_set_low_sigma_is_flagged(runs):
    res = runs("low_sigma")
    assert res["verdict"] == "fail" and res["exit_code"] == 1
    assert {"noise_multiplier_mismatch", "epsilon_understated", "conformance_rejected"} <= _codes(
        res
    )
    scale = _test(res, "canary:scale")
    assert scale["rejected"] and 0.4 < scale["observed_over_claimed"] < 0.6
    assert res["implied_epsilon"] > res["claimed_epsilon"]


def test_accountant_noise_scale_is_flagged(runs):
    res = runs("noise_scale")
    assert "noise_multiplier_mismatch" in _codes(res)
    assert any("noise_scale = 0.5" in m for m in res["accountant"]["mismatches"])
    assert _test(res, "canary:scale")["rejected"]


def test_weighting_after_the_clip_is_flagged(runs):
    res = runs("weight_after_clip")
    assert {"data_weighted_average", "conformance_rejected"} <= _codes(res)
    assert _test(res, "canary:contribution")["rejected"]
    # the canary users hold 5 rows: each clipped update is multiplied by 5
    assert abs(res["canary_contribution"]["contribution"] - 5) < 0.8


def test_clip_above_the_claim_is_flagged(runs):
    res = runs("clip_mismatch")
    assert "clipping_norm_mismatch" in _codes(res)
    assert res["canary_contribution"]["contribution"] > 1


def test_with_replacement_sampler_is_flagged(runs):
    res = runs("random_sampler")
    assert {"sampling_mismatch", "epsilon_understated"} <= _codes(res)
    assert res["run"]["sampling"] == "with_replacement" and res["run"]["duplicate_draws"] > 0
    assert res["recomputed_epsilon_at_least"] is True
    # pfl's accountant (Poisson) gives far less than the fixed cohort's ε
    assert res["accountant_epsilon"] < res["recomputed_epsilon"]


def test_fixed_cohort_claimed_as_poisson_is_flagged(runs):
    res = runs("accountant_poisson")
    assert {"sampling_mismatch", "epsilon_understated"} <= _codes(res)
    assert res["run"]["sampling"] == "fixed_batch"
    assert any("Poisson" in m for m in res["accountant"]["mismatches"])
    assert res["accountant"]["understates_run"] is True
    assert {"sampling:release:exchangeable", "sampling:rate:binomial"} <= {
        f"{t['group']}:{t['test']}" for t in res["conformance"]["tests"]
    }


def test_laplace_below_the_claimed_scale_is_flagged(runs):
    res = runs("laplace_low_scale")
    assert {"noise_multiplier_mismatch", "epsilon_understated"} <= _codes(res)
    scale = _test(res, "laplace:scale")
    assert scale["rejected"] and 0.4 < scale["observed_over_claimed"] < 0.6


def test_observer_after_the_mechanism_is_named(runs):
    res = runs("observer_after_mechanism")
    msg = next(f["message"] for f in res["findings"] if f["code"] == "noise_absent")
    assert "after the mechanism" in msg and "put it first" in msg


# --- clear errors ---------------------------------------------------------------------------


def test_clear_errors():
    pytest.importorskip("pfl")
    import torch
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    from audit.libraries.pfl import PflCanaries, accountant_claim, attach
    from benchmarks.auditing.libraries_pfl import small_net

    with pytest.raises(ValueError, match="at least two"):
        PflCanaries(m=1)
    with pytest.raises(ValueError, match="p_include"):
        PflCanaries(m=4, p_include=0)
    can = PflCanaries(m=4, seed=0)
    with pytest.raises(ValueError, match="prefix"):
        can.users({can.canary_id(0): [np.zeros((2, 4))]})
    with pytest.raises(ValueError, match="one length"):
        can.users({0: [np.zeros((2, 4)), np.zeros(3)]})
    with pytest.raises(ValueError, match="users\\(data\\)"):
        _ = can.population
    data = can.users({u: [np.zeros((2, 4), np.float32), np.zeros(2, np.float32)] for u in range(3)})
    assert can.population == 3 + int(can.included.sum())
    assert all(len(v) == 3 for v in data.values())

    def pfl_model(module):
        return PyTorchModel(
            module,
            local_optimizer_create=torch.optim.SGD,
            central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
        )

    mech = CentrallyAppliedPrivacyMechanism(GaussianMechanism(1.0, 1.0))
    with pytest.raises(ValueError, match="PflCanaries.model"):
        attach(can, pfl_model(small_net()), [can.postprocessor, mech])
    model = pfl_model(can.model(small_net()))
    with pytest.raises(ValueError, match="canary block is not among"):
        attach(can, pfl_model(small_net()), [can.postprocessor, mech])
    with pytest.raises(ValueError, match="put it first"):
        attach(can, model, [mech])
    with pytest.raises(ValueError, match="local mechanism"):
        attach(can, model, [can.postprocessor, GaussianMechanism(1.0, 1.0)])
    with pytest.raises(ValueError, match="exactly one"):
        attach(can, model, [can.postprocessor])
    audit = attach(can, model, [can.postprocessor, mech])
    claim = {
        "level": "client",
        "noise_multiplier": 1.0,
        "sampling": "all",
        "rounds": 2,
        "clients_per_round": 3,
        "total_clients": 3,
        "claimed_epsilon": 1.0,
        "delta": 1e-5,
    }
    with pytest.raises(ValueError, match="at least 2"):
        audit.audit(claim)  # the simulation never ran

    class Acc:
        sampling_probability, noise_parameter, num_compositions = 0.5, 1.0, 3
        epsilon, delta = 1.0, 1e-5

    with pytest.raises(ValueError, match="sampling_probability"):
        accountant_claim(Acc(), 1.0, 3, 10)


def test_a_fixed_cycle_is_accounted_by_its_shift_per_pass():
    """pfl's minimize_reuse cycles the users in a fixed order: a neighbour's cycle shifts one
    more place each pass, so round t's cohort differs in 2·min(pass + 1, B) users; the
    recomputed ε is that closed form (μ-GDP), and a fixed-cohort claim (σ/2 a round) fails."""
    import math

    from audit.bounds.hypothesis import gdp_epsilon
    from benchmarks.auditing.libraries_pfl import simulate

    # σ given (SIGMA, as the other cases): pfl's accountant takes it instead of calibrating σ
    # to ε = 8 by a binary search of PLD compositions (10-20 s at q < 1). The closed form
    # reads σ from the run and the fixed-cohort claim's ε is computed at the same σ: the
    # recomputed ε is 2.09 × the claimed here (2.0-2.8 over σ = 1, 2, 3 and seeds 0-3; 2.3
    # at the calibrated σ ≈ 0.8), against the 1.5 asked below
    # 12 rounds (not ROUNDS): the cycle's passes, whose shifts the closed form counts
    audit, claim = simulate("cohort_fixed_claim", rounds=12, sigma=SIGMA)
    res = audit.audit(claim, permutations=199, seed=0)
    run = res["run"]
    assert run["cyclic"] and run["cycle_length"] == run["population"]
    P, B, T = run["cycle_length"], 10, 12
    s = [min(2 * (t * B // P + 1), 2 * B) for t in range(T)]
    sigma = float(run["noise_multiplier"])
    mu = math.sqrt(sum((x / sigma) ** 2 for x in s))
    assert res["recomputed_epsilon"] == pytest.approx(gdp_epsilon(mu, claim["delta"]), rel=1e-9)
    assert res["recomputed_epsilon"] > 1.5 * claim["claimed_epsilon"]
    assert res["verdict"] == "fail" and "epsilon_understated" in _codes(res)


def test_canary_users_are_spread_through_the_users_order():
    """A sampler that walks the users in order must meet the canaries early: they are
    placed at random positions, not after 300 real users."""
    import numpy as np

    from audit.libraries.pfl import PflCanaries

    can = PflCanaries(m=64, seed=0)
    data = {u: [np.zeros((2, 4), np.float32), np.zeros(2, np.float32)] for u in range(300)}
    order = list(can.users(data))
    where = [i for i, u in enumerate(order) if can.canary_of(u) is not None]
    assert len(where) == int(can.included.sum()) and min(where) < 50
    assert sorted(order, key=str) == sorted(
        [*data, *(can.canary_id(int(j)) for j in np.flatnonzero(can.included))], key=str
    )


def test_laplace_contribution_uses_the_exact_sign_flip_test():
    """Under Laplace noise with few draws the t-test's tails are too light; the sign-flip
    test is exact for symmetric noise: over 200 null runs with 4 draws each its rejection
    rate at 0.05 is at most 0.05 + 3 SE, and a canary adding 3C is rejected at its floor."""
    rng = np.random.default_rng(3)
    ps = []
    for _ in range(200):
        k = np.zeros((4, 64))
        k.flat[rng.choice(k.size, 4, replace=False)] = 1
        t, _ = contribution_test(k + rng.laplace(size=k.shape), k, symmetric_exact=True)
        ps.append(t.p_value)
    assert np.mean(np.array(ps) <= 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 200)
    k = (rng.random((20, 64)) < 0.3).astype(float)
    t, _ = contribution_test(3 * k + rng.laplace(size=k.shape), k, symmetric_exact=True)
    assert t.p_value == pytest.approx(1 / 20_000)


# --- no pass without a test; zero and non-finite releases are findings (#47) ---------------


def _audit_with_rounds(runs, mutate):
    """The full-participation case audited again after ``mutate`` edited a copy of what
    the observer recorded (the mechanism's output, round by round)."""
    import copy

    audit, claim = runs("full_accountant", sim=True)
    kept = audit.observer.rounds
    audit.observer.rounds = copy.deepcopy(kept)
    try:
        mutate(audit.observer.rounds)
        return audit.audit(claim, permutations=199, seed=0)
    finally:
        audit.observer.rounds = kept


def test_correct_run_tested_every_part(runs):
    res = runs("full_accountant")
    cov = res["coverage"]
    assert cov["untested"] == [] and res["verdict"] == "pass" and res["exit_code"] == 0
    assert cov["not_applicable"] == {"sampling": "every user took part in every round"}
    assert cov["tested"]["clipping"] and cov["tested"]["noise"] and cov["tested"]["accounting"]
    fixed = runs("accountant_poisson")  # a fixed cohort: the sampler's draws are read
    assert fixed["coverage"]["tested"]["sampling"]


def test_a_release_that_is_not_finite_is_a_finding_not_an_exception(runs):
    def nan_round(rounds):
        rounds[3]["obs"][0] = np.nan

    res = _audit_with_rounds(runs, nan_round)
    codes = _codes(res)
    assert "release_nonfinite" in codes and res["verdict"] == "fail"
    assert res["implied_epsilon"] == math.inf
    msg = next(f["message"] for f in res["findings"] if f["code"] == "release_nonfinite")
    assert "rounds [4]" in msg
    # the other rounds were still tested
    assert res["conformance"]["tests"] and res["coverage"]["tested"]["noise"]


def test_fewer_than_two_finite_rounds_test_nothing_and_never_pass(runs):
    def all_nan(rounds):
        for r in rounds[1:]:
            r["obs"][:] = np.inf

    res = _audit_with_rounds(runs, all_nan)
    assert res["verdict"] == "fail" and res["conformance"]["tests"] == []
    assert {"clipping", "noise"} <= set(res["coverage"]["untested"])
    assert res["implied_epsilon"] == math.inf and res["noise_factor"] is None


def test_no_noise_on_the_release_is_noise_absent(runs):
    audit, _ = runs("full_accountant", sim=True)
    key = audit.canaries.canary_of

    def noiseless(rounds):  # the block = C per draw of each canary, no noise at all
        for r in rounds:
            r["obs"][:] = 0.0
            for uid in r["users"]:
                j = key(uid)
                if j is not None:
                    r["obs"][j] += r["clip"]

    res = _audit_with_rounds(runs, noiseless)
    assert "noise_absent" in _codes(res) and res["verdict"] == "fail"
    assert res["implied_epsilon"] == math.inf


def test_pfl_versions_are_stated_and_a_newer_one_is_one_warning_line():
    pytest.importorskip("pfl")
    from audit.libraries.pfl import PFL_VERSION, SUPPORTED
    from audit.libraries.pfl.compat import check_version

    assert "0.1" in SUPPORTED and "0.6" in SUPPORTED
    assert check_version() == PFL_VERSION
    assert check_version("0.1.0") == "0.1.0"  # the first release is in the range
    with pytest.warns(RuntimeWarning, match="0.7.0 is newer") as w:
        check_version("0.7.0")
    assert SUPPORTED in str(w[0].message) and "\n" not in str(w[0].message)


def test_fewer_rounds_than_claimed_is_a_warning_more_is_an_error(runs):
    def stopped_early(rounds):
        del rounds[-3:]

    res = _audit_with_rounds(runs, stopped_early)
    assert res["findings"][0]["code"] == "fewer_rounds_than_claimed"
    assert res["findings"][0]["severity"] == "warning"
    assert res["verdict"] == "pass" and res["run"]["steps"] == ROUNDS - 3
    audit, claim = runs("full_accountant", sim=True)
    more = audit.audit({**claim, "rounds": ROUNDS - 3}, permutations=199, seed=0)
    assert "rounds_mismatch" in _codes(more) and more["verdict"] == "fail"
