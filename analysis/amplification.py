"""Noise amplification: how much DP noise reaches ΔW = B A under each scheme.

Setting (one DP-SGD step at a fixed point). The factors are at a fixed point
B (m×r), A (r×n). A DP step adds η·σ·C·N to every trained coordinate, N ~ N(0, 1)
i.i.d. (η the learning rate, σ the noise multiplier, C the clipping bound). Write
N_B (m×r), N_A (r×n), N_W (m×n) for the N(0, σ²C²) noise matrices; then the part of
ΔW that is noise is, per scheme:

* ``both`` (standard DP-LoRA: independent noise on A and B):
  (B + ηN_B)(A + ηN_A) − BA = η(N_B A + B N_A) + η² N_B N_A,
  E‖·‖_F² = η²σ²C²(m‖A‖_F² + n‖B‖_F²) + η⁴σ⁴C⁴·m·n·r
  (E‖N_B A‖² = σ²C² m‖A‖_F², E‖B N_A‖² = σ²C² n‖B‖_F², E‖N_B N_A‖² = σ⁴C⁴ m n r;
  every cross term has a zero mean because it is odd in N_B or N_A).
  Linear in σ² for small σ, quadratic in σ² (slope 4 in σ) for large σ.
* ``b_only`` (FFA-LoRA, FedASK's local update: A frozen): η N_B A,
  E‖·‖² = η²σ²C²·m·‖A‖_F²  (slope 2 everywhere).
* ``w_space`` (FedASK's paper form: W-space noise N_W projected by Aᵀ, i.e. the B
  noise is η N_W Aᵀ): ΔW_noise = η N_W AᵀA, E‖·‖² = η²σ²C²·m·‖AᵀA‖_F² (slope 2).
* ``powerdp`` (FedPower's release of a fixed clipped average W̄ = Σ p B_k A_k by
  :func:`fl.privacy.powerdp.powerdp`, noise multiplier σ, Δ = C·p, k = r columns):
  measured as ‖BA(σ) − BA(0)‖_F² with the same public seed. Its output is
  BA = (W̄X + G)Xᵀ with G the final release noise, independent of X, so
  E‖·‖² = σ²Δ²·m·k + E‖W̄(XXᵀ − X₀X₀ᵀ)‖² — the first term is the closed form drawn
  (a lower bound), and the second is at most 2k‖W̄‖₂² (upper bound, in the rows).

The Monte Carlo uses common random numbers across the σ grid (the same N scaled by
σ), so the fitted slopes are smooth; ``mc_stderr`` is the standard error of the mean.

From real runs (``runs=[(noisy, clean), ...]``): the noise part of ΔW is
Σ_modules ‖s(B_σA_σ − B_0A_0)‖_F² between two runs that differ only in σ (same seed,
same data order); :func:`train_pair` makes such a pair with ``fl.run.engine.train``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from analysis import figures
from analysis import runs as runs_mod
from analysis.schemas import validate
from fl import linalg
from fl.errors import UsageError
from fl.privacy import powerdp as pdp

NAME = "amplification"
SCHEMES = ("both", "b_only", "w_space", "powerdp")
DEFAULT_SHAPES = ((64, 64, 4), (128, 32, 8))

__all__ = ["run", "synthetic_rows", "closed_form", "run_pair_rows", "train_pair", "table"]


def default_sigmas() -> list[float]:
    """13 points, 4 per decade, from 1e-2 to 1e1."""
    return [10 ** (-2 + i / 4) for i in range(13)]


def fixed_point(m: int, n: int, r: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed point (B m×r, A r×n) with N(0, 1/n) and N(0, 1/m) entries (‖A‖², ‖B‖² ≈ r)."""
    A = torch.randn(r, n, generator=gen, dtype=torch.float64) / math.sqrt(n)
    B = torch.randn(m, r, generator=gen, dtype=torch.float64) / math.sqrt(m)
    return B, A


