"""Over 500 lines on purpose: one audit (audit_outside) whose reading, scoring per canary kind, conformance, coverage and verdict share the claim, the canary set and the findings; the statistics live in audit.bounds.

Canary audits of trainings the toolkit did not run (``fedlora canaries new``,
``fedlora audit --canaries DIR --observations FILE --claim CLAIM``).

The operator of an outside training (an Opacus or plain PyTorch DP-SGD loop, a Flower
strategy with client-level DP) makes a canary set here, adds the canaries to the training
with the hooks of :mod:`audit.canaries.hooks`, which write an observation file, and audits that file
against the claim the training makes. The canaries, the inclusion bits, the Poisson coins
and the directions are those of the toolkit's own engine (docs/audit.md: "Gradient
canaries", "Canary clients", the input canaries of the one-run audit), drawn from a secret
key; the scores and bounds are the ones the run audit uses.

The canary sets (the folder ``fedlora canaries new`` writes) are :mod:`audit.canaries.canary_set`.

Neighbouring relations of the audit (the claim is add/remove, :mod:`audit.claims.check`):

- gradient canary: one record whose clipped gradient is C·e_j (sample level): ε, δ;
- input canary: one record; at sample level ε, δ; at client level it changes one client's
  data (replace-one-client): 2ε, (1 + e^ε)δ by group privacy, as the run audit;
- canary client: one client under add/remove (client level): ε, δ.

The claim test takes the larger of Steinke et al.'s bound and the f-DP one (family (ε, δ),
valid for any mechanism), each at α/2, so it holds at 1 − α (the run audit's
``_claim_check``).

Gradient canaries and canary clients with orthogonal directions also get the conformance
tests of :mod:`audit.bounds.conformance` (the run audit's, ``audit.bundle.conformance``):
what was released at each step carries at least the claim's Gaussian noise N(0, σ²C²) at
every canary, fresh at every step, and a canary adds at most C, for any data gradient; a
gradient canary adds EXACTLY C (the two-sided clip test: a training that clips the batch sum
instead of each example gives each drawn canary about C/√(canaries drawn)). What
is tested is the CLAIM: σ is the claim's ``noise_multiplier``, C its ``clipping_norm``; the σ
an observation file states is the trainer's word, reported (``stated_sigma_differs``) and
never used. The coins are drawn again from the set's key, as the hooks drew them (without
the key the clipping test is skipped, and said so). A rejected test is the finding
``mechanism_mismatch`` and the verdict "does not implement its claim"; beside it the
noise-implied ε, the claim's mechanism at σ × the observed noise factor's upper confidence
bound (:mod:`audit.claims.implied`; conditional, not certified). Input canaries give one
loss per canary after training: nothing per step to test.

**The run against the claim.** What the observation file records of the run — its C, the
rate q at which the canaries were sampled, the sampling (Poisson or shuffled, when the hook
knows it: Opacus), the number of steps (rounds), the clients per round — is compared with
the claim field by field; a difference is a finding naming both values (``clip_differs``,
``sample_rate_differs``, ``sampling_differs``, ``steps_differs``,
``clients_per_round_differs``; σ: ``stated_sigma_differs``), an error, exit 1, verdict "does
not implement its claim" — never a usage error. Fewer steps observed than claimed is a
note (the bound concerns the observed steps). Exit 2 is kept for bad input: missing or
unreadable files, observations of another set or kind or of the wrong shape, a claim at
the wrong level.

**Slips in using a hook** are named from the data: observations divided by a batch size
B (``GradientCanaryHook.observe`` given the batch mean without ``scale=B``) carry about
1/B of the claim's noise AND of the canaries' C, which a noise that is only too small does
not (its canaries add C whole): :func:`audit.canaries.outside_conformance.averaged_hint`,
the finding ``observations_look_averaged`` (a warning beside the failing conformance
test: the run still fails).

**No pass without a test** (:mod:`audit.coverage`): ``ok`` (exit 0) only when the noise
(the scale and freshness tests), the clipping (the clipping test: it needs the canaries'
coins, re-drawn from the set's key; for gradient canaries the two-sided one, on canaries that
entered before the training's clip), the accounting (the claim check, against what the file
records of the run) and the sampling were each tested, or do not apply. The training's own
sampler is not observed here, so a claim that takes amplification by Poisson sampling at
q < 1 reads ``incomplete`` (exit 4, ``untested`` names the parts and why) when nothing is
found; the library audits (:mod:`audit.libraries`) observe their samplers.
"""

