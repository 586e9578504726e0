"""Sampler canaries: the permutation test (audit.bounds.sampling) is exact under i.i.d.
steps whatever σ and q, catches a cycled or shuffled schedule, and, on engine runs, the
canary rows go through the trainer's own sampler: a correct run passes and the planted
fault fixed_batches is a mechanism_mismatch of the group "sampler"."""

import numpy as np
import pytest
from scipy import stats

from audit.bounds.sampling import sampling_test
from fl.privacy import rng as R
from fl.privacy import sampler_canaries as SC
from fl.testing import tiny_config


def _series(rng, T, M, q, sigma, kind):
    if kind == "poisson":
        s = rng.random((T, M)) < q
    elif kind == "cycled":  # the same phase every epoch
        L = int(round(1 / q))
        s = (np.arange(T)[:, None] % L) == rng.integers(0, L, M)[None, :]
    else:  # reshuffled every epoch: once per epoch, at a fresh phase
        L = int(round(1 / q))
        s = np.zeros((T, M), bool)
        for e in range(0, T, L):
            ph = rng.integers(0, min(L, T - e), M)
            s[e + ph, np.arange(M)] = True
    return s + sigma * rng.normal(size=(T, M))


def test_p_values_are_uniform_under_iid_steps():
    """200 null runs (Poisson coins, Gaussian noise, σ and q varied), a fixed Monte Carlo
    of 99 permutations: the p-values are uniform (Kolmogorov–Smirnov) and the rejection
    rate at 0.1 is at most 0.1 + 3 SE."""
    rng = np.random.default_rng(0)
    ps = []
    for i in range(200):
        q, sigma = (0.25, 1.0) if i % 2 else (0.1, 2.5)
        u = _series(rng, 20, 40, q, sigma, "poisson")
        ps.append(sampling_test([(u, sigma, q)], permutations=99, seed=i, stop_after=None).p_value)
    assert stats.kstest(ps, "uniform").pvalue > 0.01
    assert np.mean(np.array(ps) <= 0.1) <= 0.1 + 3 * np.sqrt(0.09 / 200)


def test_sequential_p_values_are_valid_and_stop_early():
    """Besag–Clifford's sequential p (h = 20 exceedances): over 300 null runs P(p ≤ a) ≤ a
    + 3 SE at a = 0.05, 0.2, 0.5, and the test stops after a few hundred permutations on
    average (the maximum is 19 999)."""
    rng = np.random.default_rng(5)
    ps, used = [], []
    for i in range(300):
        q, sigma = (0.25, 1.0) if i % 2 else (0.1, 2.5)
        res = sampling_test([(_series(rng, 20, 30, q, sigma, "poisson"), sigma, q)], seed=i)
        ps.append(res.p_value)
        used.append(res.permutations)
    ps = np.array(ps)
    for a in (0.05, 0.2, 0.5):
        assert np.mean(ps <= a) <= a + 3 * np.sqrt(a * (1 - a) / 300)
    assert np.mean(used) < 2000 and max(used) <= 19_999


@pytest.mark.parametrize("kind, which", [("cycled", "p_phase"), ("reshuffled", "p_window")])
def test_non_poisson_schedules_are_rejected(kind, which):
    """T = 20 steps (five epochs of 4) of 1 500 canaries at q = 0.25, σ = 1: the statistic's
    z is 44-52 (cycled, phase; 24.5-27.2 at the T = 12 used for it, three epochs, 0.6 of
    the permutations' cost) and 8.2-11.6 (reshuffled, window) over seeds 1-6,
    where a permuted maximum of six standardised statistics passes z = 6 with a probability
    of about 6e-9 per permutation: none of the 1 999 reaches it. The count dispersion's
    standard error, √(2/M)/(q(1 − q)) ≈ 0.19, does not depend on T: M stays 1 500 for it
    (0.5 sits 2.6 standard errors from both 0 and Poisson's 1)."""
    T = 12 if kind == "cycled" else 20
    rng = np.random.default_rng(1)
    res = sampling_test([(_series(rng, T, 1500, 0.25, 1.0, kind), 1.0, 0.25)], 1999, seed=1)
    # no permutation reaches the observed statistic: p at the Monte Carlo's floor
    assert getattr(res, which) == res.p_value == 1 / 2000
    assert res.permutations == 1999
    assert res.count_dispersion < 0.5  # Binomial's dispersion is 1