def closed_form(scheme: str, sigma: float, B, A, lr: float, clip: float, **pd) -> float:
    """E‖ΔW_noise‖_F² of ``scheme`` at noise multiplier σ (module docstring).
    For ``powerdp`` the lower bound σ²Δ²·m·k with Δ = clip·weight (``pd['weight']``)."""
    m, r = B.shape
    n = A.shape[1]
    v = (lr * sigma * clip) ** 2  # per-coordinate noise variance of one step
    a2 = float(torch.sum(A * A))
    b2 = float(torch.sum(B * B))
    if scheme == "both":
        return v * (m * a2 + n * b2) + v * v * m * n * r
    if scheme == "b_only":
        return v * m * a2
    if scheme == "w_space":
        return v * m * float(torch.sum((A.mT @ A) ** 2))
    if scheme == "powerdp":
        delta = clip * pd["weight"]
        return (sigma * delta) ** 2 * m * pd["k"]
    raise ValueError(f"unknown scheme {scheme!r}")


def _stats(x: torch.Tensor) -> tuple[float, float]:
    mean = float(x.mean())
    se = float(x.std(unbiased=True) / math.sqrt(x.numel())) if x.numel() > 1 else float("nan")
    return mean, se


def synthetic_rows(
    m: int,
    n: int,
    r: int,
    sigmas,
    trials: int,
    lr: float,
    clip: float,
    seed: int,
    powerdp_clients: int = 4,
    powerdp_iters: int = 2,
    powerdp_trials: int | None = None,
    schemes=SCHEMES,
) -> list[dict]:
    """Monte Carlo rows for one shape (m, n, r): one row per (scheme, σ)."""
    gen = torch.Generator().manual_seed(int(seed))
    B, A = fixed_point(m, n, r, gen)
    T = int(trials)
    Zb = torch.randn(T, m, r, generator=gen, dtype=torch.float64)
    Za = torch.randn(T, r, n, generator=gen, dtype=torch.float64)
    Zw = torch.randn(T, m, n, generator=gen, dtype=torch.float64) if "w_space" in schemes else None
    ZbA = Zb @ A  # N_B A / σC, (T, m, n)
    BZa = B @ Za
    ZbZa = Zb @ Za
    AtA = A.mT @ A
    rows = []
    base = {"m": m, "n": n, "r": r, "lr": lr, "clip": clip}
    for sigma in sigmas:
        e = lr * sigma * clip  # η σ C
        for scheme in schemes:
            if scheme == "both":
                D = e * (ZbA + BZa) + e * e * ZbZa
            elif scheme == "b_only":
                D = e * ZbA
            elif scheme == "w_space":
                D = e * (Zw @ AtA)
            else:
                continue
            mean, se = _stats(torch.sum(D * D, dim=(1, 2)))
            rows.append(
                {
                    "scheme": scheme,
                    "sigma": sigma,
                    "noise_power": mean,
                    "closed_form": closed_form(scheme, sigma, B, A, lr, clip),
                    "mc_stderr": se,
                    "trials": T,
                    **base,
                }
            )
    if "powerdp" in schemes:
        rows += _powerdp_rows(
            B,
            A,
            sigmas,
            powerdp_trials or max(8, T // 5),
            clip,
            seed,
            powerdp_clients,
            powerdp_iters,
            base,
        )
    order = {s: i for i, s in enumerate(SCHEMES)}
    rows.sort(key=lambda row: (order.get(row["scheme"], 99), row["sigma"]))
    return rows


def _powerdp_rows(B, A, sigmas, trials, clip, seed, K, iters, base) -> list[dict]:
    """PowerDP on W̄ = Σ_k (1/K) B_k A with B_k = B + perturbation (rank r, same row space)."""
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    m, r = B.shape
    Bs = [
        B + 0.3 * torch.randn(m, r, generator=gen, dtype=torch.float64) / math.sqrt(m)
        for _ in range(K)
    ]
    As = [A] * K
    w = [1.0 / K] * K
    B0, A0, _ = pdp.powerdp(Bs, As, w, r, iters, 0.0, clip, dense=True, seed=seed)
    Bc, Ac, _ = pdp.clip_clients(Bs, As, clip)
    Wbar = linalg.dense_sum(Bc, Ac, w)
    spec2 = float(torch.linalg.matrix_norm(Wbar, ord=2)) ** 2
    ref = B0 @ A0
    rows = []
    for sigma in sigmas:
        powers = []
        for t in range(int(trials)):
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + t)  # common across σ
            Bn, An, rec = pdp.powerdp(Bs, As, w, r, iters, sigma, clip, g, dense=True, seed=seed)
            D = Bn @ An - ref
            powers.append(float(torch.sum(D * D)))
        mean, se = _stats(torch.tensor(powers, dtype=torch.float64))
        lower = closed_form("powerdp", sigma, B, A, 1.0, clip, weight=1.0 / K, k=r)
        rows.append(
            {
                "scheme": "powerdp",
                "sigma": sigma,
                "noise_power": mean,
                "closed_form": lower,
                "closed_form_kind": "lower bound sigma^2 Delta^2 m k (final release)",
                "closed_form_upper": lower + 2 * r * spec2,
                "mc_stderr": se,
                "trials": int(trials),
                "clients": K,
                "iters": iters,
                "releases": len(rec),
                **{**base, "lr": None},
            }
        )
    return rows