from __future__ import annotations

import math

import numpy as np

from audit.canaries.canary_set import CanarySet, load_canary_set
from audit.canaries.observations import (
    CLIENTS_PER_ROUND_DIFFERS,
    CLIP_DIFFERS,
    OBS_FORMAT,
    RUN_DIFFERS,
    SAMPLE_RATE_DIFFERS,
    SAMPLING_DIFFERS,
    STATED_SIGMA_DIFFERS,
    STEPS_DIFFERS,
    client_round_findings,
    clip_findings,
    gradient_run,
    read_observations,
    same,
    scalar,
    stated_sigma,
    write_observations,
)
from audit.canaries.outside_conformance import (
    averaged_hint,
    claim_clip,
    client_block,
    gradient_block,
    gradient_coins,
    obs_array,
    outside_conformance,
)
from audit.coverage import EXIT_INCOMPLETE, Coverage, decide
from fl.errors import UsageError

#: the findings that say what ran is not the claim's mechanism (verdict "does not implement
#: its claim")
NOT_THE_MECHANISM = frozenset({"release_nonfinite", "noise_absent"})

# --------------------------------------------------------------------------- the audit


def _relation(kind: str, level: str, eps: float, delta: float) -> tuple[float, float, str]:
    """(ε allowed for one canary, δ to bound at, the relation in words)."""
    if kind == "input" and level == "client":
        return (
            2 * eps,
            (1 + math.exp(min(eps, 700.0))) * delta,
            "an input canary changes one client's data: replace-one-client, (2ε, (1 + e^ε)δ) "
            "by group privacy from the claim's add/remove-one-client",
        )
    if kind == "client":
        return eps, delta, "a canary client is one client added or removed: the claim's relation"
    return eps, delta, "a canary is one record added or removed: the claim's relation"


def _bounds(scores, included, delta: float, alpha: float) -> dict:
    """Steinke et al.'s and the f-DP one-run bounds, each at α/2 (jointly 1 − α)."""
    from audit.bounds.fdp import fdp_one_run_bound
    from audit.bounds.one_run import epsilon_one_run

    if not delta < 1:
        return {"epsilon_lb": 0.0, "bound": "none (δ >= 1)", "steinke": None, "fdp": None}
    st = epsilon_one_run(scores, included, delta, alpha=alpha / 2)
    fd = fdp_one_run_bound(scores, included, delta, alpha=alpha / 2, family="dp")
    st = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in st.items()}
    fd = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in fd.items()}
    s, f = float(st["epsilon_lb"]), float(fd["epsilon_lb"])
    return {
        "epsilon_lb": max(s, f),
        "bound": "f-DP" if f > s else "Steinke et al.",
        "epsilon_lb_steinke": s,
        "epsilon_lb_fdp": f,
        "steinke": {k: st[k] for k in ("m", "r", "v", "k_pos", "k_neg", "alpha", "delta")},
        "fdp": {k: fd[k] for k in ("m", "k_plus", "k_minus", "correct", "alpha", "delta")},
    }


def _nonfinite(where: str, unit: str, bad, values: int, final: bool = False) -> dict:
    """The finding ``release_nonfinite``: releases that hold NaN or Inf (never a usage error:
    the strongest evidence there is that the noise is not the claim's Gaussian)."""
    steps = np.flatnonzero(np.asarray(bad)).tolist()
    at = f"{len(steps)} {unit}(s) (first: {', '.join(map(str, steps[:5]))})" if steps else ""
    if final:
        at += (" and " if at else "") + "the final model's projection"
    return {
        "code": "release_nonfinite",
        "severity": "error",
        "message": f"{where}: what was released holds NaN or Inf at {at} ({values} value(s)): "
        "a release that is not finite carries no Gaussian noise a claim can rest on; the "
        "noise-implied ε is ∞. The finite releases are scored, the conformance tests skipped.",
    }


