"""The canary observations of a pfl simulation tested (:mod:`audit.libraries.pfl`'s
docstring says what each test means): the release's finite rounds, the absence of noise,
the contribution test, the sampling tests of a Poisson claim, the Gaussian conformance
family or the Laplace tests, the noise-implied ε, and which parts of the mechanism they
covered (:class:`audit.coverage.Coverage`).
"""

from __future__ import annotations

import math

import numpy as np

from audit.bounds.conformance import (
    ALPHA_WARN,
    Block,
    GroupTest,
    conformance,
    implied_noise_factor,
)
from audit.claims.implied import epsilon_of_scaled_claim
from audit.claims.mistakes import reference
from audit.coverage import Coverage
from audit.libraries.common import sampling_group_tests
from audit.libraries.pfl.run import finding
from audit.libraries.pfl.stats import contribution_test, laplace_epsilon, laplace_tests

__all__ = ["finite_rounds", "implied_epsilon", "noise_absent", "run_tests"]


def finite_rounds(obs: np.ndarray, findings: list) -> np.ndarray:
    """The rounds whose canary block is finite; ``release_nonfinite`` (ε = ∞) naming the
    others (a diverged model or a broken mechanism: a release that is not a number is not
    noised)."""
    fin = np.isfinite(obs).all(axis=1) if obs.size else np.ones(len(obs), dtype=bool)
    if not fin.all():
        bad = [int(t) + 1 for t in np.flatnonzero(~fin)]
        findings.append(
            finding(
                "release_nonfinite",
                f"{len(bad)} round(s) released a noised sum holding NaN or Inf on the canary "
                f"block (rounds {bad[:8]}{'…' if len(bad) > 8 else ''}): a release that is "
                "not a number is not noised, ε = ∞; left out of the tests",
            )
        )
    return fin


def noise_absent(r: np.ndarray, claimed_noise: float, positions: dict, sigma: float):
    """``noise_absent`` when the residuals carry no noise (RMS below 10⁻³ of the claimed
    σ) or the mechanism's σ is 0, naming a postprocessor placed after the mechanism."""
    rms = float(np.sqrt(np.mean(r**2))) if r.size else math.nan
    if not (sigma <= 0 or rms < 1e-3 * claimed_noise):
        return None
    if positions["observer"] > positions["mechanism"]:
        msg = (
            f"canaries.postprocessor is at position {positions['observer']}, after the "
            f"mechanism ({positions['mechanism']}): pfl runs the server steps in reverse "
            "order, so it read the sum BEFORE the noise; put it first"
        )
    else:
        msg = f"the mechanism added no noise to the canary block (its σ is {sigma:g})"
    return finding("noise_absent", msg + "; ε = ∞")


def run_tests(audit, u, k, c, *, kind, alpha, permutations, seed, cov: Coverage, notes: list):
    """(conformance result, sampling test or None, contribution estimate or None) of the
    observations ``u`` (T, M) in units of C and the draws ``k``; fills ``cov``."""
    inc = audit.canaries.included
    r = u - k
    claimed_noise = c.noise_multiplier
    extra: list[GroupTest] = []
    ctest, contrib = contribution_test(u, k, alpha=alpha, symmetric_exact=kind == "laplace")
    if ctest is not None:
        extra.append(ctest)
        if not any(n.startswith("clipping:") for n in notes):
            cov.add("clipping", "canaries (contribution test: a draw adds at most C)")
        else:
            cov.skip("clipping", "pfl's clip did not scale the canary's update to exactly C")
    else:
        cov.skip("clipping", "no canary user was drawn")
    samp = None
    q_claim = (
        c.clients_per_round / c.total_clients if c.clients_per_round and c.total_clients else 1
    )
    if c.sampling == "poisson" and q_claim < 1 and inc.any():
        sd = claimed_noise * (math.sqrt(2) if kind == "laplace" else 1.0)
        samp, tests, _ = sampling_group_tests(
            u, k, inc, sd, q_claim, permutations=permutations, seed=seed,
            note="Poisson draws are exchangeable over rounds",
        )  # fmt: skip
        extra += tests
        cov.add("sampling", "canaries (the draws' rate and exchangeability)")
    m = audit.canaries.m
    if kind == "gaussian":
        block = Block(
            u=r,
            tracks=np.arange(m),
            groups=np.array(["canary"] * m),
            sigma=claimed_noise,
            included=inc.copy(),
            coins=None,
            q=1.0,
            p_include=audit.canaries.p_include,
        )
        conf = conformance([block], alpha=alpha, extra=tuple(extra), warn_alpha=ALPHA_WARN)
        cov.add("noise", "canaries (scale, freshness)")
    else:
        lap = laplace_tests(r, claimed_noise, alpha=alpha)
        conf = conformance([], alpha=alpha, extra=tuple(lap + extra), warn_alpha=ALPHA_WARN)
        cov.add("noise", "canaries (Laplace scale and freshness, Anderson)")
        notes.append(
            "the Gaussian conformance tests (Laplace noise: the Anderson scale and "
            "freshness tests and the contribution t-test, asymptotic under Laplace noise, "
            "stand in)"
        )
    return conf, samp, contrib


def implied_epsilon(kind, conf, run_claim, c, T: int, sens, infinite: bool):
    """(noise factor, its group, implied ε, at_least); ∞ when ``infinite`` (no noise, a
    release not finite) or the run had no noise to scale."""
    f, group = implied_noise_factor(conf)
    if infinite or run_claim is None and kind == "gaussian":
        return f, group, math.inf, False
    if kind == "gaussian":
        eps, at_least = epsilon_of_scaled_claim(
            reference(run_claim), c.noise_multiplier, f, c.delta
        )
        return f, group, eps, at_least
    return f, group, laplace_epsilon(c.noise_multiplier * f, T, c.delta, sens), False
