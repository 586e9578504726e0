"""Refactorization noise: PowerDP vs input vs output perturbation at equal ε.

The clipped client average W̄ = Σ_k p ΔW_k (p = 1/K, every ‖ΔW_k‖_F clipped to C) is
released at rank r by each mechanism of :mod:`fl.privacy.powerdp`, with its noise
multiplier calibrated so that ONE release of W̄ (one round, every client present,
q = 1) costs exactly ε at δ:

* ``powerdp``: 2·iters + 1 Gaussian releases of sensitivity Δ = C·p (σ as
  ``calibrate_powerdp_sigma(ε, δ, 1, iters, 1.0)``, computed in closed form);
* ``input``: noise on all m×n entries of W̄ (one release, Δ = C·p);
* ``output``: noise on the truncated-SVD factors, ``norm_bound`` calibration
  (two releases, Δ_B = 2C, Δ_A = 2√r — the valid DP bound);
* ``output_heuristic``: the same with Δ = C·p for both factors — NOT a DP
  guarantee (shown because even this optimistic calibration is compared).

Errors against the non-private rank-r truncated SVD B₀A₀ of W̄ (``no_perturbation``):
* subspace_error = sin θ_max(rowspace(A), rowspace(A₀)) (largest principal angle of
  the right singular subspaces; ``left_subspace_error`` the same for the columns of B);
* reconstruction_error = ‖BA − B₀A₀‖_F / ‖B₀A₀‖_F.
Each is the mean over ``trials`` noise draws (``*_std`` beside it).

Synthetic data: ΔW_k = L + E_k with L of rank r (singular values spread linearly
from 1 to 0.5, scaled so ‖L‖_F = 0.8C) and E_k i.i.d. Gaussian of norm ``noise``·C,
so W̄ is low rank plus a small full-rank part. From runs: each module's final
aggregated update W̄ = s·B A is treated as the average of K = config.clients clients
with C = ‖W̄‖_F (nothing clipped, Δ = C/K); errors are averaged over modules (each
module is measured as its own release — a utility measurement, not a composed ε).
"""

from __future__ import annotations

import math

import torch
from scipy.special import log_ndtr, ndtr

from analysis import figures
from analysis import runs as runs_mod
from analysis.schemas import validate
from fl import linalg
from fl.errors import UsageError
from fl.privacy import powerdp as pdp

NAME = "refactorization"
SCHEMES = ("powerdp", "input", "output", "output_heuristic")

__all__ = [
    "run",
    "sigma_for",
    "gaussian_sigma",
    "gaussian_delta",
    "errors",
    "synthetic_clients",
    "table",
]


def gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact δ(ε) of a Gaussian mechanism with μ = Δ/std (Balle & Wang 2018):
    δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (log-space for the second term)."""
    a = ndtr(-epsilon / mu + mu / 2)
    b = math.exp(epsilon + log_ndtr(-epsilon / mu - mu / 2))
    return max(0.0, float(a - b))


def gaussian_sigma(epsilon: float, delta: float, releases: int) -> float:
    """Smallest noise multiplier σ (relative tolerance 1e-10, rounded up) such that
    ``releases`` adaptively composed Gaussian releases of multiplier σ on the same
    data (q = 1) are (ε, δ)-DP. They compose exactly to one Gaussian with
    μ = √releases/σ, so this is exact — the PLD accountant
    (``fl.privacy.accounting``) gives the same σ up to its discretization, and
    ``tests/analysis`` checks that (``calibrate_noise`` is too slow to call 30 times)."""
    if not (epsilon > 0 and 0 < delta < 1 and releases >= 1):
        raise ValueError(
            f"need ε > 0, 0 < δ < 1, releases >= 1; got {epsilon}, {delta}, {releases}"
        )
    lo, hi = 1e-6, 1.0  # μ bracket: δ(ε; μ) increases with μ
    while gaussian_delta(epsilon, hi) < delta:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_delta(epsilon, mid) > delta:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return math.sqrt(releases) / lo  # lo meets δ: the σ returned never understates ε


def releases_of(scheme: str, iters: int) -> int:
    """Gaussian releases of one round of ``scheme``."""
    if scheme == "powerdp":
        return pdp.releases_per_round(iters)
    if scheme == "input":
        return 1
    if scheme in ("output", "output_heuristic"):
        return 2  # B and A
    raise ValueError(f"unknown scheme {scheme!r}")


def sigma_for(scheme: str, epsilon: float, delta: float, iters: int) -> float:
    """Noise multiplier giving ε(δ) for one round of ``scheme`` with every client
    present (q = 1); see :func:`gaussian_sigma`."""
    return gaussian_sigma(epsilon, delta, releases_of(scheme, iters))


def synthetic_clients(m, n, r, K, clip, noise, seed):
    """The clipped average of K dense client updates ΔW_k = L + E_k, as one factored
    "client" (B = W̄ (m×n), A = I_n, weight 1). Pass ``weight_bound = 1/K``: the
    sensitivity is then C/K exactly as for the K clients, and W̄ is the same matrix
    (every ‖ΔW_k‖ ≤ C, so ‖W̄‖ ≤ C and the mechanisms' own clipping is a no-op),
    at 1/K of the cost. Returns (Bs, As, weights, weight_bound)."""
    g = torch.Generator().manual_seed(int(seed))
    U = linalg.orth(torch.randn(m, r, generator=g, dtype=torch.float64))
    V = linalg.orth(torch.randn(n, r, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.5, r, dtype=torch.float64)
    L = (U * s) @ V.mT
    L = L * (0.8 * clip / float(torch.linalg.matrix_norm(L)))
    eye = torch.eye(n, dtype=torch.float64)
    Wbar = torch.zeros(m, n, dtype=torch.float64)
    for _ in range(K):
        E = torch.randn(m, n, generator=g, dtype=torch.float64)
        Wk = L + E * (noise * clip / float(torch.linalg.matrix_norm(E)))
        Bk, _, _, _ = pdp.clip_factored(Wk, eye, clip)
        Wbar += Bk / K
    return [Wbar], [eye], [1.0], 1.0 / K


def _sin_max(U, V) -> float:
    return math.sin(float(linalg.largest_principal_angle(U, V)))


def errors(B, A, B0, A0) -> dict:
    """subspace_error, left_subspace_error, reconstruction_error of (B, A) vs (B0, A0)."""
    ref = B0 @ A0
    return {
        "subspace_error": _sin_max(A.mT, A0.mT),
        "left_subspace_error": _sin_max(B, B0),
        "reconstruction_error": float(
            torch.linalg.matrix_norm(B @ A - ref) / torch.linalg.matrix_norm(ref)
        ),
    }


def _release(scheme, Bs, As, w, rank, sigma, clip, gen, iters, seed, weight_bound):
    if scheme == "powerdp":
        return pdp.powerdp(
            Bs,
            As,
            w,
            rank,
            iters,
            sigma,
            clip,
            gen,
            dense=True,
            seed=seed,
            weight_bound=weight_bound,
        )
    if scheme == "input":
        return pdp.input_perturbation(Bs, As, w, rank, sigma, clip, gen, weight_bound=weight_bound)
    if scheme == "output":
        return pdp.output_perturbation(Bs, As, w, rank, sigma, clip, gen, weight_bound=weight_bound)
    return pdp.output_perturbation(
        Bs, As, w, rank, sigma, clip, gen, calibration="heuristic", weight_bound=weight_bound
    )


def measure(
    Bs, As, w, rank, eps_grid, delta, iters, trials, clip, seed, schemes=SCHEMES, weight_bound=None
) -> list[dict]:
    """Rows (scheme, ε, mean errors over ``trials``) for one client set."""
    B0, A0, _ = pdp.no_perturbation(Bs, As, w, rank, clip)
    rows = []
    for si, scheme in enumerate(schemes):
        for eps in eps_grid:
            sigma = sigma_for(scheme, eps, delta, iters)
            acc: dict[str, list[float]] = {}
            for t in range(trials):
                g = torch.Generator().manual_seed(int(seed) * 7919 + 1000 * si + t)
                B, A, rec = _release(
                    scheme, Bs, As, w, rank, sigma, clip, g, iters, seed, weight_bound
                )
                for k, v in errors(B, A, B0, A0).items():
                    acc.setdefault(k, []).append(v)
            row = {
                "scheme": scheme,
                "epsilon": eps,
                "delta": delta,
                "noise_multiplier": sigma,
                "releases": len(rec),
                "dp_valid": scheme != "output_heuristic",
                "trials": trials,
            }
            for k, vals in acc.items():
                mean = sum(vals) / len(vals)
                row[k] = mean
                row[f"{k}_std"] = (
                    math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
                    if len(vals) > 1
                    else 0.0
                )
            rows.append(row)
    return rows


def default_eps() -> list[float]:
    return [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def _run(
    seed: int = 0,
    out=None,
    m: int = 64,
    n: int = 48,
    rank: int = 4,
    clients: int = 200,
    noise: float = 0.1,
    clip: float = 1.0,
    epsilons=None,
    delta: float = 1e-5,
    iters: int = 2,
    trials: int = 4,
    schemes=SCHEMES,
    runs=None,
    figure: bool = True,
) -> dict:
    """The refactorization analysis. Returns the JSON document; writes
    refactorization.{json,png,svg} to ``out`` when given."""
    eps_grid = list(epsilons) if epsilons is not None else default_eps()
    if not eps_grid or any(not (e > 0 and math.isfinite(e)) for e in eps_grid):
        raise UsageError(f"ε grid must be positive and finite, got {eps_grid}")
    if not (0 < delta < 1) or trials < 1 or iters < 0:
        raise UsageError("need 0 < δ < 1, trials >= 1, iters >= 0")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise UsageError(f"unknown scheme(s) {bad}; choose from {', '.join(SCHEMES)}")
    setting = {
        "m": m,
        "n": n,
        "rank": rank,
        "clients": clients,
        "noise": noise,
        "clip": clip,
        "delta": delta,
        "iters": iters,
        "trials": trials,
        "runs": bool(runs),
    }
    if runs:
        rows = _run_rows(runs, rank, eps_grid, delta, iters, trials, seed, schemes)
    else:
        if min(m, n, rank, clients) <= 0 or rank > min(m, n):
            raise UsageError("need positive m, n, clients and 1 <= rank <= min(m, n)")
        Bs, As, w, wb = synthetic_clients(m, n, rank, clients, clip, noise, seed)
        rows = measure(
            Bs, As, w, rank, eps_grid, delta, iters, trials, clip, seed, schemes, weight_bound=wb
        )
    doc = {"analysis": NAME, "seed": seed, "setting": setting, "rows": rows}
    doc = figures.jsonable(doc)
    validate(doc)
    if out is not None:
        figures.write_json(doc, out, NAME)
        if figure:
            plot(doc, out)
    return doc


def _run_rows(run_dirs, rank, eps_grid, delta, iters, trials, seed, schemes):
    rows = []
    for d in run_dirs:
        facs = runs_mod.load_factors(d)
        s = runs_mod.run_scaling(d)
        K = int(runs_mod.read_manifest(d).get("config", {}).get("clients", 1) or 1)
        per_mod = []
        for B, A in facs.values():
            r_out = min(rank, B.shape[1])
            C = float(linalg.factored_fro_norm(s * B, A))
            if C == 0.0:
                continue  # a zero update has no subspace to compare
            per_mod.append(
                measure(
                    [s * B],
                    [A],
                    [1.0],
                    r_out,
                    eps_grid,
                    delta,
                    iters,
                    trials,
                    C,
                    seed,
                    schemes,
                    weight_bound=1.0 / K,
                )
            )
        if not per_mod:
            raise UsageError(f"{d}: every LoRA module has a zero update")
        for i, row in enumerate(per_mod[0]):
            out = dict(row)
            for k in ("subspace_error", "left_subspace_error", "reconstruction_error"):
                out[k] = sum(pm[i][k] for pm in per_mod) / len(per_mod)
            out.update({"source": str(d), "modules": len(per_mod), "clients": K})
            rows.append(out)
    return rows


_COLORS = {"powerdp": "C1", "input": "C0", "output": "C3", "output_heuristic": "C7"}


def plot(doc, out):
    rows = doc["rows"]
    fig, axes = figures.subplots(ncols=2)
    for ax, key, lab in (
        (axes[0], "subspace_error", "sin θ_max to non-private subspace"),
        (axes[1], "reconstruction_error", "‖BA − B₀A₀‖_F / ‖B₀A₀‖_F"),
    ):
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            pts = sorted((r for r in rows if r["scheme"] == scheme), key=lambda r: r["epsilon"])
            ax.errorbar(
                [r["epsilon"] for r in pts],
                [r[key] for r in pts],
                yerr=[r.get(f"{key}_std", 0.0) for r in pts],
                marker="o",
                ms=3,
                lw=1,
                capsize=2,
                color=_COLORS.get(scheme),
                ls="--" if "heur" in scheme else "-",
                label=scheme + (" (not DP)" if "heur" in scheme else ""),
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"privacy budget ε (δ = {rows[0].get('delta', 0):g}, one round)")
        ax.set_ylabel(lab + " (dimensionless)")
        ax.legend(fontsize=6)
    axes[0].axhline(1.0, color="gray", lw=0.8, ls=":")
    axes[0].set_title("subspace error (1 = orthogonal)")
    axes[1].set_title("reconstruction error")
    return figures.save_figure(fig, out, NAME)


def table(doc):
    return figures.format_table(
        doc["rows"],
        ["scheme", "epsilon", "noise_multiplier", "subspace_error", "reconstruction_error"],
        60,
    )


def run(seed: int = 0, out=None, **kwargs) -> dict:
    """Run the analysis (see :func:`_run` for the keyword arguments) on one torch thread."""
    with figures.single_thread():
        return _run(seed=seed, out=out, **kwargs)


run.__doc__ = _run.__doc__
