"""Estimates and bounds from a run's canary clients (client-level DP; Andrew et al. 2024,
"One-shot empirical privacy estimation for federated learning"). The canaries and their
observations: :mod:`fl.privacy.canary_clients` (operator file
``RUN/private/canary_clients.npz``).

Two statistics per canary j (higher = "included"):

- ``all_iterates``: the sum over rounds of the cosine between its direction and the
  round's aggregated noisy update. With every client in every round and the round's update
  m·Δ_t = Σ clip(u_k) + [canaries] + N(0, σ²C²I), the inner product with the unit direction
  is b_j·C + (data and other canaries) + N(0, σ²C²) per round, so the sum over T rounds
  separates included from excluded canaries by √T/σ standard deviations: the GDP μ the
  ledger composes. The cosine divides by ‖Δ_t‖, the same for every canary of a round.
- ``final_model``: the cosine with the final model delta (final minus initial global).

Two figures from each, labelled as what they are:

- **estimate** (:func:`gaussian_fit`, Andrew et al.): the included and excluded canaries'
  scores fitted as two Gaussians of one variance, μ̂ = (mean_in − mean_out) / s_pooled and
  ε̂ = ε(μ̂-GDP) at the run's δ. Not a bound: it assumes the scores are Gaussian with equal
  variances. Its interval is a percentile bootstrap over canaries (in and out resampled
  separately), mapped through ε(μ) (monotone); the analytic standard error of μ̂,
  sqrt(1/n_in + 1/n_out + μ̂²/(2n)), is given beside it.
- **certified** (:func:`audit.bounds.one_run.epsilon_one_run`, Steinke, Nasr & Jagielski 2023):
  a lower bound on ε that holds with probability >= 1 − α whatever the score distribution,
  for each statistic at α/2 (so the larger of the two holds at 1 − α). Each canary is one
  client under add/remove, the ledger's relation, so it is compared with the ledger's ε
  itself (not 2ε as for input canaries, which change one client's data).

The **conformance tests** (:mod:`audit.bounds.conformance`, dense space): the operator
file's ``proj_rounds`` is, per round and canary, the server's privatized clipped sum
projected on the canary's unit direction in units of C, x_t/C = D_t + v_t + Z_t/C with
Z_t ~ N(0, σ²C²) fresh and v_t = b_j·coin_t the canary's part.
:func:`conformance_blocks` turns them into blocks (:class:`audit.bounds.conformance.Block`)
tested against the *claim*: σ and the sampling rate q from the ledger's client-level
event of each round (unit ``federation``), C from the manifest, the coins drawn again from
the run's key (stream ``("canary-client-coins", round[, "attempt", a])``, the attempt from
the ledger's charges of interrupted rounds) or all ones when every client takes part in
every round (q = 1). One block spans consecutive rounds of one σ and q, so that the
freshness test compares consecutive rounds (a noise draw reused by the next round cancels
in their difference). FedPower (factored space) is not tested: its release is a noisy
power iteration, not a Gaussian on the clipped sum
(``fl.privacy.canary_clients.CONFORMANCE_NOTES``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.bounds.conformance import Block
from audit.bounds.hypothesis import gdp_epsilon
from audit.bounds.one_run import epsilon_one_run
from fl.errors import UsageError
from fl.privacy import canary_clients as CC
from fl.privacy import rng as R
from fl.run import inflight

STATISTICS = {
    "all_iterates": "sum over rounds of the cosine between the canary's direction and the "
    "round's aggregated noisy update",
    "final_model": "cosine between the canary's direction and the final model delta "
    "(final minus initial global)",
}


def has_canary_clients(run: str | Path, manifest: dict | None = None) -> bool:
    """Whether ``run`` was trained with ``--canary-clients`` (config) or holds their file."""
    cfg = (manifest or {}).get("config") or {}
    return int(cfg.get("canary_clients") or 0) > 0 or CC.read(run) is not None


def scores(run: str | Path) -> dict:
    """The canaries' statistics from the operator file: ``{"meta", "included" (M,),
    "all_iterates" (M,), "final_model" (M,), "rounds_observed"}``; None-free (a round not
    observed, e.g. a run stopped early, is left out of the sum)."""
    z = CC.read(run)
    if z is None:
        raise FileNotFoundError(f"{run}: no {CC.FILE} under private/ (operator files needed)")
    obs = np.asarray(z["observed"], dtype=bool)
    cos = np.asarray(z["cos_rounds"], dtype=np.float64)[obs]
    return {
        "meta": z["meta"],
        "included": np.asarray(z["included"], dtype=bool),
        "all_iterates": cos.sum(axis=0) if cos.size else np.zeros(z["m"]),
        "final_model": np.asarray(z["cos_final"], dtype=np.float64),
        "rounds_observed": int(obs.sum()),
        "participation": np.asarray(z["participated"], dtype=bool)[obs],
    }


def _mu(x_in: np.ndarray, x_out: np.ndarray) -> float:
    n_in, n_out = x_in.size, x_out.size
    pooled = ((n_in - 1) * x_in.var(ddof=1) + (n_out - 1) * x_out.var(ddof=1)) / (n_in + n_out - 2)
    if not pooled > 0:
        return math.inf if x_in.mean() > x_out.mean() else 0.0
    return float((x_in.mean() - x_out.mean()) / math.sqrt(pooled))


def _eps(mu: float, delta: float) -> float:
    if not math.isfinite(mu):
        return math.inf
    return gdp_epsilon(max(mu, 0.0), delta)


def gaussian_fit(
    score: np.ndarray,
    included: np.ndarray,
    delta: float,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Andrew et al.'s ESTIMATE: μ̂ (equal-variance Gaussian fit of the included vs excluded
    scores) and ε̂ = ε(μ̂-GDP) at ``delta``, with a percentile bootstrap interval over
    canaries (``n_boot`` resamples, in and out separately; ``seed`` is public: the
    interval is an estimate too). A negative μ̂ gives ε̂ = 0."""
    x = np.asarray(score, dtype=np.float64)
    y = np.asarray(included, dtype=bool)
    x_in, x_out = x[y], x[~y]
    if x_in.size < 2 or x_out.size < 2:
        raise ValueError("the Gaussian fit needs at least 2 included and 2 excluded canaries")
    mu = _mu(x_in, x_out)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    for b in range(n_boot):
        boot[b] = _mu(
            x_in[rng.integers(0, x_in.size, x_in.size)],
            x_out[rng.integers(0, x_out.size, x_out.size)],
        )
    a = (1 - confidence) / 2
    lo, hi = (float(v) for v in np.quantile(boot, [a, 1 - a]))
    n = x.size
    se = math.sqrt(1 / x_in.size + 1 / x_out.size + (mu * mu if math.isfinite(mu) else 0) / (2 * n))
    return {
        "kind": "estimate",
        "mu": mu,
        "epsilon": _eps(mu, delta),
        "delta": delta,
        "mu_interval": [lo, hi],
        "epsilon_interval": [_eps(lo, delta), _eps(hi, delta)],
        "confidence": confidence,
        "interval_method": f"percentile bootstrap over canaries ({n_boot} resamples, included "
        "and excluded resampled separately), mapped through ε(μ)",
        "mu_se_analytic": se,
        "n_in": int(x_in.size),
        "n_out": int(x_out.size),
        "mean_in": float(x_in.mean()),
        "mean_out": float(x_out.mean()),
        "std_in": float(x_in.std(ddof=1)),
        "std_out": float(x_out.std(ddof=1)),
        "assumption": "the scores of included and excluded canaries are Gaussian with one "
        "variance; not a bound",
    }