def _check_level(kind: str, claim) -> None:
    if kind == "gradient" and claim.level != "sample":
        raise UsageError(
            f"gradient canaries audit sample-level DP-SGD, but the claim's level is {claim.level!r}"
        )
    if kind == "client" and claim.level != "client":
        raise UsageError(
            f"canary clients audit client-level DP, but the claim's level is {claim.level!r}"
        )


def _check_set(cs: CanarySet, obs: dict, where: str) -> None:
    if str(obs.get("kind", "")) != cs.kind:
        raise UsageError(
            f"{where}: observations of kind {str(obs.get('kind'))!r}, canary set of kind "
            f"{cs.kind!r}"
        )
    if str(obs.get("set_sha256", "")) != cs.sha256:
        raise UsageError(
            f"{where}: the observations belong to another canary set (set_sha256 "
            f"{str(obs.get('set_sha256'))[:12]}…, this set {cs.sha256[:12]}…)"
        )


def _gradient_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list, own: list) -> tuple:
    """The canaries' scores and what the file says of the run; a C, q, sampling or count
    of steps that differs from the claim is a finding in ``own`` (never a usage error:
    :func:`audit.canaries.observations.gradient_run`)."""
    from audit.canaries import gradient as GC

    m = cs.count
    x = obs_array(obs, "obs", (None, m), where, finite=False)
    if x.shape[0] < 1:
        raise UsageError(f"{where}: no steps observed")
    run = gradient_run(obs, x.shape[0], claim, cs.spec, where, notes)
    own += run["findings"]
    sigma, clip, q, sampling = run["sigma"], run["clip"], run["q"], run["sampling"]
    steps, sp = x.shape[0], cs.spec
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        own.append(_nonfinite(where, "step", bad, int((~np.isfinite(x)).sum())))
    finite_x = x[~bad]
    # the run audit's scorer: records name their group after the last "/" (group_of)
    group = {p["name"]: p["group"] for p in sp["params"]}
    records = [{"param": f"{c['param']}/{group[c['param']]}"} for c in sp["coordinates"]]
    # scored on the finite steps only (a release with NaN or Inf is its own finding)
    ob = {"ids": np.arange(m), "obs": finite_x, "sigma": claim.noise_multiplier, "clip": clip}
    ob["q"] = q
    noise = GC.observed_noise(records, [ob])
    scores = GC.canary_scores(records, [ob], GC.DEFAULT_STATISTIC, noise)
    info = {
        "steps": steps,
        "sigma": sigma,
        "clip": clip,
        "q": q,
        "statistic": GC.DEFAULT_STATISTIC,
        "score": GC.STATISTICS[GC.DEFAULT_STATISTIC],
        "noise": {
            g: {
                "observed_over_claimed": r,
                "scored_at": "observed" if r < GC.NOISE_FLOOR else "claimed",
            }
            for g, r in noise.items()
        },
    }
    if "source" in obs:
        info["source"] = str(obs["source"])
    if sampling is not None:
        info["sampling"] = sampling
    expected = None
    if "expected_batch_size" in obs:
        expected = scalar(obs, "expected_batch_size", where)
        info["expected_batch_size"] = expected
    scale = None
    if "scale" in obs:
        scale = obs_array(obs, "scale", (x.shape[0],), where)
    raw = {"x": x, "q": q, "clip": clip, "sigma": sigma, "expected_batch": expected}
    raw["scale"], raw["nonfinite"] = scale, int(bad.sum())
    raw["entered"] = info["canaries_entered"] = run["entered"]
    return scores, info, raw


def _input_scores(cs: CanarySet, obs: dict, where: str) -> tuple:
    m = cs.count
    have = [k for k in ("score", "loss") if k in obs]
    if len(have) != 1:
        raise UsageError(f"{where}: give exactly one of the fields 'score' and 'loss' (per canary)")
    a = obs_array(obs, have[0], (m,), where)
    return (a if have[0] == "score" else -a), {
        "score": "the observation's score"
        if have[0] == "score"
        else "-loss under the trained model"
    }


