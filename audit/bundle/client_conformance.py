"""A client-level run's conformance audit: its canary clients' privatized sums tested against
the claimed server-side Gaussian mechanism (:mod:`audit.bounds.conformance`), and the
noise-implied ε.

The observations are the server's privatized clipped sum (clipped client updates, the
canaries that took part, the server's noise; before the division by m) projected on each
canary client's unit direction, in units of C (``proj_rounds`` of
``RUN/private/canary_clients.npz``, :mod:`fl.privacy.canary_clients`). What is tested is
the *claim*: σ and q from the ledger's client-level event of each round, C from the
manifest, the coins drawn again from the run's key
(:func:`audit.canaries.clients.conformance_blocks`). One group, ``clients``. FedPower's
release (a noisy power iteration) is not tested: ``tested`` is False and ``note`` says why.
"""

from __future__ import annotations

from pathlib import Path

from audit.bounds.conformance import TESTS, conformance, implied_noise_factor
from audit.bundle.conformance import coin_stream, implied_epsilon
from audit.canaries import clients as CCA
from audit.findings import Code, Findings

__all__ = ["run_client_conformance"]


def run_client_conformance(run: Path, manifest: dict, delta: float, findings: Findings) -> dict:
    """The conformance tests of a run's canary clients, the noise-implied ε, and a
    ``mechanism_mismatch`` finding per rejected test. ``tested`` False (FedPower, or a
    file without projections) says why in ``note``; ``implied_epsilon`` is then None."""
    stream = coin_stream(Path(run), manifest)
    blocks, info = CCA.conformance_blocks(run, manifest, stream)
    if not blocks:
        return {**info, "implied_epsilon": None, "blocks": 0}
    res = conformance(blocks)
    factor, group = implied_noise_factor(res)
    eps_implied, at_least = implied_epsilon(manifest, factor, delta)
    for t in res.rejected + res.weak:
        where = f"Canary clients, {t.test} test ({TESTS[t.test]}; on the server's privatized sum of client updates)"
        if t.rejected:
            findings.add(
                Code.MECHANISM_MISMATCH,
                f"{where}: rejected at family-wise α = {res.alpha:g} (Holm), {t.evidence()}. "
                "The run does not implement the client-level mechanism its ε was computed for.",
            )
        else:
            findings.add(
                Code.CONFORMANCE_WEAK,
                f"{where}: rejected at family-wise α = {res.warn_alpha:g} but not at the "
                f"verdict's α = {res.alpha:g} (Holm), {t.evidence()}. Weak evidence that the "
                f"run departs from its claim: one correct run in {1 / res.warn_alpha:.0f} "
                "can show it.",
            )
    out = res.to_dict()
    out.update(
        {
            **info,
            "implied_factor": factor,
            "implied_factor_group": group,
            "implied_epsilon": eps_implied,
            "implied_epsilon_at_least": at_least,
            "implied_note": "the ledger's ε with σ times the upper confidence bound on the "
            "observed noise factor (capped at 1): conditional on the noise being Gaussian at "
            "the observed scale; not a certified bound",
            "blocks": len(blocks),
        }
    )
    return out