def _fdp(score: np.ndarray, included: np.ndarray, delta: float, alpha: float) -> dict:
    """The f-DP one-run bound of ``audit.bounds.fdp`` ((ε, δ)-DP family: valid for any mechanism),
    when that module is present; ``{"error": ...}`` otherwise."""
    try:
        from audit.bounds.fdp import fdp_one_run_bound
    except ImportError as exc:
        return {"error": f"audit.bounds.fdp unavailable: {exc}"}
    try:
        r = fdp_one_run_bound(score, included, delta, alpha=alpha, family="dp")
    except Exception as exc:  # another module's bound must not break this audit
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()}
    out["kind"] = "certified lower bound (f-DP, Mahloujifar et al. 2024)"
    return out


def audit(run: str | Path, delta: float, alpha: float = 0.05, eps_ledger=None) -> dict:
    """The canary-clients part of ``fedlora audit RUN --one-run``: per statistic the
    Gaussian-fit estimate and the certified one-run bound (each at α/2); the top-level
    ``epsilon_lb`` (certified, 1 − α) is the larger of the two, with that statistic's
    ``m, r, v, k_pos, k_neg``. ``claim_check`` compares it with the ledger's ε
    (``eps_ledger``): a canary is one client under add/remove, the ledger's relation."""
    sc = scores(run)
    y = sc["included"]
    per: dict = {}
    for name in STATISTICS:
        s = sc[name]
        cert = epsilon_one_run(s, y, delta, alpha=alpha / 2)
        cert = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in cert.items()}
        per[name] = {
            "score": STATISTICS[name],
            "certified": {**cert, "kind": "certified lower bound (Steinke et al. 2023)"},
            "certified_fdp": _fdp(s, y, delta, alpha / 2),
            "estimate": gaussian_fit(s, y, delta),
        }
    best = max(per, key=lambda k: per[k]["certified"]["epsilon_lb"])
    top = {
        k: per[best]["certified"][k]
        for k in ("epsilon_lb", "m", "r", "v", "k_pos", "k_neg", "delta")
        if k in per[best]["certified"]
    }
    fdp = [per[k]["certified_fdp"].get("epsilon_lb") for k in per]
    fdp = [v for v in fdp if isinstance(v, int | float)]
    meta = sc["meta"]
    res = {
        **top,
        "alpha": alpha,
        "kind": "canary_clients",
        "statistic": best,
        "score": STATISTICS[best],
        "n_included": int(y.sum()),
        "space": meta.get("space"),
        "space_note": meta.get("space_note"),
        "rounds_observed": sc["rounds_observed"],
        "mean_participating": float(sc["participation"].sum(axis=1).mean())
        if sc["participation"].size
        else 0.0,
        "epsilon_lb_fdp": max(fdp) if fdp else None,
        "statistics": per,
        "estimate": {k: per[k]["estimate"]["epsilon"] for k in per},
        "labels": {
            "epsilon_lb": "certified: holds with probability >= 1 - alpha",
            "epsilon_lb_fdp": "certified, f-DP one-run bound (Mahloujifar et al. 2024, "
            "(ε, δ)-DP family): holds with probability >= 1 - alpha on its own (not jointly "
            "with epsilon_lb)",
            "estimate": "Gaussian-fit estimate (Andrew et al. 2024): not a bound",
        },
    }
    if isinstance(eps_ledger, int | float) and math.isfinite(eps_ledger):
        res["claim_check"] = {
            "epsilon": float(eps_ledger),
            "delta": delta,
            "epsilon_lb": float(res["epsilon_lb"]),
            "relation": "a canary client is one client added or removed: the ledger's relation",
            "exceeds": float(res["epsilon_lb"]) > float(eps_ledger),
            "estimate_over_ledger": {
                k: (per[k]["estimate"]["epsilon"] / eps_ledger if eps_ledger > 0 else None)
                for k in per
            },
        }
    return res


