"""Canary audits of trainings the toolkit did not run (``fedlora canaries new``,
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
every canary, fresh at every step, and a canary adds at most C, for any data gradient. What
is tested is the CLAIM: σ is the claim's ``noise_multiplier``, C its ``clipping_norm``; the σ
an observation file states is the trainer's word, reported (``stated_sigma_differs``) and
never used. The coins are drawn again from the set's key, as the hooks drew them (without
the key the clipping test is skipped, and said so). A rejected test is the finding
``mechanism_mismatch`` and the verdict "does not implement its claim"; beside it the
noise-implied ε, the claim's mechanism at σ × the observed noise factor's upper confidence
bound (:mod:`audit.claims.implied`; conditional, not certified). Input canaries give one
loss per canary after training: nothing per step to test.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from audit.canaries.canary_set import CanarySet, load_canary_set
from fl.errors import UsageError

OBS_FORMAT = "fedlora-canary-observations/1"


def write_observations(path, fields: dict) -> Path:
    """Write an observation file (``.npz``; ``.json`` also accepted by the reader)."""
    p = Path(path)
    arrays = {k: np.asarray(v) for k, v in {"format": OBS_FORMAT, **fields}.items()}
    if p.suffix == ".json":
        doc = {k: (v.tolist() if v.ndim else v.item()) for k, v in arrays.items()}
        from fl.io import atomic_write_json

        atomic_write_json(p, doc)
        return p
    if p.suffix != ".npz":
        p = p.with_suffix(p.suffix + ".npz") if p.suffix else p.with_suffix(".npz")
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, p)
    return p


def read_observations(path) -> dict:
    """An observation file as a dict of numpy arrays / Python scalars (``.npz`` or JSON)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--observations: file not found: {p}")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            doc = {k: np.asarray(v) for k, v in raw.items()}
        else:
            with np.load(p, allow_pickle=False) as z:
                doc = {k: z[k] for k in z.files}
    except Exception as exc:  # any unreadable file (bad zip, pickle, JSON, encoding)
        raise UsageError(f"--observations: cannot read {p} ({type(exc).__name__}: {exc})") from None
    if str(doc.get("format", "")) != OBS_FORMAT:
        raise UsageError(f"--observations: {p} is not an observation file ({OBS_FORMAT})")
    return doc


def _scalar(obs: dict, key: str, where: str) -> float:
    if key not in obs or np.asarray(obs[key]).ndim != 0:
        raise UsageError(f"{where}: field {key!r} missing or not a number")
    try:
        v = float(obs[key])
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not a number") from None
    if not math.isfinite(v):
        raise UsageError(f"{where}: field {key!r} is not finite ({v})")
    return v


