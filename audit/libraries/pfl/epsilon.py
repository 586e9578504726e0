"""The ε of the mechanism a pfl simulation ran (:mod:`audit.libraries.pfl`'s docstring says
how each sampling is accounted): every user every round a plain Gaussian at σ, a fixed
cohort σ/2 per round, a fixed cycle its shift per pass (μ-GDP), Laplace by dp-accounting's
PLD; no noise (σ = 0) ε = ∞.
"""

from __future__ import annotations

import math

import numpy as np

from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.check import check_claim
from audit.claims.schema import Claim
from audit.libraries.pfl.stats import laplace_epsilon

__all__ = ["epsilon_of_run"]


def epsilon_of_run(kind: str, run: dict, c: Claim, sigma: float, clip: float, T: int):
    """(ε, the mechanism's record, the run's claim or None, at_least) of the ``T`` rounds
    ``run`` (:meth:`audit.libraries.pfl.checks.PflAudit.run_mechanism`) released at noise
    ``sigma`` (Gaussian σ, Laplace b/C) and clip ``clip``; at_least: sampled with
    replacement, the fixed-cohort figure is a lower bound."""
    at_least = run["sampling"] == "with_replacement"
    if not sigma > 0:
        rec = {"epsilon_pld": math.inf, "mechanism": f"{T} release(s) without noise (σ = 0)",
               "sensitivity": 2}  # fmt: skip
        return math.inf, rec, None, at_least
    n_pop = run["population"]
    cohort = min(int(np.max(run["cohort_size"])), n_pop)
    schema = "all" if run["sampling"] == "all" or cohort >= n_pop else "fixed_batch"
    run_claim = Claim(
        level="client",
        noise_multiplier=sigma,
        sampling=schema,
        rounds=T,
        clients_per_round=n_pop if schema == "all" else cohort,
        total_clients=n_pop,
        clipping_norm=clip,
        claimed_epsilon=c.claimed_epsilon,
        delta=c.delta,
        accounting="composed",
    )
    sens = 1 if schema == "all" else 2
    cyclic = bool(run.get("cyclic"))
    if cyclic:
        # a fixed cycle of P users, B per round: in pass p a neighbour's cohort differs in
        # up to 2·min(p + 1, B) users (pfl_run.sampling_of); per round sensitivity s_t·C
        P, B = int(run["cycle_length"]), cohort
        s_t = np.array([min(2 * (t * B // P + 1), 2 * B) for t in range(T)], dtype=float)
        sens = float(s_t.max())
    if kind == "gaussian" and cyclic:
        mu = float(np.sqrt(np.sum((s_t / sigma) ** 2)))
        eps_run = gdp_epsilon(mu, c.delta) if math.isfinite(mu) else math.inf
        rec = {
            "epsilon_pld": eps_run,
            "mechanism": f"{T} Gaussian release(s) at σ = {sigma:.4g} of a fixed cycle of "
            f"{P} users, {B} per round (pfl's 'minimize_reuse'): a neighbour's cohort "
            f"differs in {int(s_t.min())}…{int(s_t.max())} users per round, μ-GDP",
        }
    elif kind == "gaussian":
        rec = dict(check_claim(run_claim))
        eps_run = rec["epsilon_pld"]
    else:
        eps_run = laplace_epsilon(sigma, T, c.delta, sens=sens)
        rec = {
            "epsilon_pld": eps_run,
            "mechanism": f"{T} Laplace release(s) at b/C = {sigma:.4g}, ℓ1 sensitivity "
            f"{sens}C (dp-accounting PLD)",
            "epsilon_pure": T * sens / sigma if sigma > 0 else math.inf,
        }
    rec["sensitivity"] = sens
    if at_least:
        rec["note"] = (
            "with replacement a user drawn k times adds kC: the fixed-cohort figure is a "
            "lower bound on the run's ε"
        )
    return eps_run, rec, run_claim, at_least