#: the conformance tests' group of the canary clients
GROUP = "clients"


def ledger_rounds(manifest: dict) -> tuple[dict[int, dict], list[str]]:
    """Round → ``{"sigma", "q"}`` of the ledger's client-level release of that round (unit
    ``federation``, stage ``aggregate``: the server's Gaussian on the clipped sum), and
    notes. Two events for one round (never written by the dense methods) are tested
    against the smaller σ, with a note."""
    out: dict[int, dict] = {}
    notes: list[str] = []
    for e in ((manifest.get("privacy") or {}).get("ledger") or {}).get("events") or []:
        if str(e.get("unit", "")) != "federation" or str(e.get("stage", "")) != "aggregate":
            continue
        r = int(e.get("round", -1))
        sigma = float(e["noise_multiplier"])
        q = float(e.get("sample_rate", 1.0)) if e.get("kind") == "poisson_gaussian" else 1.0
        if r in out:
            notes.append(f"round {r}: more than one client-level event; tested at the smaller σ")
            sigma = min(sigma, out[r]["sigma"])
        out[r] = {"sigma": sigma, "q": q}
    return out, notes


def ledger_attempts(manifest: dict) -> dict[int, int]:
    """Round → the attempt it was completed as (:func:`fl.run.inflight.final_attempt` of
    the ledger's ``interrupted`` charges); rounds never interrupted are attempt 0."""
    events = ((manifest.get("privacy") or {}).get("ledger") or {}).get("events") or []
    return {
        r: inflight.final_attempt(evs) for r, evs in inflight.attempts_from_ledger(events).items()
    }


def round_coins(stream, m: int, r: int, q: float, attempt: int = 0) -> np.ndarray:
    """(m,) bool: the canaries' participation coins of round ``r`` drawn again exactly as
    :meth:`fl.privacy.canary_clients.CanaryClients.taking_part` drew them (Bernoulli(q)
    from the stream ``(COIN_STREAM, r[, "attempt", a])``; all ones at q = 1).
    ``stream(*parts)``: the run's stream factory (the key's, or the seeded one)."""
    if q >= 1:
        return np.ones(m, dtype=bool)
    src = stream(CC.COIN_STREAM, int(r), *(("attempt", attempt) if attempt else ()))
    return R.bernoulli_mask(src, m, q).numpy().astype(bool)