def _client_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list, own: list) -> tuple:
    m = cs.count
    inner = obs_array(obs, "inner", (None, m), where, finite=False)
    t = inner.shape[0]
    if t < 1:
        raise UsageError(f"{where}: no rounds observed")
    norms = obs_array(obs, "norms", (t,), where, finite=False)
    final_inner = obs_array(obs, "final_inner", (m,), where, finite=False)
    final_norm = float(obs_array(obs, "final_norm", (), where, finite=False))
    bad = ~(np.isfinite(inner).all(axis=1) & np.isfinite(norms))
    final_bad = not (np.isfinite(final_inner).all() and math.isfinite(final_norm))
    if bad.any() or final_bad:
        n_bad = int((~np.isfinite(inner)).sum() + (~np.isfinite(norms)).sum())
        own.append(_nonfinite(where, "round", bad, n_bad, final_bad))
    sigma, clip = scalar(obs, "sigma", where), scalar(obs, "clip", where)
    per_round = scalar(obs, "clients_per_round", where)
    sp = cs.spec
    own += clip_findings(clip, claim, sp, where)
    own += client_round_findings(int(per_round), t, claim, where, notes)
    everyone = claim.sampling == "all" or claim.clients_per_round == claim.total_clients
    if sp["participation"] == "every_round" and not everyone:
        raise UsageError(
            f"canary clients take part in every round, but the claim samples "
            f"{claim.clients_per_round} of {claim.total_clients} clients ({claim.sampling!r})"
        )
    if sp["participation"] == "poisson":
        if claim.sampling != "poisson":
            raise UsageError(
                f"canary clients are Poisson-sampled at {sp['rate']:g}, but the claim's "
                f"sampling is {claim.sampling!r}"
            )
        q = claim.clients_per_round / claim.total_clients
        if not same(float(sp["rate"]), q):
            raise UsageError(
                f"canary clients are Poisson-sampled at {sp['rate']:g}, the claim's rate is "
                f"clients_per_round / total_clients = {q:g}"
            )
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norms[:, None] > 0, inner / norms[:, None], 0.0)[~bad]
    fin = final_inner / final_norm if final_norm > 0 and not final_bad else np.zeros(m)
    return {"all_iterates": cos.sum(axis=0), "final_model": fin}, {
        "rounds": t,
        "sigma": sigma,
        "clip": clip,
        "clients_per_round": int(per_round),
        "participation": sp["participation"],
        "rate": float(sp["rate"]),
        "directions": sp["directions"],
        "nonfinite": int(bad.sum()) + int(final_bad),
    }