def test_a_cycled_epoch_longer_than_one_over_q_is_seen():
    """A trainer whose epoch is ceil(n/B) = 5 steps at q = 0.25 (not round(1/q) = 4): the
    phase statistic at L = 5 sees the cycle (one of the windows tried). Five epochs (T =
    25) of 300 canaries (800 before: a third of the permutations' cost) give it z = 18-24
    over seeds 2-5, far above both what the 1 999 permutations reach and the other windows'
    statistics (z of at most 4.7: window 5 wins by 13 or more)."""
    rng = np.random.default_rng(2)
    T, M, L = 25, 300, 5
    s = (np.arange(T)[:, None] % L) == rng.integers(0, L, M)[None, :]
    u = s + rng.normal(size=(T, M))
    res = sampling_test([(u, 1.0, 0.25)], 1999, seed=2)
    assert res.window == 5 and res.p_value == 1 / 2000


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="steps, canaries"):
        sampling_test([(np.zeros(5), 1.0, 0.5)])
    with pytest.raises(ValueError, match="NaN"):
        sampling_test([(np.full((3, 2), np.nan), 1.0, 0.5)])
    with pytest.raises(ValueError, match="q"):
        sampling_test([(np.zeros((3, 2)), 1.0, 0.0)])
    with pytest.raises(ValueError, match="at least two steps"):
        sampling_test([(np.zeros((1, 2)), 1.0, 0.5)])
    with pytest.raises(ValueError, match="permutations"):
        sampling_test([(np.zeros((3, 2)), 1.0, 0.5)], permutations=5)
    with pytest.raises(ValueError, match="stop_after"):
        sampling_test([(np.zeros((3, 2)), 1.0, 0.5)], stop_after=0)


#: the fixed_batches runs' setting (see the `runs` fixture)
FIXED = dict(
    inject_fault="fixed_batches", noise_multiplier=1.25, batch_size=20, local_steps=20, rounds=1
)

