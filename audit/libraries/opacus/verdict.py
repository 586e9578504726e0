"""The Opacus audit's verdict: :func:`audit_run` on what :class:`OpacusAudit` recorded.

In order: the mechanism the run used against the claim, field by field; ε recomputed for
it (``claim check``: the accounting); the release, in units of each step's own canary
clip (so adaptive clipping's moving C_t and per-layer clipping's canary norm give one
noise scale); the conformance family (:mod:`audit.bounds.conformance`: scale, freshness,
the one-sided clip test, the two-sided contribution test — a drawn canary adds EXACTLY C
—, and the sampling tests of :mod:`audit.libraries.common`); the one-run ε lower bound;
then the coverage (:class:`audit.coverage.Coverage`) and the verdict
(:func:`audit.coverage.decide`: ``fail`` on an error finding, ``incomplete`` (exit 4) while
sampling, clipping, noise or accounting is untested, else ``pass``).

Never an exception on a bad release: a release that is not finite is
``release_nonfinite`` (ε = ∞; the tests run on the finite steps), no noise at all is
``noise_absent`` (ε = ∞), a forward that re-read the step's batch is ``forward_run_twice``
(Opacus then counts two iterations and accounts 2q: named, not a wrong sampling rate).
"""

from __future__ import annotations

import math
import time

import numpy as np

from audit.bounds.conformance import (
    Block,
    GroupTest,
    conformance,
    implied_noise_factor,
)
from audit.bounds.contribution import contribution_test
from audit.claims.check import check_claim
from audit.claims.implied import SIGMA_FLOOR, epsilon_of_scaled_claim
from audit.claims.mistakes import reference
from audit.claims.schema import Claim, validate_claim
from audit.coverage import Coverage, decide
from audit.libraries.common import one_run_lower_bound, sampling_group_tests
from audit.libraries.results import conformance_warnings

__all__ = ["REL_TOL", "audit_run"]

#: relative tolerance for "the claim's field equals the run's"
REL_TOL = 1e-6
#: the white-box check's tolerance, in units of C (float32: ~1e-7; bf16 grads: ~1e-2)
WHITE_BOX_TOL = 2e-2