def _array(obs: dict, key: str, shape: tuple, where: str) -> np.ndarray:
    if key not in obs:
        raise UsageError(f"{where}: field {key!r} missing")
    try:
        a = np.asarray(obs[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not numeric") from None
    if a.ndim != len(shape) or any(s is not None and a.shape[i] != s for i, s in enumerate(shape)):
        want = "×".join("T" if s is None else str(s) for s in shape)
        raise UsageError(f"{where}: field {key!r} has shape {a.shape}, expected {want}")
    if not np.isfinite(a).all():
        raise UsageError(f"{where}: field {key!r} holds non-finite values")
    return a


def _same(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


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


def _check_clip(clip: float, claim, spec: dict, where: str) -> None:
    """The observed C against the canary set's and the claim's (one line each)."""
    if not _same(clip, float(spec["clip"])):
        raise UsageError(
            f"{where}: clip C = {clip:g} observed, the canary set's clip is {spec['clip']:g}"
        )
    if claim.clipping_norm is not None and not _same(clip, claim.clipping_norm):
        raise UsageError(
            f"{where}: clip C = {clip:g} observed, the claim says clipping_norm = "
            f"{claim.clipping_norm:g}"
        )


#: the finding of an observation file whose σ is not the claim's (the trainer's own word:
#: reported, never used by a test)
STATED_SIGMA_DIFFERS = "stated_sigma_differs"


def _stated_sigma(sigma: float, claim, where: str) -> dict | None:
    """A finding when the σ the observation file states differs from the claim's: an error
    when it is below (the training's own record says it added less noise than claimed), a
    warning when above. The tests use the claim's σ either way."""
    if _same(sigma, claim.noise_multiplier):
        return None
    below = sigma < claim.noise_multiplier
    return {
        "code": STATED_SIGMA_DIFFERS,
        "severity": "error" if below else "warning",
        "message": f"{where}: the observation file states σ = {sigma:g}, the claim "
        f"noise_multiplier = {claim.noise_multiplier:g}. "
        + (
            "The training's own record says it added less noise than the claim accounts for. "
            if below
            else "The training's own record says it added more noise than claimed. "
        )
        + "The file's σ is the trainer's word: the conformance tests and the scores use the "
        "claim's σ, and test what the observations show.",
    }


def _gradient_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list) -> tuple:
    from audit.canaries import gradient as GC
    from audit.claims.mistakes import opacus_sample_rate

    m = cs.count
    x = _array(obs, "obs", (None, m), where)
    if x.shape[0] < 1:
        raise UsageError(f"{where}: no steps observed")
    sigma = _scalar(obs, "sigma", where)
    clip = _scalar(obs, "clip", where)
    q = _scalar(obs, "q", where)
    sp = cs.spec
    _check_clip(clip, claim, sp, where)
    if claim.sampling == "poisson":
        rates = [claim.record_rate] + [r for r in [opacus_sample_rate(claim)] if r is not None]
        if not any(_same(q, r) for r in rates):
            raise UsageError(
                f"{where}: sampling rate q = {q:g} observed, the claim's rate is "
                + " or ".join(f"{r:g}" for r in rates)
            )
    elif not _same(q, 1.0):
        raise UsageError(
            f"{where}: sampling rate q = {q:g} observed, but the claim's sampling is "
            f"{claim.sampling!r}: canaries must then take part in every step (q = 1)"
        )
    steps, claimed_steps = x.shape[0], claim.rounds * claim.steps_per_round
    if steps > claimed_steps:
        raise UsageError(
            f"{where}: {steps} DP-SGD steps observed, the claim accounts "
            f"{claimed_steps} (rounds × steps_per_round)"
        )
    if steps < claimed_steps:
        notes.append(
            f"{steps} of the claim's {claimed_steps} steps observed: the bound concerns "
            "the observed steps"
        )
    # the run audit's scorer: records name their group after the last "/" (group_of)
    group = {p["name"]: p["group"] for p in sp["params"]}
    records = [{"param": f"{c['param']}/{group[c['param']]}"} for c in sp["coordinates"]]
    ob = {"ids": np.arange(m), "obs": x, "sigma": claim.noise_multiplier, "clip": clip, "q": q}
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
    return scores, info, {"x": x, "q": q, "clip": clip, "sigma": sigma}


def _input_scores(cs: CanarySet, obs: dict, where: str) -> tuple:
    m = cs.count
    have = [k for k in ("score", "loss") if k in obs]
    if len(have) != 1:
        raise UsageError(f"{where}: give exactly one of the fields 'score' and 'loss' (per canary)")
    a = _array(obs, have[0], (m,), where)
    return (a if have[0] == "score" else -a), {
        "score": "the observation's score"
        if have[0] == "score"
        else "-loss under the trained model"
    }


def _client_scores(cs: CanarySet, obs: dict, claim, where: str, notes: list) -> tuple:
    m = cs.count
    inner = _array(obs, "inner", (None, m), where)
    t = inner.shape[0]
    if t < 1:
        raise UsageError(f"{where}: no rounds observed")
    norms = _array(obs, "norms", (t,), where)
    final_inner = _array(obs, "final_inner", (m,), where)
    final_norm = _scalar(obs, "final_norm", where)
    sigma, clip = _scalar(obs, "sigma", where), _scalar(obs, "clip", where)
    per_round = _scalar(obs, "clients_per_round", where)
    sp = cs.spec
    _check_clip(clip, claim, sp, where)
    if int(per_round) != claim.clients_per_round:
        raise UsageError(
            f"{where}: {int(per_round)} clients per round (the server's denominator m) "
            f"observed, the claim says clients_per_round = {claim.clients_per_round}"
        )
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
        if not _same(float(sp["rate"]), q):
            raise UsageError(
                f"canary clients are Poisson-sampled at {sp['rate']:g}, the claim's rate is "
                f"clients_per_round / total_clients = {q:g}"
            )
    releases = claim.rounds * claim.steps_per_round
    if t > releases:
        raise UsageError(f"{where}: {t} rounds observed, the claim accounts {releases} releases")
    if t < releases:
        notes.append(f"{t} of the claim's {releases} releases observed")
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(norms[:, None] > 0, inner / norms[:, None], 0.0)
    fin = final_inner / final_norm if final_norm > 0 else np.zeros(m)
    return {"all_iterates": cos.sum(axis=0), "final_model": fin}, {
        "rounds": t,
        "sigma": sigma,
        "clip": clip,
        "clients_per_round": int(per_round),
        "participation": sp["participation"],
        "rate": float(sp["rate"]),
        "directions": sp["directions"],
    }


# --------------------------------------------------------------------------- conformance


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


def _claim_clip(cs: CanarySet, claim) -> float:
    """C of the tests: the claim's clipping norm (checked equal to the set's and the
    file's), else the set's."""
    return float(claim.clipping_norm) if claim.clipping_norm is not None else float(cs.spec["clip"])


def _gradient_block(cs: CanarySet, raw: dict, claim):
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
        u=x / _claim_clip(cs, claim),
        tracks=np.arange(cs.count),
        groups=groups,
        sigma=claim.noise_multiplier,
        included=np.asarray(cs.included, dtype=bool),
        coins=coins,
        q=q,
        order=(0,),
    )
    return block, how


def _orthonormal_directions(cs: CanarySet) -> bool:
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


def _client_block(cs: CanarySet, obs: dict, claim, where: str):
    """The canary clients' observations as one conformance block: u = ⟨ĉ_j, Δ_r⟩·m/C (the
    released update Δ_r = (clipped sum + canaries + N(0, σ²C²I)) / m projected on canary
    j's unit direction, so the noise is N(0, σ²) and an included canary adds 1), σ and m
    the claim's; coins: every round (q = 1), or re-drawn from the key per round. Returns
    (block or None, how the coins were had, why not tested)."""
    from audit.bounds.conformance import Block

    if not _orthonormal_directions(cs):
        return (
            None,
            "",
            "the canary clients' directions are isotropic (M > d), not orthogonal: their "
            "noise projections are correlated, and the tests need independent ones",
        )
    inner = _array(obs, "inner", (None, cs.count), where)
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
        u=inner * m_round / _claim_clip(cs, claim),
        tracks=np.arange(cs.count),
        groups=np.full(cs.count, "clients"),
        sigma=claim.noise_multiplier,
        included=np.asarray(cs.included, dtype=bool),
        coins=coins,
        q=q,
        order=(0,),
    )
    return block, how, None