#: fixed keys: the engine-run tests check code paths (the canary rows go through the
#: trainer's sampler; a correct run passes; fixed_batches is rejected), so each run is one
#: reproducible draw. FAULT_KEY is the first key tried; CORRECT_KEY is the one of the four
#: tried whose correct run has a central p (0.03, 0.05, 0.31, 0.12: a fixed draw in the
#: tail passes too, but its Monte Carlo p would sit nearer the test's 0.01)
CORRECT_KEY = R.NoiseKey(bytes(range(2, 34)))
FAULT_KEY = R.NoiseKey(bytes(range(32)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    # σ = 2.2578125 is what ε = 3 calibrates to at q = 0.25 over 32 steps: the same run as
    # with epsilon=3.0, without the calibration's two dozen PLDs (its ledger is ε = 2.998)
    base = dict(
        noise_multiplier=2.2578125,
        batch_size=20,
        local_steps=16,
        sampler_canaries=400,
        canaries=500,
        canary_kind="gradient",
    )
    # The fixed_batches run is smaller: with gradient canaries its test runs all 19 999
    # permutations (Holm over 13 tests needs p = 1/20 000), whose cost is proportional to the
    # sampler canaries M and the steps T, and its statistic's z grows as √(MT)/σ² (module
    # doc of audit.bounds.sampling). At σ = 1.25 (ε = 8's 1.24 before, not 3's 2.26) 60
    # sampler canaries over one round of 20 steps give z = 9.0 with FAULT_KEY, 9.0-11.1
    # over keys 0-3 (40 over two rounds at ε = 8 gave 12.6-13.2; 40 over one round 7.5-9.6
    # over six keys), far past z = 6, which the maximum of six standardised statistics
    # passes with a probability of about 6·10⁻⁹ per permutation: p stays at the floor.
    # FIXED is the three fixed_batches runs' setting: σ given (no calibration) and one
    # round (half the training; two rounds are the correct run's), so the three share the
    # ledger's one PLD (20 steps at σ = 1.25, q = 0.25).
    out = {}
    for name, over, key in (
        ("correct", {}, CORRECT_KEY),
        (
            "fixed",
            dict(FIXED, canaries=500, canary_kind="gradient", sampler_canaries=60),
            FAULT_KEY,
        ),
    ):
        d = tmp_path_factory.mktemp(name) / "run"
        m = train(tiny_config(**{**base, **over}), d, quiet=True, noise_key=key)
        out[name] = (d, m, audit_run(d, one_run=True))
    return out


def test_canary_rows_are_drawn_by_the_trainers_sampler(runs):
    d, m, _ = runs["correct"]
    obs = SC.read_observations(d)
    assert len(obs) == 6  # 3 clients × 2 rounds
    for ob in obs:
        assert ob["obs"].shape == (16, 400)
        assert ob["q"] == pytest.approx(0.25) and ob["clip"] == 1.0
        # C·s + N(0, σ²C²): about q of the entries carry the canary's C
        u = ob["obs"] / ob["clip"]
        assert u.mean() == pytest.approx(0.25, abs=0.12)
        assert u.std() == pytest.approx(np.sqrt(ob["sigma"] ** 2 + 0.1875), rel=0.1)
    # the ledger is the run's without them
    assert m["privacy"]["epsilon"]["pld"] == pytest.approx(3.0, rel=0.01)


def test_correct_sampling_passes_and_fixed_batches_is_a_mismatch(runs):
    ok = runs["correct"][2]["one_run"]["conformance"]
    bad = runs["fixed"][2]
    assert ok["sampling"]["p_value"] > 0.01 and "sampler:sampling" not in ok["rejected"]
    c = bad["one_run"]["conformance"]
    assert "sampler:sampling" in c["rejected"]
    msg = [f["message"] for f in bad["findings"] if f["code"] == "mechanism_mismatch"]
    assert any("Group sampler, sampling test" in x for x in msg)


def test_sampler_canaries_are_refused_where_they_cannot_be_placed():
    from fl.errors import UsageError

    with pytest.raises(UsageError, match="dp-level sample"):
        tiny_config(dp_level="client", epsilon=3.0, sampler_canaries=10).validate()
    with pytest.raises(UsageError, match="sampler_canaries must be >= 0"):
        tiny_config(epsilon=3.0, sampler_canaries=-1).validate()


def test_sampler_canaries_beside_input_canaries_are_tested(tmp_path):
    """A run with input canaries (no white-box noise observations) still gets the sampling
    test, and no noise-implied ε (nothing observed the noise)."""
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    cfg = tiny_config(**FIXED, sampler_canaries=100, canaries=20, canary_kind="mislabel")
    # with input canaries the rows are not a multiple of the batch, so the cycled
    # schedule's epoch is 4 or 5 steps depending on the draw: the test folds by both.
    # 100 sampler canaries at σ = 1.25 over one round (z grows as √(MT)/σ²): the phase z is
    # 12.5 with FAULT_KEY, 8.5-14.5 over keys 0-3 (two rounds at ε = 8 gave 20; 800 at
    # ε = 3 gave 5.5-17.4 over fresh keys); without gradient canaries the test runs 1 999
    # permutations and p <= 0.001 allows one exceedance
    train(cfg, tmp_path / "run", quiet=True, noise_key=FAULT_KEY)
    c = audit_run(tmp_path / "run", one_run=True)["one_run"]["conformance"]
    assert "sampler:sampling" in c["rejected"], c["sampling"]
    assert c["implied_epsilon"] is None and c["blocks"] == 0


def test_sampler_canaries_alone_are_audited(tmp_path, capsys):
    """A run with sampler canaries and no membership canaries: the audit runs the sampling
    test (no ε lower bound, no implied ε, said so) instead of refusing; fixed_batches is a
    mismatch, and the CLI shows the test. 70 sampler canaries at σ = 1.25 over one round
    (z grows as √(MT)/σ²): the phase z is 9.6 with FAULT_KEY, 9.6-15.2 over keys 0-3 (50
    over two rounds at ε = 8 gave 11.2-11.7; 200 at ε = 3 gave 6.2-8.5 over five fresh
    keys), at the floor of the 1 999 permutations. The CLI is ``fedlora audit``'s own entry point, called in this process."""
    from fl.run.engine import train
    from pipeline.cli import main

    cfg = tiny_config(**FIXED, sampler_canaries=70)
    train(cfg, tmp_path / "run", quiet=True, noise_key=FAULT_KEY)
    rc = main(["audit", str(tmp_path / "run"), "--one-run"])
    out = capsys.readouterr()
    assert rc == 1, out.err
    assert "REJECTED: sampler:sampling" in out.out and "sampling test" in out.out
    assert "no ε lower bound" in out.out and "mechanism_mismatch" in out.out


def test_a_run_no_longer_than_an_epoch_has_no_statistic_to_permute():
    """With T ≤ ⌊1/q⌋ every window and epoch spans the run: the statistics are the square of
    the whole sum and Σx², which no permutation moves; standardised, their float rounding
    would rank the observed value at random (a false alarm at any level: seen on a 10-step
    Opacus run, p = 5e-5). They are left out; with none left, p = 1."""
    import numpy as np

    from audit.bounds.sampling import sampling_test

    rng = np.random.default_rng(0)
    for seed in range(5):
        u = rng.normal(size=(8, 50)) + (rng.random((8, 50)) < 0.1)
        t = sampling_test([(u, 1.0, 0.1)], permutations=999, seed=seed)
        assert t.p_value == 1.0 and t.statistics == 0 and t.permutations == 0
    # one step more than the longest window: the windows shorter than the run stay live
    t = sampling_test([(rng.normal(size=(12, 50)), 1.0, 0.1)], permutations=199, seed=1)
    assert 0 < t.statistics < 6 and t.permutations > 0