def _finding(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _claim_fields(c: Claim, run: dict, sigma: float, q: float, T: int, skip_rate: bool):
    checks = [
        ("noise_multiplier", c.noise_multiplier, sigma),
        ("steps", c.steps_per_round * c.rounds, T),
    ]
    if not skip_rate:
        checks.insert(1, ("sample_rate", c.record_rate, q))
    if c.clipping_norm is not None:
        checks.append(("clipping_norm", c.clipping_norm, run["clipping_norm"]))
    out = []
    for name, claimed, ran in checks:
        if abs(claimed - ran) > REL_TOL * max(abs(ran), 1e-300):
            what = (
                " (the first step's C: adaptive clipping moves it)"
                if (name == "clipping_norm" and run["mode"] == "adaptive")
                else ""
            )
            out.append(
                _finding(
                    f"{name}_mismatch",
                    f"the claim's {name} = {claimed:.6g} but the run used {ran:.6g}{what}",
                )
            )
    return out


def audit_run(rec, claim, *, alpha: float, permutations: int, seed) -> dict:
    """The audit of an :class:`OpacusAudit`'s records against ``claim`` (module doc)."""
    t0 = time.time()
    c = validate_claim(claim)
    run = rec.run_mechanism()
    findings: list[dict] = []
    notes: list[str] = []
    cov = Coverage()
    T = run["steps"]
    if T < 2:
        raise ValueError(f"the run took {T} noised step(s); the audit needs at least 2")
    # a forward that re-read the step's batch; summed twice where Opacus counted 2 iterations
    ob = rec.observations()
    clips = ob["clips"]
    with np.errstate(invalid="ignore"):
        peak = np.nan_to_num(np.max(ob["sums"] / clips[:, None], axis=1, initial=0.0))
    # summed twice: Opacus counted 2 iterations, or a canary of the re-read batch added 2·C
    doubled = [r > 0 and (k > 1 or p > 1.5) for r, k, p in zip(rec.repeats, rec.iterations, peak)]
    repeated = int(sum(r > 0 for r in rec.repeats))
    twice = int(sum(doubled))
    iters = max(rec.iterations) if rec.iterations else 1
    rate_moved = isinstance(run["sample_rate"], list) and not twice
    if isinstance(run["noise_multiplier"], list) or rate_moved:
        findings.append(
            _finding(
                "run_not_constant",
                f"σ or q changed during the run: σ {run['noise_multiplier']}, q "
                f"{run['sample_rate']}",
            )
        )
    sigma = float(np.min(run["noise_multiplier"]))  # the least noise: the largest ε
    q = float(np.max(run["sample_rate"]))
    if twice:
        acct = (
            f"counted {iters} iterations (its accountant's q = "
            f"{float(np.max(run['sample_rate'])):.4g}, {iters}× the loader's)"
            if iters > 1
            else "counted one iteration (the q is right, the sensitivity 2·C is not)"
        )
        if iters > 1:
            # the mechanism's q is the loader's (1/len(loader)); Opacus accounted k·q
            q = 1.0 / rec.loader_len
        findings.append(
            _finding(
                "forward_run_twice",
                f"in {twice} of {T} noised steps a forward read the step's batch again and "
                "its backward was kept (e.g. optimizer.step(closure) after a forward and "
                "backward of the same batch, or a physical batch yielded twice): Opacus "
                "summed the batch's clipped gradients twice (a record adds up to 2·C, the "
                f"noise is for C) and {acct}. Zero the gradients inside a closure, or call "
                "step() without one",
            )
        )
    elif repeated:
        findings.append(
            {
                "code": "forward_run_twice",
                "severity": "warning",
                "message": f"in {repeated} of {T} noised steps a forward read the step's "
                "batch again (e.g. a closure); Opacus kept one backward (accumulated "
                "iterations 1), so the release and its accounting are unaffected",
            }
        )
    findings += _claim_fields(c, run, sigma, q, T, skip_rate=False)
    if c.sampling != run["sampling"]:
        findings.append(
            _finding(
                "sampling_mismatch",
                f"the claim's sampling is {c.sampling!r} but the run drew {run['sampling']!r} "
                "batches (the loader it trained on "
                + ("is" if rec.poisson else "is not")
                + " Opacus's Poisson DPDataLoader); Opacus's accountant accounts both as "
                "Poisson at q = 1/len(loader)",
            )
        )
    # --- accounting: ε of the mechanism the run used
    floored = 0 < sigma < SIGMA_FLOOR and q < 1
    run_claim = Claim(
        level="sample",
        noise_multiplier=max(sigma, SIGMA_FLOOR) if floored else (sigma if sigma > 0 else 1.0),
        sampling=run["sampling"],
        rounds=1,
        steps_per_round=T,
        sample_rate=q,
        clipping_norm=run["clipping_norm"],
        claimed_epsilon=c.claimed_epsilon,
        delta=c.delta,
        accounting="composed",
    )
    if sigma <= 0:
        eps_run = math.inf
        recomputed = {"epsilon_pld": math.inf, "understated": True, "mechanism": "no noise"}
        findings.append(
            _finding(
                "noise_absent",
                "the run's noise multiplier is 0 (the optimizer adds no noise): ε = ∞",
            )
        )
    else:
        recomputed = check_claim(run_claim)
        eps_run = recomputed["epsilon_pld"]
    cov.add("accounting", "claim check")
    if recomputed["understated"] and sigma > 0:
        findings.append(
            _finding(
                "epsilon_understated",
                f"the claimed ε = {c.claimed_epsilon:.4g} is below the ε = {eps_run:.4g} of "
                f"the mechanism the run used ({recomputed['mechanism']})",
            )
        )
    eps_acc = None
    if floored or sigma <= 0:
        notes.append(
            f"Opacus's accountant not asked: σ = {sigma:.3g} < {SIGMA_FLOOR} (its PRV/RDP "
            f"grids grow past memory); the recomputed ε is at σ = {SIGMA_FLOOR}, a lower bound"
            if sigma > 0
            else "Opacus's accountant not asked: σ = 0"
        )
    else:
        try:
            eps_acc = float(rec.engine.get_epsilon(c.delta))
        except Exception as exc:  # the accountant's own limits (e.g. no steps)
            notes.append(f"Opacus's accountant gave no ε ({exc})")
    if run["mode"] == "adaptive":
        findings += _adaptive(run, eps_acc, eps_run, c)
    # --- the release, in units of each step's canary clip
    u_all = ob["obs"] / clips[:, None]
    finite = np.isfinite(u_all).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        findings.append(
            _finding(
                "release_nonfinite",
                f"the privatized sum holds NaN or Inf at {bad.size} of {T} noised steps (first "
                f"at step {int(bad[0]) + 1}): a release that is not finite is not the Gaussian "
                "mechanism (ε = ∞); the tests below use the finite steps",
            )
        )
    noise_seen = bool(finite.any()) and not np.array_equal(ob["obs"][finite], ob["sums"][finite])
    if sigma > 0 and finite.any() and not noise_seen:
        findings.append(
            _finding(
                "noise_absent",
                f"the optimizer holds σ = {sigma:.4g} but the privatized sums equal the clipped "
                "sums exactly at every step: no noise was added (ε = ∞)",
            )
        )
    u = u_all[finite]
    coins_all = ob["coins"][finite]
    ratio = (c.noise_multiplier * ob["noise_c"] / clips)[finite]
    sig_u = float(ratio.max()) if ratio.size else 0.0
    m = rec.canaries.m
    inc = rec.canaries.included
    carried = rec.mode != "ghost" or (
        rec.model.terms_made > 0 and rec.model.terms_used >= rec.model.terms_made
    )
    if rec.mode == "ghost" and not carried:
        why = (
            "ghost clipping: the canary block's loss term did not reach the loss (pass "
            "criterion=SamplerCanaries.criterion(...) to make_private, or call it with "
            "reduction='none' for double_backward; a per-token loss gets no term)"
        )
        cov.skip("sampling", why).skip("clipping", why)
    conf = None
    samp = None
    extra: list[GroupTest] = []
    f_noise, group = 1.0, None
    if u.shape[0] < 2 or sig_u <= 0:
        why = (
            "the claim's noise multiplier is 0"
            if c.noise_multiplier <= 0
            else f"{u.shape[0]} finite noised step(s), the tests need 2"
        )
        for part in ("noise", "sampling", "clipping"):
            cov.skip(part, why)
    else:
        if carried and not inc.any():
            why = "no canary was included (every inclusion bit 0): none travelled"
            cov.skip("sampling", why).skip("clipping", why)
        elif carried:
            samp, tests, draws = sampling_group_tests(
                u, coins_all, inc, sig_u, q, permutations=permutations, seed=seed,
                note="Poisson coins are exchangeable over steps",
            )  # fmt: skip
            extra += tests
            n_draw, k_draw = draws["possible"], draws["drawn"]
            cov.add("sampling", "canaries (sampler coins and release)")
            if k_draw == 0 and n_draw * q > 5:
                findings.append(
                    _finding(
                        "canaries_never_drawn",
                        f"no included canary entered a training forward in {T} steps "
                        f"(expected {n_draw * q:.0f} draws): train on the loader make_private "
                        "returned, built over SamplerCanaries.dataset(...), and call "
                        "model(x, cid) in train mode",
                    )
                )
            exact = contribution_test(u, coins_all & inc[None, :])
            if exact is not None:
                extra.append(exact)
                cov.add("clipping", "canaries (two-sided: a drawn canary adds exactly C)")
            else:
                cov.skip("clipping", "no included canary was drawn: nothing to clip")
        block = Block(
            u=u,
            tracks=np.arange(m),
            groups=np.array(["canary"] * m),
            sigma=sig_u,
            included=inc.copy(),
            coins=coins_all if carried else None,
            q=q,
            p_include=rec.canaries.p_include,
        )
        conf = conformance([block], extra=tuple(extra))
        cov.add("noise", "canaries (scale, freshness)")
        f_noise, group = implied_noise_factor(conf)
        for t in conf.rejected:
            findings.append(
                _finding(
                    "conformance_rejected",
                    f"{t.group}:{t.test} rejected at family-wise α = {conf.alpha:g} (Holm; "
                    f"{t.evidence()})",
                )
            )
    codes = {f["code"] for f in findings}
    if {"release_nonfinite", "noise_absent"} & codes:
        eps_implied, at_least = math.inf, False
    elif c.noise_multiplier > 0 and sigma > 0:
        eps_implied, at_least = epsilon_of_scaled_claim(
            reference(run_claim), c.noise_multiplier, f_noise, c.delta
        )
    else:
        eps_implied, at_least = math.inf, False
    lb = None
    if carried and u.shape[0] >= 2:
        lb = one_run_lower_bound(u.sum(axis=0), inc, rec.canaries.p_include, c.delta, alpha)
    if lb is None:
        notes.append("ε lower bound (needs included and excluded canaries that carry)")
    elif lb["epsilon_lb"] > c.claimed_epsilon:
        findings.append(
            _finding(
                "empirical_exceeds_claim",
                f"the one-run ε lower bound {lb['epsilon_lb']:.4g} exceeds the claimed ε = "
                f"{c.claimed_epsilon:g}",
            )
        )
    # white box: Opacus's clipped sum on the block before the noise against the canary's
    # clip times the coins read from the forwards (exact up to float error where each
    # drawn canary is clipped to C once); steps already named as summed twice left out
    sums_u = (ob["sums"] / clips[:, None])[finite]
    clip_error = float(np.max(np.abs(sums_u - coins_all))) if carried and sums_u.size else None
    if carried and sums_u.size and inc.any():
        gap = np.abs(sums_u - coins_all).max(axis=1)
        gap[np.asarray(doubled, dtype=bool)[finite]] = 0.0
        bad = np.flatnonzero(gap > WHITE_BOX_TOL)
        if coins_all[:, inc].any():
            cov.add("clipping", "white box (Opacus's clipped sum at the canaries)")
        if bad.size:
            t = int(bad[np.argmax(gap[bad])])
            drawn = coins_all[t] & inc
            seen = sums_u[t][drawn] if drawn.any() else sums_u[t]
            findings.append(
                _finding(
                    "canary_sum_not_clip",
                    f"at {bad.size} of {u.shape[0]} noised steps Opacus's clipped sum on the "
                    "canary block (summed_grad, before the noise) is not C_t per canary drawn "
                    f"(the coins the forwards read): at step {t + 1} a drawn canary added "
                    f"{float(np.min(seen)):.4g}…{float(np.max(seen)):.4g}·C (each example "
                    "clipped to C once adds exactly 1·C)",
                )
            )
    errors = sum(f.get("severity", "error") == "error" for f in findings)
    verdict, code = decide(errors, cov)
    findings += conformance_warnings(conf) if conf is not None else []
    return {
        "library": "opacus",
        "version": f"opacus {rec.version}",
        "mode": rec.mode,
        "run": run,
        "claim": c.to_dict(),
        "claimed_epsilon": c.claimed_epsilon,
        "delta": c.delta,
        "recomputed_epsilon": eps_run,
        "recomputed_epsilon_at_least": floored,
        "recomputed": recomputed,
        "accountant_epsilon": eps_acc,
        "epsilon_lower_bound": lb["epsilon_lb"] if lb else None,
        "lower_bound": lb,
        "implied_epsilon": eps_implied,
        "implied_epsilon_at_least": at_least,
        "noise_factor": f_noise,
        "noise_factor_group": group,
        "conformance": conf.to_dict() if conf is not None else _no_conformance(),
        "conformance_rejected": [f"{t.group}:{t.test}" for t in conf.rejected] if conf else [],
        "sampling": samp.to_dict() if samp else None,
        "canary_clip_error": clip_error,
        "coverage": cov.to_dict(),
        "untested": cov.describe() + notes,
        "findings": findings,
        "verdict": verdict,
        "exit_code": code,
        "audit_seconds": time.time() - t0,
    }


def _no_conformance() -> dict:
    return {"alpha": None, "passed": True, "tests": [], "rejected": [], "weak": [],
            "skipped": ["every test (no finite release of two steps)"]}  # fmt: skip


def _adaptive(run: dict, eps_acc: float | None, eps_run: float, c: Claim) -> list[dict]:
    """Adaptive clipping: which σ Opacus's accountant used, and whether that understates ε."""
    acc = run.get("accountant_noise_multiplier")
    user = float(run["noise_multiplier"]) if not isinstance(run["noise_multiplier"], list) else None
    if acc is None or user is None or isinstance(acc, list):
        return []
    if abs(float(acc) - user) <= REL_TOL * user:
        return []
    low = eps_acc is not None and eps_acc < eps_run * (1 - 1e-3)
    msg = (
        f"Opacus's accountant used σ = {float(acc):.6g}, the adjusted σ_eff that "
        f"AdaClipDPOptimizer keeps in noise_multiplier (opacus {run['opacus_version']}), "
        f"not the σ = {user:.6g} passed to make_private; σ_eff scales the gradient noise "
        f"only, the clip count is noised at σ_u = {run['unclipped_num_std']:g}, and the pair "
        f"is as private as σ alone (Andrew et al. 2021, Theorem 1)"
    )
    if not low:
        return [{"code": "accountant_sigma_adjusted", "severity": "info", "message": msg}]
    return [
        _finding(
            "accountant_sigma_adjusted",
            msg + f": its ε = {eps_acc:.4g} understates the ε = {eps_run:.4g} at σ = {user:.6g}",
        )
    ]