def fit_exponents(rows: list[dict], npts: int = 3) -> dict:
    """{scheme: {"exponent_low", "exponent_high"}}: log-log slopes of noise_power in σ
    over the ``npts`` smallest and largest σ of each scheme (first shape only when
    several shapes are present; ``fits_by_shape`` has the rest)."""
    out = {}
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = sorted((r["sigma"], r["noise_power"]) for r in rows if r["scheme"] == scheme)
        pts = [p for p in pts if p[1] is not None]
        lo, hi = pts[:npts], pts[-npts:]
        out[scheme] = {
            "exponent_low": figures.loglog_slope([p[0] for p in lo], [p[1] for p in lo]),
            "exponent_high": figures.loglog_slope([p[0] for p in hi], [p[1] for p in hi]),
            "sigma_low": [lo[0][0], lo[-1][0]] if lo else None,
            "sigma_high": [hi[0][0], hi[-1][0]] if hi else None,
        }
    return out


# ------------------------------------------------------------------------- real runs


def _noise_power_between(noisy, clean) -> tuple[float, float, int]:
    fa, fb = runs_mod.load_factors(noisy), runs_mod.load_factors(clean)
    if set(fa) != set(fb):
        raise UsageError(f"runs {noisy} and {clean} adapt different modules")
    s_a, s_b = runs_mod.run_scaling(noisy), runs_mod.run_scaling(clean)
    tot = ref = 0.0
    for mod in fa:
        (Ba, Aa), (Bb, Ab) = fa[mod], fb[mod]
        tot += float(linalg.factored_sum_norm([Ba, Bb], [Aa, Ab], [s_a, -s_b])) ** 2
        ref += float(linalg.factored_sum_norm([Bb], [Ab], [s_b])) ** 2
    return tot, ref, len(fa)


_SAME = ("method", "model", "dataset", "seed", "rounds", "clients", "rank", "alpha", "lr")