def _claim_mechanism(c, checked: dict):
    """The mechanism the claim check computed the recomputed ε for: the reference, or
    Opacus's rate when the check read the claim with it (finding ``opacus_sample_rate``)."""
    from audit.claims.mistakes import Mech, opacus_sample_rate, reference

    ref = reference(c)
    q_op = opacus_sample_rate(c)
    if q_op is not None and any(f.get("code") == "opacus_sample_rate" for f in checked["findings"]):
        return Mech(True, q_op, ref.count)
    return ref


def _conformance(
    block, how: str, clip: float, c, checked: dict, alpha: float, findings: list
) -> dict:
    """The conformance tests of one block against the claim, the noise-implied ε of the
    claim's mechanism, and a ``mechanism_mismatch`` finding per rejected test."""
    from audit.bounds.conformance import MIN_LOG10_P, TESTS, conformance, implied_noise_factor
    from audit.claims.implied import epsilon_of_scaled_claim
    from audit.findings import Code

    res = conformance([block], alpha=alpha)
    factor, group = implied_noise_factor(res)
    mech = _claim_mechanism(c, checked)
    eps_implied, at_least = epsilon_of_scaled_claim(mech, c.noise_multiplier, factor, c.delta)
    for t in res.rejected:
        p_text = f"p < 1e{MIN_LOG10_P:.0f}" if t.log10_p <= MIN_LOG10_P else f"p = {t.p_value:.3g}"
        ratio = (
            f"observed/claimed noise {t.ratio:.3g} [{t.ratio_ci[0]:.3g}, {t.ratio_ci[1]:.3g}]"
            if t.ratio is not None
            else "the canaries' coins pull the innovations up (statistic "
            f"{t.statistic:.4g} over {t.terms} terms)"
        )
        findings.append(
            {
                "code": str(Code.MECHANISM_MISMATCH),
                "severity": "error",
                "message": f"Group {t.group}, {t.test} test ({TESTS[t.test]}): rejected at "
                f"family-wise α = {alpha:g} (Holm), {p_text}; {ratio}, tested "
                f"against the claim's σ = {c.noise_multiplier:g}. The training does not "
                "implement the mechanism its claim describes.",
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


def audit_outside(canaries, observations, claim, *, alpha: float = 0.05, key_file=None) -> dict:
    """Audit an outside training: its canary set (folder), observation file and claim
    (:class:`audit.claims.schema.Claim`, a dict, or a file). Returns the result document.

    Gradient canaries and canary clients (orthogonal directions) also get the conformance
    tests (:mod:`audit.bounds.conformance`: the noise at each canary is at least the
    claim's N(0, σ²C²), fresh at every step, and a canary adds at most C) with the claim's
    σ and C, never the file's, the coins re-drawn from the set's key, and the noise-implied
    ε of the claim's mechanism (``conformance``).

    ``verdict``, first that applies: ``"does not implement its claim"`` (a conformance test
    rejects: finding ``mechanism_mismatch``), ``"leaks more than claimed"`` (the certified
    bound exceeds what the claimed ε allows one canary), ``"claim understated"`` (the
    recomputed ε exceeds the claimed one, or the claim check has another error),
    ``"claim not supported"`` (the observation file states a σ below the claim's), else
    ``"ok"``.

    Raises:
        UsageError: bad input (one line): missing or malformed files, observations of
            another set, C / q / rounds that disagree with the claim. (A σ that disagrees
            is a finding, ``stated_sigma_differs``.)
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
        f = _stated_sigma(_scalar(obs, "sigma", where), c, where)
        if f is not None:
            own.append(f)
    if cs.kind == "gradient":
        scores, info, raw = _gradient_scores(cs, obs, c, where, notes)
        block, how = _gradient_block(cs, raw, c)
    elif cs.kind == "input":
        scores, info = _input_scores(cs, obs, where)
        not_tested = (
            "input canaries give one loss per canary after training: there is no per-step "
            "release to test"
        )
    else:
        stats, info = _client_scores(cs, obs, c, where, notes)
        scores = stats["all_iterates"]  # the certified test's statistic, fixed in advance
        from audit.canaries.clients import STATISTICS, gaussian_fit

        if min(int(y.sum()), int((~y).sum())) >= 2:
            estimate = {
                k: {"score": STATISTICS[k], **gaussian_fit(v, y, c.delta)} for k, v in stats.items()
            }
        info["statistic"] = "all_iterates"
        info["score"] = STATISTICS["all_iterates"]
        block, how, not_tested = _client_block(cs, obs, c, where)
    if block is not None and not c.noise_multiplier > 0:
        block, not_tested = None, "the claim's σ is 0: it claims no noise to test"
    if block is not None:
        conf = _conformance(block, how, _claim_clip(cs, c), c, checked, alpha, own)
        if conf["skipped"]:
            notes.append(
                "conformance: the clipping test is skipped (the canaries' coins are "
                f"{how}); the scale and freshness tests ran"
            )
    else:
        conf = {"performed": False, "reason": not_tested}
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
    if mismatch:
        verdict = "does not implement its claim"
    elif leaks:
        verdict = "leaks more than claimed"
    elif understated or claim_errors:
        verdict = "claim understated"
    elif any(f["severity"] == "error" for f in own):
        verdict = "claim not supported"
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
        "verdict": verdict,
    }
    if estimate is not None:
        res["estimate"] = estimate
        res["labels"]["estimate"] = "Gaussian-fit estimate (Andrew et al. 2024): not a bound"
    return res


def exit_code(result: dict) -> int:
    """1 when a conformance test rejects the claim, the training leaks more than claimed,
    the claim check has an error finding (e.g. an understated ε) or the observation file
    states a σ below the claim's; else 0."""
    return 0 if result.get("verdict") == "ok" else 1


__all__ = [
    "OBS_FORMAT",
    "STATED_SIGMA_DIFFERS",
    "audit_outside",
    "exit_code",
    "gradient_coins",
    "read_observations",
    "write_observations",
]
