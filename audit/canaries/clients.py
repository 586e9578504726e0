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
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from audit.bounds.hypothesis import gdp_epsilon
from audit.bounds.one_run import epsilon_one_run
from fl.privacy import canary_clients as CC

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


__all__ = ["STATISTICS", "audit", "gaussian_fit", "has_canary_clients", "scores"]
