"""What every library audit computes the same way, whatever put the canaries in.

* :func:`one_run_lower_bound` — the certified one-run ε lower bound from canaries whose
  inclusion bits were drawn with probability 1/2: the larger of Steinke et al.'s bound and
  the f-DP one (:mod:`audit.bounds.one_run`, :mod:`audit.bounds.fdp`), each at α/2, so the
  larger holds at 1 − α.
* :func:`sampling_group_tests` — the tests of the sampling a library's sampler gave the
  canaries, as members of the conformance family (:mod:`audit.bounds.conformance`): the
  exact permutation test (:mod:`audit.bounds.sampling`) on the noisy release and on the
  draws themselves, and a binomial test of the included canaries' draw count against q.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from audit.bounds.conformance import GroupTest
from audit.bounds.fdp import fdp_one_run_bound
from audit.bounds.one_run import epsilon_one_run
from audit.bounds.sampling import SamplingTest, sampling_test

__all__ = ["one_run_lower_bound", "sampling_group_tests"]


def one_run_lower_bound(
    scores: np.ndarray, included: np.ndarray, p_include: float, delta: float, alpha: float
) -> dict | None:
    """The one-run ε lower bound at 1 − α from each canary's score (larger: more likely
    included) and its inclusion bit; None unless the bits were drawn with probability 1/2
    and both values occur (the bounds' assumption)."""
    inc = np.asarray(included, dtype=bool)
    if inc.all() or not inc.any() or p_include != 0.5:
        return None
    st = epsilon_one_run(scores, inc, delta, alpha=alpha / 2)
    fd = fdp_one_run_bound(scores, inc, delta, alpha=alpha / 2, family="dp")
    s_lb, f_lb = float(st["epsilon_lb"]), float(fd["epsilon_lb"])
    return {
        "epsilon_lb": max(s_lb, f_lb),
        "bound": "f-DP" if f_lb > s_lb else "Steinke et al.",
        "epsilon_lb_steinke": s_lb,
        "epsilon_lb_fdp": f_lb,
        "canaries": int(len(inc)),
        "included": int(inc.sum()),
        "alpha": alpha,
    }


def sampling_group_tests(
    u: np.ndarray,
    drawn: np.ndarray,
    included: np.ndarray,
    sigma: float,
    q: float,
    *,
    permutations: int,
    seed: int | None,
    note: str,
) -> tuple[SamplingTest, list[GroupTest], dict]:
    """(the release's permutation test, the family members, the draw count) for the
    included canaries: ``u`` (T, M) the release in units of C, ``drawn`` (T, M) whether
    the library's sampler drew each canary (counts are read as drawn when > 0), ``sigma``
    the noise in those units, ``q`` the claimed rate. ``note`` says why the draws are
    exchangeable over steps under the claim (Poisson coins, cohorts drawn afresh)."""
    inc = np.asarray(included, dtype=bool)
    d = np.asarray(drawn) > 0
    samp = sampling_test([(u[:, inc], sigma, q)], permutations=permutations, seed=seed)
    coin = sampling_test(
        [(d[:, inc].astype(float), sigma, q)], permutations=permutations, seed=seed
    )
    tests = [
        GroupTest(
            group=f"sampling:{name}",
            test="exchangeable",
            terms=t.canaries * t.steps,
            statistic=t.z_window,
            log10_p=math.log10(t.p_value),
            note=f"permutation test: {note}",
        )
        for name, t in (("release", samp), ("sampler", coin))
    ]
    n_draw, k_draw = int(d.shape[0] * inc.sum()), int(d[:, inc].sum())
    if n_draw:
        # each included canary is drawn with probability q at each step under the claim: the
        # count is Binomial(T·n, q) (a fixed cohort's count is less spread: conservative; a
        # shuffled epoch has the same mean, so this sees a wrong q, not the shuffle)
        p_rate = float(stats.binomtest(k_draw, n_draw, q).pvalue)
        tests.insert(
            0,
            GroupTest(
                group="sampling:rate",
                test="binomial",
                terms=n_draw,
                statistic=k_draw / (n_draw * q),
                log10_p=math.log10(max(p_rate, 1e-300)),
                note="the included canaries' draws against Binomial(T·n, q)",
            ),
        )
    return samp, tests, {"possible": n_draw, "drawn": k_draw}