def run_pair_rows(pairs) -> list[dict]:
    """One row per (noisy, clean) pair of run directories: noise_power =
    Σ_modules ‖s(B_σA_σ − B_0A_0)‖_F² (closed_form null). The pair must share method,
    model, data, seed and schedule (UsageError otherwise) and the clean run must have σ = 0."""
    rows = []
    for noisy, clean in pairs:
        mn, mc = runs_mod.read_manifest(noisy), runs_mod.read_manifest(clean)
        cn, cc = mn.get("config", {}), mc.get("config", {})
        diff = [k for k in _SAME if cn.get(k) != cc.get(k)]
        if diff:
            raise UsageError(f"runs {noisy} and {clean} differ in {', '.join(diff)}")
        sig_n = float(mn.get("privacy", {}).get("noise_multiplier") or 0.0)
        sig_c = float(mc.get("privacy", {}).get("noise_multiplier") or 0.0)
        if sig_c != 0.0:
            raise UsageError(f"{clean}: the reference run must have σ = 0 (has {sig_c})")
        power, ref, mods = _noise_power_between(noisy, clean)
        level = mn.get("privacy", {}).get("level", "none")
        rows.append(
            {
                "scheme": f"run:{mn.get('method', cn.get('method'))}:{level}",
                "sigma": sig_n,
                "noise_power": power,
                "closed_form": None,
                "clean_update_power": ref,
                "modules": mods,
                "run_noisy": str(noisy),
                "run_clean": str(clean),
            }
        )
    return rows


def train_pair(cfg, out, sigma: float, level: str | None = None) -> tuple[Path, Path]:
    """Train ``cfg`` twice with ``fl.run.engine.train``: at noise multiplier σ and at σ = 0
    (same seed, hence the same data order and initialization). ``level`` defaults to
    cfg.dp_level, or "sample" when that is "none". Returns (noisy_dir, clean_dir)."""
    from fl.run.engine import train

    if not (sigma > 0):
        raise UsageError(f"σ must be > 0 for the noisy run, got {sigma}")
    lvl = level or (cfg.dp_level if cfg.dp_level != "none" else "sample")
    out = Path(out)
    dirs = []
    for s in (sigma, 0.0):
        c = dataclasses.replace(cfg, dp_level=lvl, noise_multiplier=s, epsilon=0.0)
        d = out / f"sigma_{s:g}"
        train(c, d, quiet=True)
        dirs.append(d)
    return dirs[0], dirs[1]


# ---------------------------------------------------------------------------- driver


def _run(
    seed: int = 0,
    out=None,
    shapes=DEFAULT_SHAPES,
    sigmas=None,
    trials: int = 200,
    lr: float = 1.0,
    clip: float = 1.0,
    powerdp_clients: int = 4,
    powerdp_iters: int = 2,
    powerdp_trials: int = 30,
    runs=None,
    figure: bool = True,
) -> dict:
    """The amplification analysis. ``shapes``: (m, n, r) triples; ``sigmas``: the σ grid
    (default 1e-2..1e1, 13 points); ``trials``: Monte Carlo draws per (shape, σ);
    ``lr`` η and ``clip`` C of the DP step; ``runs``: (noisy, clean) run-directory
    pairs measured instead of the synthetic shapes. Writes amplification.{json,png,svg}
    to ``out`` when given. Returns the JSON document."""
    sig = list(sigmas) if sigmas is not None else default_sigmas()
    if not sig or any(not (s > 0 and math.isfinite(s)) for s in sig):
        raise UsageError(f"σ grid must be positive and finite, got {sig}")
    if trials < 2:
        raise UsageError("trials must be >= 2")
    doc = {"analysis": NAME, "seed": seed, "rows": [], "fits": {}}
    if runs:
        rows = run_pair_rows(runs)
        doc["rows"] = rows
        doc["fits"] = fit_exponents(rows)
    else:
        by_shape = []
        for i, (m, n, r) in enumerate(shapes):
            if min(m, n, r) <= 0 or r > min(m, n):
                raise UsageError(f"bad LoRA shape (m, n, r) = {(m, n, r)}")
            rows = synthetic_rows(
                m,
                n,
                r,
                sig,
                trials,
                lr,
                clip,
                seed + 101 * i,
                powerdp_clients,
                powerdp_iters,
                powerdp_trials,
            )
            doc["rows"] += rows
            by_shape.append({"shape": [m, n, r], "fits": fit_exponents(rows)})
        doc["fits"] = by_shape[0]["fits"]
        doc["fits_by_shape"] = by_shape
        doc["setting"] = {
            "lr": lr,
            "clip": clip,
            "trials": trials,
            "powerdp_trials": powerdp_trials,
            "powerdp_clients": powerdp_clients,
            "powerdp_iters": powerdp_iters,
        }
    doc = figures.jsonable(doc)
    validate(doc)
    if out is not None:
        figures.write_json(doc, out, NAME)
        if figure:
            plot(doc, out)
    return doc