def audit_outside(canaries, observations, claim, *, alpha: float = 0.05, key_file=None) -> dict:
    """Audit an outside training: its canary set (folder), observation file and claim
    (:class:`audit.claims.schema.Claim`, a dict, or a file). Returns the result document.

    Gradient canaries and canary clients (orthogonal directions) also get the conformance
    tests (:mod:`audit.bounds.conformance`: the noise at each canary is at least the
    claim's N(0, σ²C²), fresh at every step, a canary adds at most C, and a gradient
    canary exactly C: :func:`audit.bounds.contribution.clip_contribution_test`) with the claim's
    σ and C, never the file's, the coins re-drawn from the set's key, and the noise-implied
    ε of the claim's mechanism (``conformance``).

    ``verdict``, first that applies: ``"does not implement its claim"`` (a conformance test
    rejects: finding ``mechanism_mismatch``; or the run's C, q, sampling, steps or clients per
    round differ from the claim's: ``clip_differs``, ``sample_rate_differs``,
    ``sampling_differs``, ``steps_differs``, ``clients_per_round_differs``, listed in
    ``run_differs``), ``"leaks more than claimed"`` (the certified
    bound exceeds what the claimed ε allows one canary), ``"claim understated"`` (the
    recomputed ε exceeds the claimed one, or the claim check has another error),
    ``"claim not supported"`` (the observation file states a σ below the claim's, or another
    error finding), ``"incomplete"`` (nothing found, but a part of the mechanism —
    sampling, clipping, noise, accounting — was not tested: ``coverage``, ``untested``;
    exit 4), else ``"ok"`` (every part tested or not applicable; exit 0). A release that
    holds NaN or Inf (``release_nonfinite``) or carries no noise at all (``noise_absent``)
    does not implement its claim: its noise-implied ε is ∞ (never an exception).

    Where the observations look divided by a batch size (``observe()`` given the batch
    mean without ``scale=B``), the finding ``observations_look_averaged`` (a warning beside
    the failing conformance test, never an excuse) names the factor
    (:func:`audit.canaries.outside_conformance.averaged_hint`).

    Raises:
        UsageError: bad input (one line): missing, unreadable or malformed files,
            observations of another set or kind, a claim at the wrong level. (A run whose
            σ, C, q, sampling or steps disagree with the claim is a finding, exit 1.)
    """
    from audit.claims.check import check_claim
    from audit.claims.schema import Claim, load_claim, validate_claim

    if not (isinstance(alpha, int | float) and 0.0 < alpha < 1.0):
        raise UsageError(f"--alpha must be in (0, 1), got {alpha}")
    c = (
        claim
        if isinstance(claim, Claim)
        else (validate_claim(claim) if isinstance(claim, dict) else load_claim(claim))
    )
    cs = load_canary_set(canaries, key_file=key_file)
    obs = read_observations(observations)
    where = f"--observations {observations}"
    _check_set(cs, obs, where)
    _check_level(cs.kind, c)
    notes: list[str] = []
    checked = check_claim(c)
    y = cs.included
    estimate = None
    own: list[dict] = []  # this audit's findings beside the claim check's
    block, how, not_tested = None, "", None
    if cs.kind in ("gradient", "client"):
        f = stated_sigma(scalar(obs, "sigma", where), c, where)
        if f is not None:
            own.append(f)
    if cs.kind == "gradient":
        scores, info, raw = _gradient_scores(cs, obs, c, where, notes, own)
        if not raw["nonfinite"]:
            block, how = gradient_block(cs, raw, c)
    elif cs.kind == "input":
        scores, info = _input_scores(cs, obs, where)
        not_tested = (
            "input canaries give one loss per canary after training: there is no per-step "
            "release to test"
        )
    else:
        stats, info = _client_scores(cs, obs, c, where, notes, own)
        scores = stats["all_iterates"]  # the certified test's statistic, fixed in advance
        from audit.canaries.clients import STATISTICS, gaussian_fit

        if min(int(y.sum()), int((~y).sum())) >= 2:
            estimate = {
                k: {"score": STATISTICS[k], **gaussian_fit(v, y, c.delta)} for k, v in stats.items()
            }
        info["statistic"] = "all_iterates"
        info["score"] = STATISTICS["all_iterates"]
        if info.get("nonfinite"):
            block, how = None, ""
        else:
            block, how, not_tested = client_block(cs, obs, c, where)
    if block is not None and not c.noise_multiplier > 0:
        block, not_tested = None, "the claim's σ is 0: it claims no noise to test"
    nonfinite = raw["nonfinite"] if cs.kind == "gradient" else info.get("nonfinite", 0)
    if nonfinite:
        block, not_tested = (
            None,
            ("the releases hold NaN or Inf (release_nonfinite): no noise scale to test"),
        )
    if block is not None:
        # gradient canaries: the two-sided clip test joins the family (a drawn canary adds
        # exactly C where the training clips each example, which a sample-level claim is)
        two = cs.kind == "gradient"
        conf = outside_conformance(block, how, claim_clip(cs, c), c, checked, alpha, own, two)
        if two:
            conf["canaries_entered"] = raw["entered"]
        if conf["skipped"]:
            notes.append(
                "conformance: the clipping test is skipped (the canaries' coins are "
                f"{how}); the scale and freshness tests ran"
            )
        if cs.kind == "gradient" and not conf["passed"]:
            hint = averaged_hint(
                block.u,
                None if block.coins is None else block.coins & block.included[None, :],
                c.noise_multiplier,
                expected_batch=raw["expected_batch"],
                scale=raw["scale"],
                where=where,
            )
            if hint is not None:
                own.append(hint)
                conf["averaged"] = {k: hint[k] for k in ("batch", "batch_range", "evidence")}
    else:
        conf = {"performed": False, "reason": not_tested}
        if nonfinite:
            conf.update(implied_epsilon=math.inf, implied_factor=math.nan)
    eps_c, eps_r = c.claimed_epsilon, float(checked["epsilon_pld"])
    allowed, d_used, relation = _relation(cs.kind, c.level, eps_c, c.delta)
    b = _bounds(scores, y, d_used, alpha)
    leaks = b["epsilon_lb"] > allowed
    allowed_r, d_r, _ = (
        _relation(cs.kind, c.level, eps_r, c.delta)
        if math.isfinite(eps_r)
        else (
            math.inf,
            c.delta,
            "",
        )
    )
    lb_r = b["epsilon_lb"] if d_r == d_used else _bounds(scores, y, d_r, alpha)["epsilon_lb"]
    exceeds_recomputed = lb_r > allowed_r
    claim_errors = [f for f in checked["findings"] if f.get("severity") == "error"]
    findings = list(checked["findings"]) + own
    if leaks:
        findings.append(
            {
                "code": "empirical_exceeds_claim",
                "severity": "error",
                "message": f"The canary audit bounds ε >= {b['epsilon_lb']:.3g} (at δ = "
                f"{d_used:.3g}; {b['bound']}) with confidence {1 - alpha:g} from {cs.count} "
                f"{cs.kind} canaries, above the {allowed:.4g} that the claimed ε = {eps_c:g} "
                f"allows for one canary ({relation}): the training leaks more than claimed.",
            }
        )
    elif exceeds_recomputed:
        findings.append(
            {
                "code": "empirical_exceeds_mechanism",
                "severity": "warning",
                "message": f"The canary audit bounds ε >= {lb_r:.3g}, above the {allowed_r:.4g} "
                f"that the mechanism as described (ε = {eps_r:.4g}) allows, though within the "
                f"claimed ε = {eps_c:g}: what ran is not the mechanism the claim describes.",
            }
        )
    understated = bool(checked["understated"])
    mismatch = bool(conf["performed"] and not conf["passed"])
    differs = sorted({f["code"] for f in own if f["code"] in RUN_DIFFERS})
    broken = any(f["code"] in NOT_THE_MECHANISM for f in own)
    coverage = _coverage(cs.kind, c, checked, conf, how)
    errors = sum(f.get("severity", "error") == "error" for f in findings)
    outcome, _ = decide(errors, coverage)
    if mismatch or differs or broken:
        verdict = "does not implement its claim"
    elif leaks:
        verdict = "leaks more than claimed"
    elif understated or claim_errors:
        verdict = "claim understated"
    elif outcome == "fail":
        verdict = "claim not supported"
    elif outcome == "incomplete":
        verdict = "incomplete"
    else:
        verdict = "ok"
    res = {
        "kind": "outside_canaries",
        "canary_kind": cs.kind,
        "canaries": str(cs.folder),
        "observations_file": str(observations),
        "set_sha256": cs.sha256,
        "m": cs.count,
        "n_included": int(y.sum()),
        "alpha": alpha,
        "claim": {
            k: checked[k]
            for k in (
                "claimed_epsilon",
                "delta",
                "epsilon_pld",
                "epsilon_rdp",
                "understated",
                "neighbouring",
                "mechanism",
            )
        },
        "observations": info,
        "relation": relation,
        "allowed_epsilon": allowed,
        "delta_bound": d_used,
        **b,
        "leaks_more_than_claimed": bool(leaks),
        "exceeds_recomputed": bool(exceeds_recomputed),
        "conformance": conf,
        "mechanism_mismatch": mismatch,
        "run_differs": differs,
        "labels": {
            "epsilon_lb": "certified: the larger of Steinke et al. (2023) and the f-DP bound "
            "(Mahloujifar et al. 2024, (ε, δ) family), each at α/2: holds with probability "
            ">= 1 - alpha",
            "conformance": "white-box tests of the per-step releases against the claim's σ "
            "and C (audit.bounds.conformance), family-wise level alpha (Holm); valid for any "
            "data gradient; the implied ε is conditional, not certified",
        },
        "notes": notes,
        "findings": findings,
        "coverage": coverage.to_dict(),
        "untested": coverage.describe(),
        "verdict": verdict,
        "exit_code": _exit(verdict),
    }
    if estimate is not None:
        res["estimate"] = estimate
        res["labels"]["estimate"] = "Gaussian-fit estimate (Andrew et al. 2024): not a bound"
    return res