def conformance_blocks(run: str | Path, manifest: dict, stream) -> tuple[list[Block], dict]:
    """The conformance blocks of a run's canary clients (module doc) and what was tested:
    ``{"tested", "note" (why not, when not), "notes" (disagreements between the file and
    the claim), "rounds" (the rounds tested), "coins"}``. ``stream``: the run's stream
    factory (:func:`audit.bundle.conformance.coin_stream`), or None (the coins are then
    unknown at q < 1 and the clipping test is skipped)."""
    z = CC.read(run)
    if z is None:
        raise FileNotFoundError(f"{run}: no {CC.FILE} under private/ (operator files needed)")
    meta = z["meta"]
    why = CC.CONFORMANCE_NOTES.get(str(meta.get("space")), "unknown canary space")
    info: dict = {"tested": False, "note": why, "notes": [], "rounds": [], "coins": None}
    if why:
        return [], info
    if "proj_rounds" not in z:
        info["note"] = (
            "the observation file has no projections of the privatized sum (proj_rounds): "
            "the run was trained before they were recorded"
        )
        return [], info
    proj = np.asarray(z["proj_rounds"], dtype=np.float64)
    m = int(z["m"])
    included = np.asarray(z["included"], dtype=bool)
    seen = np.asarray(z["observed"], dtype=bool) & np.isfinite(proj).all(axis=1)
    priv = manifest.get("privacy") or {}
    clip_file = float(meta["clip"])
    clip = float(priv.get("clipping_norm") or 0) or clip_file
    notes = info["notes"]
    if not math.isclose(clip, clip_file, rel_tol=1e-9):
        notes.append(
            f"the file states C = {clip_file:g}, the manifest {clip:g}; the projections are "
            "tested in units of the manifest's"
        )
    rounds, more = ledger_rounds(manifest)
    notes += more
    try:
        attempts = ledger_attempts(manifest)
    except UsageError as exc:
        attempts = {}
        notes.append(f"the ledger's interrupted rounds cannot be read ({exc}); attempt 0 assumed")
    file_attempts = np.asarray(z.get("coin_attempts", np.full(proj.shape[0], -1)))
    rows: list[tuple[int, float, float, np.ndarray | None]] = []
    for r in np.flatnonzero(seen).tolist():
        ev = rounds.get(r)
        if ev is None:
            ev = {"sigma": float(meta["noise_multiplier"]), "q": float(meta["rate"])}
            notes.append(f"round {r}: no client-level ledger event; σ and q from the file")
        elif not math.isclose(ev["sigma"], float(meta["noise_multiplier"]), rel_tol=1e-6):
            notes.append(
                f"round {r}: the file states σ = {float(meta['noise_multiplier']):.6g}, the "
                f"ledger {ev['sigma']:.6g}; tested against the ledger's"
            )
        if not ev["sigma"] > 0:
            notes.append(f"round {r}: the claim has no noise (σ = {ev['sigma']:g}); not tested")
            continue
        a = attempts.get(r, 0)
        if 0 <= int(file_attempts[r]) != a:
            notes.append(
                f"round {r}: the file drew its coins as attempt {int(file_attempts[r])}, the "
                f"ledger's charges make it attempt {a}; the ledger's are used"
            )
        if ev["q"] < 1 and stream is None:
            coins = None
        else:
            coins = round_coins(stream, m, r, ev["q"], a)
        rows.append((r, ev["sigma"], ev["q"], coins))
    blocks: list[Block] = []
    i = 0
    while i < len(rows):
        j = i + 1
        r0, sigma, q, c0 = rows[i]
        while (
            j < len(rows)
            and rows[j][0] == rows[j - 1][0] + 1
            and rows[j][1:3] == (sigma, q)
            and (rows[j][3] is None) == (c0 is None)
        ):
            j += 1
        rs = [row[0] for row in rows[i:j]]
        blocks.append(
            Block(
                u=proj[rs] * (clip_file / clip),
                tracks=np.arange(m),
                groups=np.full(m, GROUP),
                sigma=sigma,
                included=included,
                coins=None if c0 is None else np.stack([row[3] for row in rows[i:j]]),
                q=q,
                order=(r0,),
            )
        )
        i = j
    info["rounds"] = [row[0] for row in rows]
    info["tested"] = bool(blocks)
    info["note"] = "" if blocks else "no round's projections were recorded"
    qs = {row[2] for row in rows}
    if qs and min(qs) >= 1:
        info["coins"] = "every client every round (q = 1): all ones"
    elif any(row[3] is None for row in rows):
        info["coins"] = "unknown (no key): the clipping test is skipped"
    else:
        info["coins"] = "re-drawn from the run's key"
    return blocks, info


__all__ = [
    "GROUP",
    "STATISTICS",
    "audit",
    "conformance_blocks",
    "gaussian_fit",
    "has_canary_clients",
    "ledger_attempts",
    "ledger_rounds",
    "round_coins",
    "scores",
]
