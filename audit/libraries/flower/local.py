"""The audit of Flower's ``LocalDpMod``: each canary reply, as the server receives it,
against the mod's (ε, δ) and the claim (:mod:`audit.libraries.flower.checks`).
"""

from __future__ import annotations

import math

import numpy as np

from audit.bounds.conformance import Block, conformance, implied_noise_factor
from audit.bounds.hypothesis import gdp_epsilon
from audit.coverage import Coverage
from audit.libraries.common import one_run_lower_bound
from audit.libraries.flower.verdict import (
    check_fields,
    check_rounds,
    finding,
    implied,
    noise_absent_finding,
    nonfinite_finding,
    result,
)

__all__ = ["audit_local"]


def _ldp_block(u, tracks, bits, c, run, order) -> Block:
    return Block(
        u=u,
        tracks=tracks,
        groups=np.array(["canary"] * len(tracks)),
        sigma=c.noise_multiplier,
        included=np.asarray(bits, dtype=bool).copy(),
        coins=np.ones_like(u, dtype=bool),
        q=1.0,
        p_include=run.canaries.p_include,
        order=(order,),
    )


def audit_local(run, recs, c, alpha, findings: list) -> dict:
    """LocalDpMod: each canary reply, as the server receives it, against the mod's (ε, δ);
    ``findings`` those found before (client failures)."""
    lm = run.local
    untested: list[str] = []
    cov = Coverage().add("accounting", "claim check (ε recomputed: the mod's releases composed)")
    cov.inapplicable(
        "sampling",
        "local DP: each client noises its own reply; the ε composes every round as if the "
        "client were drawn in each (no amplification by sampling)",
    )
    C = float(lm.clipping_norm)
    std = float(lm.sensitivity * math.sqrt(2 * math.log(1.25 / lm.delta)) / lm.epsilon)
    M = run.canaries.m
    inc = run.canaries.included
    rows: dict[int, list[float]] = {j: [] for j in range(M)}
    bad_replies = []
    for r in recs:
        for j, blk in sorted(r.canary_replies.items()):
            x = float(blk[j] - r.before[j]) / C
            if math.isfinite(x):
                rows[j].append(x)
            else:
                bad_replies.append((r.round, j))
    nonfinite_finding(recs, None, findings)
    if bad_replies:
        findings.append(
            finding(
                "release_nonfinite",
                f"{len(bad_replies)} canary replies after LocalDpMod hold NaN or Inf ((round, "
                f"canary) {bad_replies[:6]}): a release that is not a number is not noised, "
                "ε = ∞; left out of the tests",
            )
        )
    releases = max((len(v) for v in rows.values()), default=0)
    run_mech = {
        "api": run.api,
        "clipping_norm": C,
        "sensitivity": float(lm.sensitivity),
        "mod_epsilon": float(lm.epsilon),
        "mod_delta": float(lm.delta),
        "noise_std": std,
        "noise_multiplier": std / C,
        "rounds": len(recs),
        "steps": len(recs),
        "canary_releases_max": releases,
    }
    R = c.rounds * c.steps_per_round
    check_fields(
        c,
        [
            ("noise_multiplier", c.noise_multiplier, std / C),
            ("delta", c.delta, float(lm.delta)),
        ],
        findings,
    )
    check_rounds(c, len(recs), run.rounds, findings)
    # a client may be drawn in every round: its R releases compose (μ-GDP, √R·μ); one
    # release: two clipped updates differ by up to 2C (any two inputs of a client)
    rel = max(R, len(recs))
    eps_2c = gdp_epsilon(math.sqrt(rel) * 2 * C / std, c.delta)
    eps_mod = gdp_epsilon(float(lm.sensitivity) / std, c.delta)
    run_mech["releases_composed"] = rel
    if eps_2c > c.claimed_epsilon * (1 + 1e-6):
        findings.append(
            finding(
                "epsilon_understated",
                f"{rel} LocalDpMod release(s) of one client (noise std {std:.4g}, clip C = "
                f"{C:g}; a client can be drawn every round) are ε = {eps_2c:.4g} at δ = "
                f"{c.delta:g} for two updates 2C apart (any two inputs of a client), above the "
                f"claimed ε = {c.claimed_epsilon:g}; the mod's "
                f"calibration s·sqrt(2 ln(1.25/δ))/ε uses sensitivity s = {lm.sensitivity:g}"
                + (" < 2C" if lm.sensitivity < 2 * C else "")
                + (" and holds for ε ≤ 1 only" if lm.epsilon > 1 else ""),
            )
        )
    # Blocks: (1) the first two replies of every canary that replied twice, one row each
    # (the freshness test compares a client's consecutive releases: a reused draw cancels);
    # (2) every other reply on a track of its own, one row (no earlier residual to predict
    # it from: a canary's few replies would make a noisy predictor and inflate the
    # observed noise, which only the data-pooled shrinkage of (1) keeps small)
    blocks = []
    two = [j for j in range(M) if len(rows[j]) >= 2]
    if two:
        u = np.array([[rows[j][0] for j in two], [rows[j][1] for j in two]])
        blocks.append(_ldp_block(u, np.array(two), inc[two], c, run, 0))
    rest, tracks, bits = [], [], []
    for j in range(M):
        for k, x in enumerate(rows[j]):
            if j in two and k < 2:
                continue
            rest.append(x)
            tracks.append(M * (k + 1) + j)
            bits.append(inc[j])
    if rest:
        blocks.append(_ldp_block(np.array([rest]), np.array(tracks), np.array(bits), c, run, 1))
    conf, f, group, lb, eps_implied = None, None, None, None, math.inf
    why = "no canary reply was received (none drawn, or every one failed)"
    if not blocks:
        for part in ("clipping", "noise"):
            cov.skip(part, why)
    else:
        conf = conformance(blocks)
        f, group = implied_noise_factor(conf)
        absent = noise_absent_finding(conf, f, "the canary replies after LocalDpMod")
        if absent is not None:
            findings.append(absent)
        elif not any(x["code"] == "release_nonfinite" for x in findings):
            eps_implied, _ = implied(
                lambda: (gdp_epsilon(2 / (c.noise_multiplier * f), c.delta), False)
            )
        cov.add("noise", "canaries (scale, freshness of each reply)")
        if inc.any():
            cov.add("clipping", "canaries (an included canary's reply clipped to C)")
        else:
            cov.skip("clipping", "no canary was included (inclusion bits all 0)")
        seen = np.array([bool(rows[j]) for j in range(M)])
        first = np.array([rows[j][0] if rows[j] else 0.0 for j in range(M)])
        lb = one_run_lower_bound(first[seen], inc[seen], run.canaries.p_include, c.delta, alpha)
    untested += [
        "the central aggregate (no central DP claim with LocalDpMod alone)",
        "which rounds draw a given client: the ε composes all the claim's rounds, as if the "
        f"client were drawn in every one (here a canary released up to {releases} times)",
    ]
    return result(
        run,
        c,
        run_mech,
        findings,
        untested,
        conf,
        lb,
        cov,
        why_no_tests=why,
        recomputed_epsilon=eps_2c,
        recomputed_epsilon_at_least=False,
        recomputed={
            "mechanism": f"one Gaussian release, std {std:.4g}, sensitivity 2C = {2 * C:g}",
            "epsilon_at_mod_sensitivity": eps_mod,
        },
        accountant_epsilon=float(lm.epsilon),
        accountant_note="LocalDpMod's own (ε, δ) per release (classic Gaussian calibration)",
        implied_epsilon=eps_implied,
        implied_epsilon_at_least=False,
        noise_factor=f,
        noise_factor_group=group,
        sampling=None,
        canary_contribution=None,
    )