def _coverage(kind: str, c, checked: dict, conf: dict, how: str) -> Coverage:
    """Which part of the mechanism this audit tested (:mod:`audit.coverage`): the noise by
    the conformance tests' scale and freshness tests, the clipping by their clipping test
    (it needs the canaries' coins; gradient canaries: the two-sided test, and only where they
    entered as per-example rows before the training's clip, since "at most C" passes a clip
    of the batch sum), the accounting by the claim check (ε recomputed, the
    run's C, q, steps compared with the claim's; input canaries record nothing of the run).
    The training's own sampler is never observed here: where the claim takes amplification
    by sampling (Poisson at q < 1), sampling is untested; elsewhere it does not apply."""
    from audit.canaries.outside_conformance import claim_mechanism

    cov = Coverage()
    ran = {t["test"] for t in conf.get("tests") or []} if conf.get("performed") else set()
    if ran & {"scale", "fresh"}:
        cov.add("noise", "canaries")
    else:
        cov.skip("noise", str(conf.get("reason") or "no conformance test ran"))
    if kind == "gradient" and conf.get("canaries_entered") == "clipped_sum" and ran:
        cov.skip(
            "clipping",
            "the canaries were added to the clipped sum (GradientCanaryHook.add_clipped): "
            "the training's clip never saw them; give them as per-example rows "
            "(canary_rows) before the clip to test it",
        )
    elif kind == "gradient" and "contribution" in ran:
        cov.add("clipping", "canaries")  # the two-sided test ran (conformance: contribution)
    elif kind == "gradient" and "clip" in ran:
        cov.skip(
            "clipping",
            "only the one-sided clip test ran (no drawn canary had a random coin for the "
            "two-sided one): 'at most C' passes a clip of the batch sum, whose canaries add "
            "less than C",
        )
    elif kind == "client":
        cov.skip(
            "clipping",
            "the canary clients' updates enter the aggregate at norm C after the server's clip "
            "(ClientCanaryHook): the clip itself never sees them, so its test holds by "
            "construction; a client-level clip is tested by a neighbour replay (docs/replay.md) "
            "or a library audit whose canary clients run through it (audit.libraries.flower)",
        )
    elif "clip" in ran:
        cov.add("clipping", "canaries")
    elif conf.get("performed"):
        cov.skip("clipping", f"the clipping test needs the canaries' coins, which are {how}")
    else:
        cov.skip("clipping", str(conf.get("reason") or "no conformance test ran"))
    mech = claim_mechanism(c, checked)
    if not (mech.poisson and mech.q < 1.0):
        cov.inapplicable(
            "sampling", "the claim takes no amplification by sampling (q = 1 or no Poisson)"
        )
    else:
        cov.skip(
            "sampling",
            "the training's own sampler was not observed (the canaries' coins are the hook's, "
            f"not the {'server' if kind == 'client' else 'data loader'}'s): a sampling test "
            "needs the sampler's draws, as the library audits record them",
        )
    if kind == "input":
        cov.skip(
            "accounting",
            "input canaries record nothing of the run (steps, rate, C): the claim's ε was "
            "recomputed, not checked against what ran",
        )
    elif math.isfinite(float(checked["epsilon_pld"])):
        cov.add("accounting", "claim check")
    else:
        cov.skip("accounting", "the claim's ε could not be recomputed")
    return cov


def _exit(verdict: str) -> int:
    if verdict == "ok":
        return 0
    return EXIT_INCOMPLETE if verdict == "incomplete" else 1


def exit_code(result: dict) -> int:
    """0 (verdict ``ok``): every part of the mechanism tested, nothing found; 4
    (``incomplete``, :data:`audit.coverage.EXIT_INCOMPLETE`): nothing found, but some part
    untested (``untested`` says which and why); 1: a conformance test rejects the claim,
    the run's C, q, sampling or steps differ from the claim's, a release is not finite or
    carries no noise, the training leaks more than claimed, the claim check has an error
    finding (e.g. an understated ε) or the observation file states a σ below the claim's."""
    return _exit(str(result.get("verdict")))


__all__ = [
    "CLIENTS_PER_ROUND_DIFFERS",
    "CLIP_DIFFERS",
    "OBS_FORMAT",
    "RUN_DIFFERS",
    "SAMPLE_RATE_DIFFERS",
    "SAMPLING_DIFFERS",
    "STEPS_DIFFERS",
    "STATED_SIGMA_DIFFERS",
    "audit_outside",
    "averaged_hint",
    "exit_code",
    "gradient_coins",
    "read_observations",
    "write_observations",
]
