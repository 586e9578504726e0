"""The audit of a Flower run with canary clients (:mod:`audit.libraries.flower`).

**Units.** Central DP (the four wrappers): round t's released canary block, minus the block
before the round, times m/C_t (m the wrapper's ``num_sampled_clients``, C_t the clip the
round's updates were clipped at) is u_t: a drawn, included canary adds m·w_j (1 when the
aggregation weighs the m clients equally, as the wrapper's noise σ·C/m assumes), the noise
is N(0, σ_run²·(C_noise,t/C_t)²). :func:`audit.bounds.conformance.conformance` tests it
against the CLAIMED σ (scale, freshness, and the clipping test, which sees a weight above
1/m like a clip above C), with the coins = which canary nodes Flower's sampler drew.
``LocalDpMod``: each canary reply as the server receives it, minus the global block, over C.

**The mechanism the run used**, field by field against the claim (a mismatch is a finding):
σ, C (fixed clipping), m, the cohort sizes, the rounds, and the sampling: Flower draws a
fixed count without replacement (``random.sample``: flwr 1.42 serverapp/strategy/
strategy_utils.py:183, server/client_manager.py), i.e. a fixed cohort (``fixed_batch``),
never Poisson. Its ε is recomputed with :func:`audit.claims.check.check_claim` (add/remove:
a fixed cohort is a plain Gaussian at σ/2 per round). What the run did beyond its
parameters changes that ε, and the recomputed ε is the ε of what it did:

* weights: the weights the inner aggregation read from the replies; the largest real
  client's worst case weight in a cohort (with the m − 1 smallest others) is a·(1/m): its
  ε is that of multiplier σ/a (``unequal_weights``);
* adaptive clipping: Flower adds the round's noise at the clip it updated after the round
  (C_{t+1}), so round t's multiplier is σ_Δ·C_{t+1}/C_t; the clipped-count release has
  multiplier σ_b (``clipped_count_stddev``, sensitivity 1). The run's ε composes both
  exactly (plain Gaussians: μ-GDP).
"""

from __future__ import annotations

import time

from audit.libraries.flower.central import audit_central
from audit.libraries.flower.local import audit_local
from audit.libraries.flower.verdict import check_claim_fields, failure_findings, worst_weight

__all__ = ["audit_run", "check_claim_fields", "worst_weight"]


def audit_run(run, claim, *, alpha: float = 0.05, permutations: int = 19_999, seed=None) -> dict:
    """The claim check, the conformance tests, the sampling tests, the one-run bound and
    the implied ε of ``run`` (a :class:`audit.libraries.flower.FlowerRun` that ran)."""
    t0 = time.time()
    c = check_claim_fields(claim)
    recs = [r for r in run.records if r.after is not None]
    findings = failure_findings(run)
    if run.mode == "local_dp":
        out = audit_local(run, recs, c, alpha, findings)
    else:
        out = audit_central(run, recs, c, alpha, permutations, seed, findings)
    out["audit_seconds"] = time.time() - t0
    return out
