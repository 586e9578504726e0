"""The conformance tests of a training done elsewhere (``fedlora audit --canaries``): the
hooks' observations as :class:`audit.bounds.conformance.Block`s in units of the CLAIM's C and
σ (never the file's), the gradient canaries' coins re-drawn from the set's key, the canary
clients' projections where their directions are orthonormal, and the noise-implied ε of the
claim's mechanism (:mod:`audit.claims.implied`). Used by :func:`audit.canaries.outside.audit_outside`."""

from __future__ import annotations

import math

import numpy as np

from audit.canaries.canary_set import CanarySet
from fl.errors import UsageError


def obs_array(obs: dict, key: str, shape: tuple, where: str, finite: bool = True) -> np.ndarray:
    """Field ``key`` as a float array of ``shape`` (None: any length). ``finite=False``
    (the releases themselves): NaN and Inf are kept, for the audit's finding
    ``release_nonfinite``; elsewhere they are bad input."""
    if key not in obs:
        raise UsageError(f"{where}: field {key!r} missing")
    try:
        a = np.asarray(obs[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not numeric") from None
    if a.ndim != len(shape) or any(s is not None and a.shape[i] != s for i, s in enumerate(shape)):
        want = "×".join("T" if s is None else str(s) for s in shape)
        raise UsageError(f"{where}: field {key!r} has shape {a.shape}, expected {want}")
    if finite and not np.isfinite(a).all():
        raise UsageError(f"{where}: field {key!r} holds non-finite values")
    return a


def gradient_coins(key, steps: int, m: int, q: float) -> np.ndarray:
    """(steps, M) bool: the Poisson coins :class:`audit.canaries.hooks.GradientCanaryHook`
    drew, drawn again from the set's key: step t's from the stream
    ``(COIN_STREAM, t)``, one Bernoulli(q) per canary, included or not (the hook's
    ``_sampled``). The auditor draws them itself rather than trust a record of them."""
    from audit.canaries.canary_set import COIN_STREAM
    from fl.privacy import rng as R

    out = np.zeros((steps, m), dtype=bool)
    for t in range(steps):
        out[t] = R.bernoulli_mask(key.stream(COIN_STREAM, t), m, q).numpy().astype(bool)
    return out


def claim_clip(cs: CanarySet, claim) -> float:
    """C of the tests: the claim's clipping norm (checked equal to the set's and the
    file's), else the set's."""
    return float(claim.clipping_norm) if claim.clipping_norm is not None else float(cs.spec["clip"])


def gradient_block(cs: CanarySet, raw: dict, claim):
    """The observations of a gradient canary set as one conformance block (one local
    training, steps in order): u = the privatized sum at each canary's coordinate / C,
    σ the claim's, the coins re-drawn from the set's key (None without the key). Returns
    (block, how the coins were had)."""
    from audit.bounds.conformance import Block

    x, q = raw["x"], raw["q"]
    sp = cs.spec
    group = {p["name"]: p["group"] for p in sp["params"]}
    groups = np.array([group[c["param"]] for c in sp["coordinates"]])
    if cs.key is not None:
        coins, how = gradient_coins(cs.key, x.shape[0], cs.count, q), "re-drawn from the set's key"
    else:
        coins, how = None, "unknown: the set's key is not at hand (give --key FILE)"
    block = Block(
        u=x / claim_clip(cs, claim),
        tracks=np.arange(cs.count),
        groups=groups,
        sigma=claim.noise_multiplier,
        included=np.asarray(cs.included, dtype=bool),
        coins=coins,
        q=q,
        order=(0,),
    )
    return block, how


def orthonormal_directions(cs: CanarySet) -> bool:
    """Whether the canary clients' directions are exactly orthogonal unit vectors (disjoint
    supports, ±1/√k entries), checked on the file: their noise projections are then
    independent N(0, (σC/m)²), which the tests need."""
    d = cs.directions
    if d.get("mode") != "disjoint":
        return False
    sup, sig = np.asarray(d["support"]), np.asarray(d["signs"], dtype=np.float64)
    if sup.ndim != 2 or sup.shape != sig.shape or sup.shape[0] != cs.count:
        return False
    if np.unique(sup).size != sup.size or sup.min() < 0 or sup.max() >= int(cs.spec["dim"]):
        return False
    return bool(np.allclose(np.sqrt((sig**2).sum(axis=1)), 1.0, rtol=1e-9, atol=0))


def client_block(cs: CanarySet, obs: dict, claim, where: str):
    """The canary clients' observations as one conformance block: u = ⟨ĉ_j, Δ_r⟩·m/C (the
    released update Δ_r = (clipped sum + canaries + N(0, σ²C²I)) / m projected on canary
    j's unit direction, so the noise is N(0, σ²) and an included canary adds 1), σ and m
    the claim's; coins: every round (q = 1), or re-drawn from the key per round. Returns
    (block or None, how the coins were had, why not tested)."""
    from audit.bounds.conformance import Block

    if not orthonormal_directions(cs):
        return (
            None,
            "",
            "the canary clients' directions are isotropic (M > d), not orthogonal: their "
            "noise projections are correlated, and the tests need independent ones",
        )
    inner = obs_array(obs, "inner", (None, cs.count), where)
    sp = cs.spec
    m_round = claim.clients_per_round
    coins, how, q = None, "", 1.0
    if sp["participation"] == "every_round":
        coins, how = np.ones(inner.shape, dtype=bool), "every round (every-round participation)"
    else:
        q = float(sp["rate"])
        rounds = None
        if "rounds" in obs:
            r = np.asarray(obs["rounds"])
            if r.shape == (inner.shape[0],) and np.issubdtype(r.dtype, np.integer):
                rounds = r.astype(np.int64)
        if cs.key is None:
            how = "unknown: the set's key is not at hand (give --key FILE)"
        elif rounds is None:
            how = "unknown: the observation file records no round numbers ('rounds')"
        else:
            from audit.canaries.draw import client_canaries

            cc, bits, _ = client_canaries(
                cs.key, cs.count, float(sp["clip"]), int(sp["dim"]), "poisson", q
            )
            # taking_part gives coin AND bit; the tests read an excluded canary's coin only
            # together with its bit, so this is the coins as far as they are used
            coins = np.zeros(inner.shape, dtype=bool)
            for t, r in enumerate(rounds.tolist()):
                coins[t, cc.taking_part(int(r))] = True
            how = "re-drawn from the set's key (the hook's participation coins)"
    block = Block(
        u=inner * m_round / claim_clip(cs, claim),
        tracks=np.arange(cs.count),
        groups=np.full(cs.count, "clients"),
        sigma=claim.noise_multiplier,
        included=np.asarray(cs.included, dtype=bool),
        coins=coins,
        q=q,
        order=(0,),
    )
    return block, how, None


def claim_mechanism(c, checked: dict):
    """The mechanism the claim check computed the recomputed ε for: the reference, or
    Opacus's rate when the check read the claim with it (finding ``opacus_sample_rate``)."""
    from audit.claims.mistakes import Mech, opacus_sample_rate, reference

    ref = reference(c)
    q_op = opacus_sample_rate(c)
    if q_op is not None and any(f.get("code") == "opacus_sample_rate" for f in checked["findings"]):
        return Mech(True, q_op, ref.count)
    return ref


#: the two-sided clip test (:func:`audit.bounds.contribution.clip_contribution_test`), in the
#: words the findings use beside :data:`audit.bounds.conformance.TESTS`
CONTRIBUTION = (
    "a drawn canary adds EXACTLY C, as a clip of each example gives it: two-sided, for any "
    "data gradient"
)


def outside_conformance(
    block,
    how: str,
    clip: float,
    c,
    checked: dict,
    alpha: float,
    findings: list,
    two_sided: bool = False,
) -> dict:
    """The conformance tests of one block against the claim, the noise-implied ε of the
    claim's mechanism, and a ``mechanism_mismatch`` finding per rejected test.
    ``two_sided``: the canaries went through the training's clip of each example (gradient
    canaries' rows): the two-sided clip test ``contribution``
    (:func:`audit.bounds.contribution.clip_contribution_test`, a drawn canary adds exactly
    C) joins the family (Holm) beside the one-sided ``clip``; it needs the coins."""
    from audit.bounds.conformance import TESTS, conformance, implied_noise_factor
    from audit.bounds.contribution import clip_contribution_test
    from audit.claims.implied import epsilon_of_scaled_claim, noise_finding
    from audit.findings import Code

    # the family's levels are the conformance module's (verdict 0.001, warning 0.05);
    # ``alpha`` is the one-run bound's confidence
    extra = clip_contribution_test([block]) if two_sided else ()
    res = conformance([block], extra=extra)
    words = {**TESTS, "contribution": CONTRIBUTION}
    factor, group = implied_noise_factor(res)
    mech = claim_mechanism(c, checked)
    eps_implied, at_least = epsilon_of_scaled_claim(mech, c.noise_multiplier, factor, c.delta)
    absent = noise_finding(factor)
    if absent is not None:
        findings.append(
            {
                "code": absent[0],
                "severity": "error",
                "message": f"{absent[1]} (group {group}): what was released carries none of "
                f"the claim's noise N(0, σ²C²) at σ = {c.noise_multiplier:g}; the "
                "noise-implied ε is ∞.",
            }
        )
    for t in res.rejected + res.weak:
        where = f"Group {t.group}, {t.test} test ({words[t.test]})"
        against = f"tested against the claim's σ = {c.noise_multiplier:g}"
        if t.rejected:
            findings.append(
                {
                    "code": str(Code.MECHANISM_MISMATCH),
                    "severity": "error",
                    "message": f"{where}: rejected at family-wise α = {res.alpha:g} (Holm), "
                    f"{t.evidence()}, {against}. The training does not implement the "
                    "mechanism its claim describes.",
                }
            )
        else:
            findings.append(
                {
                    "code": str(Code.CONFORMANCE_WEAK),
                    "severity": "warning",
                    "message": f"{where}: rejected at family-wise α = {res.warn_alpha:g} but "
                    f"not at the verdict's α = {res.alpha:g} (Holm), {t.evidence()}, "
                    f"{against}. Weak evidence: one correct training in "
                    f"{1 / res.warn_alpha:.0f} can show it.",
                }
            )
    out = res.to_dict()
    out.update(
        {
            "performed": True,
            "sigma": c.noise_multiplier,
            "sigma_from": "the claim (noise_multiplier); never the observation file's",
            "clip": clip,
            "coins": how,
            "steps": int(np.asarray(block.u).shape[0]),
            "implied_factor": factor,
            "implied_factor_group": group,
            "implied_epsilon": eps_implied,
            "implied_epsilon_at_least": at_least,
            "implied_mechanism": f"{mech.count} "
            + (
                f"Poisson-subsampled Gaussian step(s) at q = {mech.q:.4g}"
                if mech.poisson and mech.q < 1
                else "plain Gaussian step(s)"
            )
            + f", noise multiplier σ × {factor:.4g}"
            + (f" / {mech.sens} (sensitivity {mech.sens}C)" if mech.sens != 1 else ""),
            "implied_note": "the claim's mechanism with σ times the worst group's upper "
            "confidence bound on the observed noise factor (capped at 1): conditional on the "
            "noise being Gaussian at the observed scale; not a certified bound",
        }
    )
    return out


#: the finding (a warning: the run fails by its conformance test all the same) of
#: observations that look divided by a batch size
OBSERVATIONS_LOOK_AVERAGED = "observations_look_averaged"
#: "far below the claim": both the noise and the canaries' contribution under this fraction
#: of the claim's (a division by B >= 2 leaves 1/2 or less)
AVERAGED_BELOW = 0.75


def _chi2_ci(q: float, dof: int, alpha: float) -> tuple[float, float]:
    from scipy import stats

    return (
        math.sqrt(q / stats.chi2.ppf(1 - alpha / 2, dof)),
        math.sqrt(q / stats.chi2.ppf(alpha / 2, dof)),
    )


def _contribution(u: np.ndarray, ent: np.ndarray, noise: float, alpha: float):
    """(â, lower, upper): the canaries' contribution in units of C, the better (narrower)
    of two estimates, or (None, None, None) when neither exists. Within a track: the mean
    where a canary entered less the mean where none did, pooled with inverse-variance
    weights, its noise ``noise`` (the data drift cancels on average: the coins are fresh).
    Across tracks (every step's coin 1, as at q = 1): the tracks' means regressed on the
    share of steps a canary entered, the residual variance measured (the data's part
    included), Student's t interval. Both are unbiased for any data gradient: the coins and
    the inclusion bits are drawn independently of the data."""
    from scipy import stats

    T, M = u.shape
    n1 = ent.sum(axis=0)
    n0 = T - n1
    best = (None, None, None, math.inf)
    both = (n1 >= 1) & (n0 >= 1)
    if both.any():
        mean1 = np.where(ent, u, 0.0).sum(axis=0) / np.maximum(n1, 1)
        mean0 = np.where(~ent, u, 0.0).sum(axis=0) / np.maximum(n0, 1)
        w = 1.0 / (1.0 / n1[both] + 1.0 / n0[both])
        a = float(np.sum(w * (mean1[both] - mean0[both])) / np.sum(w))
        se = noise / math.sqrt(float(np.sum(w)))
        z = float(stats.norm.ppf(1 - alpha / 2))
        best = (a, a - z * se, a + z * se, se)
    frac = n1 / T
    x = frac - frac.mean()
    sxx = float(np.sum(x**2))
    if M >= 4 and sxx > 0:
        mu = u.mean(axis=0)
        a = float(np.sum(x * (mu - mu.mean())) / sxx)
        res = mu - mu.mean() - a * x
        se = math.sqrt(float(np.sum(res**2)) / (M - 2) / sxx)
        if se < best[3]:
            t = float(stats.t.ppf(1 - alpha / 2, M - 2))
            best = (a, a - t * se, a + t * se, se)
    return best[:3]


def averaged_hint(
    u,
    entered,
    sigma: float,
    *,
    expected_batch: float | None = None,
    scale=None,
    alpha: float = 0.01,
    where: str = "the observations",
) -> dict | None:
    """A finding (``observations_look_averaged``, a warning) when the observations look
    divided by a batch size B ≥ 2, as when ``GradientCanaryHook.observe`` is given the batch
    MEAN without ``scale=B``; None otherwise.

    ``u`` (T, M): the observations in units of C; ``entered`` (T, M) bool: where an included
    canary entered the step (its coin and bit; None when unknown); ``sigma``: the claim's
    noise multiplier. Divided by B, the noise is σ/B AND a canary adds C/B; a noise that is
    truly too small leaves the canary's C whole. So, from the data:

    - the noise's scale ρ̂ (observed/claimed) from the entries no canary entered, each track
      centred on its own mean (a data gradient that drifts only adds to it), with its χ²
      interval;
    - with the coins, the canaries' contribution â (in units of C, :func:`_contribution`):
      per track the mean where a canary entered less the mean where none did, or across
      tracks (when every step's coin is 1) the tracks' means against their share of steps
      entered.

    Averaging is named when the noise is far below the claim (ρ̂'s upper end under 1/2)
    and, with the coins, the contribution is too (â's interval above 0, under 1/2: a
    correct clip adds 1, a missing one far more); B's range is 1/â's interval (without the
    coins 1/ρ̂'s); it must hold an integer ≥ 2 (or the expected batch q·N when known, which
    is then named). The intervals are at ``alpha`` (default 1%: the range named is wide
    enough to hold B but for about 1 run in 100). The run fails by its conformance test
    either way: this only names the likely slip."""
    u = np.asarray(u, dtype=np.float64)
    if u.ndim != 2 or u.shape[0] < 2 or not sigma > 0:
        return None
    ent = np.zeros(u.shape, dtype=bool) if entered is None else np.asarray(entered, dtype=bool)
    free = ~ent
    n0 = free.sum(axis=0)
    ok = n0 >= 2
    mean0 = np.where(free, u, 0.0).sum(axis=0) / np.maximum(n0, 1)
    dev = np.where(free & ok[None, :], u - mean0[None, :], 0.0)
    dof = int((n0[ok] - 1).sum())
    if dof < 10:
        return None
    q0 = float((dev**2).sum()) / sigma**2
    rho = math.sqrt(q0 / dof)
    rho_lo, rho_hi = _chi2_ci(q0, dof, alpha)
    if rho_hi >= AVERAGED_BELOW or not rho_hi > 0:
        return None  # noise as claimed, or none at all (noise_absent): not a division
    a = a_lo = a_hi = None
    if entered is not None:
        a, a_lo, a_hi = _contribution(u, ent, rho * sigma, alpha)
        if a is not None and not (a_lo > 0 and a_hi < AVERAGED_BELOW):
            return None  # the canaries add their C whole (or nothing): not a division
    lo, hi = (1 / a_hi, 1 / a_lo) if a is not None else (1 / rho_hi, 1 / rho_lo)
    est = 1 / a if a is not None else 1 / rho
    if expected_batch is not None and lo * 0.98 <= expected_batch <= hi * 1.02:
        b = float(expected_batch)
        why = f"the expected batch size {b:g} lies in that range"
    else:
        ints = [k for k in range(max(2, math.ceil(lo)), math.floor(hi) + 1)]
        if not ints:
            return None
        b = float(min(ints, key=lambda k: abs(k - est)))
        why = "the nearest integer"
    evidence = f"the noise is {rho:.3g}× the claim's [{rho_lo:.3g}, {rho_hi:.3g}]"
    if a is not None:
        evidence += (
            f" and a canary adds {a:.3g}·C [{a_lo:.3g}, {a_hi:.3g}] where a correct clip adds C"
        )
    else:
        evidence += " (the canaries' contribution could not be measured: no coins, or none varied)"
    scaled = ""
    if scale is not None:
        s = np.unique(np.asarray(scale, dtype=np.float64))
        scaled = (
            " observe() was given scale = 1 at every step."
            if s.size == 1 and s[0] == 1
            else f" observe() was given scale = {', '.join(f'{v:g}' for v in s[:4])}."
        )
    return {
        "code": OBSERVATIONS_LOOK_AVERAGED,
        "severity": "warning",
        "message": f"{where}: the observations look divided by ≈ {b:g} (B in [{lo:.3g}, "
        f"{hi:.3g}]; {why}): {evidence}, both about 1/B, as when observe() is given the "
        f"batch MEAN instead of the privatized sum.{scaled} If so, pass scale=B to "
        "observe() (the hook multiplies back) and audit again. The run fails all the same: "
        "what was observed carries far less noise than the claim, and a slip is not "
        "assumed.",
        "batch": b,
        "batch_range": [lo, hi],
        "evidence": evidence,
    }