_COLORS = {"both": "C3", "b_only": "C0", "w_space": "C2", "powerdp": "C1"}


def plot(doc: dict, out) -> dict:
    rows = doc["rows"]
    shapes = list(dict.fromkeys(tuple(r[k] for k in ("m", "n", "r")) for r in rows if "m" in r))
    run_rows = [r for r in rows if r["scheme"].startswith("run:")]
    panels = len(shapes) + (1 if run_rows else 0)
    fig, axes = figures.subplots(ncols=max(1, panels))
    for ax, shp in zip(axes, shapes):
        sub = [r for r in rows if tuple(r.get(k) for k in ("m", "n", "r")) == shp]
        for scheme in dict.fromkeys(r["scheme"] for r in sub):
            pts = [r for r in sub if r["scheme"] == scheme]
            x = [r["sigma"] for r in pts]
            c = _COLORS.get(scheme, "k")
            ax.plot(
                x,
                [r["noise_power"] for r in pts],
                "o",
                ms=3.5,
                color=c,
                label=f"{scheme}: Monte Carlo",
            )
            lab = "closed form" + (" (lower bd.)" if scheme == "powerdp" else "")
            ax.plot(
                x,
                [r["closed_form"] for r in pts],
                "-" if scheme != "powerdp" else "--",
                color=c,
                lw=1,
                label=f"{scheme}: {lab}",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("noise multiplier σ (noise std / clip C)")
        ax.set_ylabel("E‖ΔW_noise‖²_F (squared weight units)")
        ax.set_title(f"m={shp[0]}, n={shp[1]}, r={shp[2]}")
        if shp == shapes[0]:
            ax.legend(loc="upper left", fontsize=6)
    if run_rows:
        ax = axes[len(shapes)]
        for r in run_rows:
            ax.plot([r["sigma"]], [r["noise_power"]], "s", label=f"{r['scheme']} σ={r['sigma']:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("noise multiplier σ")
        ax.set_ylabel("Σ_modules ‖ΔW_σ − ΔW_0‖²_F")
        ax.set_title("real runs (σ vs σ=0, same seed)")
        ax.legend()
    return figures.save_figure(fig, out, NAME)


def table(doc: dict) -> str:
    """Fits per scheme, then the rows at the ends of the σ grid."""
    lines = []
    fits = [{"scheme": k, **v} for k, v in doc["fits"].items()]
    lines.append(figures.format_table(fits, ["scheme", "exponent_low", "exponent_high"]))
    rows = doc["rows"]
    sig = sorted({r["sigma"] for r in rows})
    ends = {sig[0], sig[-1]} | ({min(sig, key=lambda s: abs(math.log(s)))} if sig else set())
    pick = [
        dict(r, ratio=(r["noise_power"] / r["closed_form"]) if r.get("closed_form") else None)
        for r in rows
        if r["sigma"] in ends
    ]
    lines.append("")
    lines.append(
        figures.format_table(
            pick, ["scheme", "m", "n", "r", "sigma", "noise_power", "closed_form", "ratio"]
        )
    )
    return "\n".join(lines)


def run(seed: int = 0, out=None, **kwargs) -> dict:
    """Run the analysis (see :func:`_run` for the keyword arguments) on one torch thread."""
    with figures.single_thread():
        return _run(seed=seed, out=out, **kwargs)


run.__doc__ = _run.__doc__
