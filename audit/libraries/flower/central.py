"""The audit of Flower's central DP wrappers (server- and client-side, fixed and adaptive
clipping): the mechanism the run used against the claim, its ε, and the canary block's
tests (:mod:`audit.libraries.flower.checks` says what each means).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from audit.bounds.conformance import Block, conformance, implied_noise_factor
from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.check import check_claim
from audit.claims.implied import epsilon_of_scaled_claim
from audit.claims.mistakes import reference
from audit.claims.schema import Claim
from audit.coverage import Coverage
from audit.libraries.common import one_run_lower_bound, sampling_group_tests
from audit.libraries.flower.verdict import (
    check_fields,
    check_rounds,
    finding,
    implied,
    noise_absent_finding,
    nonfinite_finding,
    result,
    worst_weight,
)

__all__ = ["audit_central"]


def _sampling_extra(u, coins, inc, sig_u, q, permutations, seed):
    samp, tests, _ = sampling_group_tests(
        u,
        coins,
        inc,
        sig_u,
        q,
        permutations=permutations,
        seed=seed,
        note="cohorts drawn afresh each round are exchangeable",
    )
    return samp, tests


def audit_central(run, recs, c, alpha, permutations, seed, findings: list) -> dict:
    """The audit of a central DP wrapper's run: ``recs`` the released rounds, ``findings``
    those found before (client failures)."""
    s = run.strategy
    untested: list[str] = []
    cov = Coverage().add("accounting", "claim check (ε recomputed for the mechanism that ran)")
    if not recs:  # every round skipped (failures): nothing released, nothing to test
        check_rounds(c, 0, run.rounds, findings)
        why = "no round was released (Flower skipped every one)"
        for part in ("sampling", "clipping", "noise"):
            cov.skip(part, why)
        mech = {"api": run.api, "rounds": 0, "steps": 0, "rounds_configured": run.rounds}
        return result(run, c, mech, findings, untested, None, None, cov, why_no_tests=why,
                      **_eps(0.0, "nothing released", {"epsilon_pld": 0.0}, None, None,
                             0.0, None, None))  # fmt: skip
    M, K = run.canaries.m, run.k
    pool = K + M
    m = int(s.num_sampled_clients)
    T = len(recs)
    adaptive = run.mode.endswith("adaptive")
    clips = np.array([r.clip for r in recs])
    nclips = np.array([r.noise_clip for r in recs])
    sigmas = sorted({float(r.sigma) for r in recs})
    sig_lib = sigmas[0]  # the least noise of any round: the largest ε (a schedule is named)
    if len(sigmas) > 1:
        findings.append(
            finding(
                "run_not_constant",
                f"the noise multiplier changed during the run ({sigmas[0]:.4g}…{sigmas[-1]:.4g}, "
                "e.g. a schedule set through on_fit_config_fn): ε is recomputed at the "
                "smallest, every round",
            )
        )
    sigma_b = float(getattr(s, "clipped_count_stddev", 0.0) or 0.0)
    if adaptive and sig_lib > 0:
        # the σ the user gave: Flower split it into σ_Δ (updates) and σ_b (count)
        # (flwr 1.42 supercore/differential_privacy.py:129-166)
        sig_user = (sig_lib**-2 + (2 * sigma_b) ** -2) ** -0.5
    else:
        sig_user = sig_lib
    cohorts = [len(r.cohort) for r in recs]
    node_idx = {n: j for j, n in enumerate(run.canary_nodes)}
    # the coins: the canary nodes whose replies the aggregation read (drawn and replied)
    coins = np.zeros((T, M), dtype=bool)
    for t, r in enumerate(recs):
        for n, _ in r.weights:
            if n in node_idx:
                coins[t, node_idx[n]] = True
    # the weights the inner aggregation read (white box) and what they make of a client:
    # a = m·w (1 under the noise σ·C/m); a_size = m'·w over the m' replies (the sizes' part)
    a_run, a_size, a_canary = 1.0, 1.0, []
    for r in recs:
        tot = sum(w for _, w in r.weights)
        for n, w in r.weights:
            a = m * w / tot if tot > 0 else math.inf
            a_run = max(a_run, a)
            a_size = max(a_size, len(r.weights) * w / tot if tot > 0 else math.inf)
            if n in node_idx:
                a_canary.append(a)
    real_sizes = list(run.real_sizes.values())
    # fewer replies than m under the noise σ·C/m (Flower only logs a warning)
    replies = [(r.round, len(r.weights)) for r in recs]
    short = [(rnd, n) for rnd, n in replies if n < m]
    m_rep = min((n for _, n in replies), default=m)
    # the largest client's weight in the cohort that weighs it most: the smallest cohort
    # drawn or aggregated, and never below what the aggregation really applied in this run
    k_min = max(1, min([*cohorts, m_rep]) if cohorts else m_rep)
    a_sizes_worst = worst_weight(real_sizes, k_min)
    a_worst = max(a_sizes_worst * m / k_min, a_run, 1.0)
    run_mech = {
        "api": run.api,
        "noise_multiplier": sig_user,
        "noise_multiplier_updates": sig_lib,
        "clipped_count_stddev": sigma_b if adaptive else None,
        "clipping_norm": float(clips[0]) if not adaptive else clips.tolist(),
        "noise_clipping_norm": None if not adaptive else nclips.tolist(),
        "clients_per_round": m,
        "cohort_sizes": sorted(set(cohorts)),
        "rounds": T,
        "steps": T,
        "nodes": pool,
        "real_clients": K,
        "canaries": M,
        "sample_rate": m / pool,
        "sampling": "fixed_batch",
        "inner_strategy": type(run.inner).__name__,
        "weight_max": a_run,
        "weight_worst_case": a_worst,
        "replies_min": m_rep,
        "rounds_configured": run.rounds,
        "real_client_sizes": sorted(real_sizes),
    }
    checks = [
        ("noise_multiplier", c.noise_multiplier, sig_user),
        ("clients_per_round", c.clients_per_round, m),
    ]
    if not adaptive and c.clipping_norm is not None:
        checks.append(("clipping_norm", c.clipping_norm, float(clips[0])))
    check_fields(c, checks, findings)
    check_rounds(c, T, run.rounds, findings)
    if any(k != m for k in cohorts):
        findings.append(
            finding(
                "cohort_size_mismatch",
                f"Flower drew cohorts of {sorted(set(cohorts))} clients but the wrapper's "
                f"noise σ·C/m is for m = {m} (num_sampled_clients; the sampler draws "
                f"max(int(nodes·fraction), min) of the {pool} nodes)",
            )
        )
    if c.sampling != "fixed_batch" and c.sampling != "shuffle":
        findings.append(
            finding(
                "sampling_mismatch",
                f"the claim's sampling is {c.sampling!r} but Flower draws a fixed count of "
                f"{m} of {pool} nodes without replacement each round (random.sample)",
            )
        )
    # the run's own mechanism and its ε (no noise: ε = ∞, the claim check has no mechanism)
    if not sig_user > 0:
        return _no_noise(run, recs, c, findings, untested, cov, run_mech, sig_user)
    run_claim = Claim(
        level="client",
        noise_multiplier=sig_user,
        sampling="fixed_batch",
        rounds=T,
        clients_per_round=m,
        total_clients=pool,
        clipping_norm=float(clips[0]),
        claimed_epsilon=c.claimed_epsilon,
        delta=c.delta,
        accounting="composed",
    )
    rec_plain = check_claim(run_claim)
    sens = reference(run_claim).sens
    if adaptive:
        sig_t = sig_lib * nclips / clips
        # the worst case over datasets, not this run's path: Flower noises round t's updates
        # (clipped at C_t) at C_(t+1) = C_t·exp(−lr·(f̃ − γ)), f̃ the noised clipped
        # fraction, at most 1 + z·σ_b/m except with probability Φ(−z) per round; so the
        # multiplier is at least σ_Δ·r_min, r_min = exp(−lr·(1 − γ + z·σ_b/m)), with
        # probability 1 − T·Φ(−z), charged to δ (half of it)
        lr = float(getattr(s, "clip_norm_lr", 0.0) or 0.0)
        gamma = float(getattr(s, "target_clipped_quantile", 0.0) or 0.0)
        z = float(stats.norm.isf(c.delta / (2 * T)))
        r_min = min(1.0, math.exp(-lr * (1 - gamma + z * sigma_b / max(m, 1))))
        mu2 = T * (sens * a_worst / (sig_lib * r_min)) ** 2
        if sigma_b > 0:
            mu2 += T / sigma_b**2
        else:
            mu2 = math.inf
        eps_run = gdp_epsilon(math.sqrt(mu2), c.delta / 2) if math.isfinite(mu2) else math.inf
        run_mech["noise_ratio_worst_case"] = r_min
        mech = (
            f"{T} rounds: a fixed cohort's update release at multiplier σ_Δ·r_min = "
            f"{sig_lib:.4g}·{r_min:.4g} (the worst next clip over datasets, lr = {lr:g}, "
            f"target {gamma:g}, z = {z:.3g}; sensitivity {sens}) and the clipped-count release "
            f"(σ_b = {sigma_b:.4g}), μ-GDP at δ/2"
        )
        if r_min < 1:
            findings.append(
                finding(
                    "noise_at_next_clip",
                    severity="error" if eps_run > c.claimed_epsilon * (1 + 1e-6) else "warning",
                    message=f"Flower clips round t's updates at C_t but noises them at the clip it has "
                    f"just updated, C_(t+1) = C_t·exp(−lr·(f̃ − γ)) (dp_adaptive_clipping.py): "
                    f"over datasets the noise can fall to {r_min:.3f}× σ·C_t/m in every round "
                    f"(this run: down to {float(np.min(sig_t / sig_lib)):.3f}× in "
                    f"{int((sig_t < sig_lib * (1 - 1e-9)).sum())} of {T} rounds), so the "
                    f"wrapper's ε at σ is not what it gives: {eps_run:.4g} in the worst case",
                )
            )
        untested.append(
            "the clipped-count release: its noise (σ_b) lives in the server's state and is "
            "not observed; its cost enters the recomputed ε from Flower's own σ_b"
        )
    else:
        eps_run = (
            rec_plain["epsilon_pld"]
            if a_worst <= 1 + 1e-9
            else check_claim({**run_claim.to_dict(), "noise_multiplier": sig_user / a_worst})[
                "epsilon_pld"
            ]
        )
        mech = rec_plain["mechanism"] + (
            f"; the largest client weighs a = {a_worst:.4g} × 1/m" if a_worst > 1 + 1e-9 else ""
        )
    if short:
        findings.append(
            finding(
                "fewer_replies_than_sampled",
                f"{len(short)} released round(s) aggregated fewer replies than the m = {m} the "
                f"noise σ·C/m is for (round, replies: {short[:8]}"
                + ("…" if len(short) > 8 else "")
                + f"): each reply weighs 1/{m_rep}, not 1/{m}, so the noise is {m_rep}/{m} of "
                f"what a client's contribution needs (Flower logs a warning and aggregates); "
                f"at {m_rep} replies the run's ε is {eps_run:.4g} (claimed "
                f"{c.claimed_epsilon:g})",
            )
        )
    if a_size > 1 + 1e-9 or a_sizes_worst > 1 + 1e-9:
        findings.append(
            finding(
                "unequal_weights",
                f"{type(run.inner).__name__} weighs clients by the num_examples they report "
                f"(sizes {min(real_sizes):g}…{max(real_sizes):g}): a client's weight is "
                f"n_k/Σn, not 1/m, up to {a_run:.3f}/m in this run and {a_worst:.3f}/m for the "
                f"largest client in its worst cohort, while the noise σ·C/m is for 1/m; the "
                f"largest client's ε is {eps_run:.4g} (claimed {c.claimed_epsilon:g})",
            )
        )
    if eps_run > c.claimed_epsilon * (1 + 1e-6):
        findings.append(
            finding(
                "epsilon_understated",
                f"the claimed ε = {c.claimed_epsilon:.4g} is below the ε = {eps_run:.4g} of "
                f"the mechanism the run used ({mech})",
            )
        )
    untested.append(
        "the sizes the clients report (num_examples) are taken as public: the weights are "
        "checked as reported; a neighbouring client that reports a larger size weighs more "
        "than any client here (cap the reported size, or weigh clients equally)"
    )
    # Flower's own accountant (Message API fixed clipping with accountant=...)
    acc = getattr(s, "accountant", None)
    eps_acc, acc_note = None, None
    if acc is not None:
        eps_acc = float(acc.get_epsilon(c.delta))
        acc_note = (
            f"Flower's accountant ({acc.config.sampling_method.value}, "
            f"{acc.config.neighboring_relation.value}, {acc.num_releases} releases of a "
            f"Gaussian at σ = {sig_lib:g}, RDP): ε = {eps_acc:.4g}; recomputed (a fixed cohort "
            f"under add/remove: an added client can displace another, σ/2 per round): "
            f"{rec_plain['epsilon_pld']:.4g}"
        )
    else:
        untested.append("Flower's accountant (not enabled: accountant=None or legacy API)")
    # the canary block in units of C_t/m; the rounds whose release is not finite are a
    # finding of their own and left out of the tests
    before = np.array([r.before for r in recs])
    after = np.array([r.after for r in recs])
    with np.errstate(invalid="ignore", over="ignore"):
        u = (after - before) * (m / clips[:, None])
    bad = nonfinite_finding(recs, u, findings)
    u, coins, clips, nclips, sig_t = (
        x[~bad] for x in (u, coins, clips, nclips, sig_t if adaptive else clips)
    )
    T = len(u)
    if T < 2:
        why = f"{T} released round(s) with a finite canary block; the tests need 2"
        for part in ("sampling", "clipping", "noise"):
            cov.skip(part, why)
        return result(run, c, run_mech, findings, untested, None, None, cov, why_no_tests=why,
                      **_eps(eps_run, mech, rec_plain, eps_acc, acc_note, math.inf, None, None))  # fmt: skip
    inc = run.canaries.included
    q = m / pool
    sig_u = c.noise_multiplier
    samp, extra = _sampling_extra(u, coins, inc, sig_u, q, permutations, seed)
    block = Block(
        u=u,
        tracks=np.arange(M),
        groups=np.array(["canary"] * M),
        sigma=sig_u,
        included=inc.copy(),
        coins=coins,
        q=q,
        p_include=run.canaries.p_include,
    )
    blocks = [block]
    if adaptive:
        # the claim's σ says little here (Flower's update noise is σ_Δ·C_(t+1)/C_t, 1.8–4.7×
        # it in the benchmark): the same observations also tested, round by round, against
        # the noise Flower says it adds that round (σ_Δ·C_noise/C_t), as a group of its own
        # (tracks apart, so the predictors do not mix)
        blocks += [
            Block(
                u=u[t : t + 1],
                tracks=M + np.arange(M),
                groups=np.array(["canary (round's σ)"] * M),
                sigma=float(sig_t[t]),
                included=inc.copy(),
                coins=coins[t : t + 1],
                q=q,
                p_include=run.canaries.p_include,
            )
            for t in range(T)
        ]
    conf = conformance(blocks, extra=tuple(extra))
    f, group = implied_noise_factor(conf)
    absent = noise_absent_finding(conf, f, "the released global model's canary block")
    if absent is not None:
        findings.append(absent)
    if absent is not None or any(x["code"] == "release_nonfinite" for x in findings):
        eps_implied, at_least = math.inf, False
    else:
        eps_implied, at_least = implied(
            lambda: epsilon_of_scaled_claim(reference(run_claim), c.noise_multiplier, f, c.delta)
        )
    if inc.any():
        cov.add("sampling", "canaries (Flower's sampler draws, the release)")
    else:
        cov.skip("sampling", "no canary was included (inclusion bits all 0)")
    if adaptive:
        cov.skip(
            "noise",
            "the clipped-count release's noise (σ_b) lives in the server's state and is not "
            "observed (the updates' noise was tested by the canaries, round by round)",
        )
    else:
        cov.add("noise", "canaries (scale, freshness)")
    sel, noise_only = coins & inc[None, :], ~coins
    contrib = None
    if not sel.any():
        cov.skip("clipping", "no included canary's reply was aggregated")
    else:
        cov.add("clipping", "canaries (a drawn canary adds C/m, clipping test)")
        est = float(u[sel].mean())
        sd = float(u[noise_only].std()) if noise_only.sum() > 1 else sig_u
        # at the verdict's level (two-sided 0.001), not 95 %: the rule decides a finding
        half = float(stats.norm.isf(0.0005)) * sd / math.sqrt(sel.sum())
        contrib = {
            "estimate": est,
            "ci999": [est - half, est + half],
            "expected_under_claim": 1.0,
            "weights_applied": [float(np.min(a_canary)), float(np.max(a_canary))]
            if a_canary
            else None,
            "note": "an included canary's contribution per draw, in units of C/m",
        }
        if contrib["ci999"][0] > 2.0:
            hint = (
                f"; a {run.mode.replace('_', '-side ', 1)} wrapper leaves the clipping to the "
                "ClientApp: put flwr's "
                + ("fixedclipping_mod" if run.mode == "client_fixed" else "adaptiveclipping_mod")
                + " among its mods"
                if run.mode.startswith("client")
                else ""
            )
            findings.append(
                finding(
                    "canary_not_clipped",
                    f"an included canary adds {est:.3g} × C/m per draw (95% CI "
                    f"[{contrib['ci999'][0]:.3g}, {contrib['ci999'][1]:.3g}] at 99.9 %), not 1: its update "
                    f"({run.canaries.gain_factor:g}·C) reached the aggregate unclipped" + hint,
                )
            )
    lb = one_run_lower_bound(u.sum(axis=0), inc, run.canaries.p_include, c.delta, alpha)
    return result(
        run,
        c,
        run_mech,
        findings,
        untested,
        conf,
        lb,
        cov,
        **{
            **_eps(eps_run, mech, rec_plain, eps_acc, acc_note, eps_implied, f, group),
            "implied_epsilon_at_least": at_least,
            "sampling": samp.to_dict(),
            "canary_contribution": contrib,
        },
    )


def _eps(eps_run, mech, rec_plain, eps_acc, acc_note, eps_implied, f, group) -> dict:
    """The result's ε keys (recomputed, Flower's accountant, noise-implied)."""
    return {
        "recomputed_epsilon": eps_run,
        "recomputed_epsilon_at_least": False,
        "recomputed": {"mechanism": mech, "epsilon_equal_weights": rec_plain["epsilon_pld"]},
        "accountant_epsilon": eps_acc,
        "accountant_note": acc_note,
        "implied_epsilon": eps_implied,
        "implied_epsilon_at_least": False,
        "noise_factor": f,
        "noise_factor_group": group,
        "sampling": None,
        "canary_contribution": None,
    }


def _no_noise(run, recs, c, findings, untested, cov, run_mech, sigma) -> dict:
    """A wrapper whose noise multiplier is 0: ``noise_absent``, every ε ∞ (white box: no
    test is needed to know a deterministic release is not DP)."""
    findings.append(
        finding(
            "noise_absent",
            f"the wrapper's noise multiplier is {sigma:g}: the released rounds carry no noise, "
            "ε = ∞",
        )
    )
    nonfinite_finding(recs, None, findings)
    mech = f"{len(recs)} rounds without noise (σ = {sigma:g})"
    why = "no noise: nothing to test against the claim's σ"
    for part in ("sampling", "clipping", "noise"):
        cov.skip(part, why)
    rec = {"epsilon_pld": math.inf}
    return result(run, c, run_mech, findings, untested, None, None, cov, why_no_tests=why,
                  **_eps(math.inf, mech, rec, None, None, math.inf, 0.0, None))  # fmt: skip
