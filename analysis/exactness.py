"""Aggregation exactness: ‖ΔW_global − Σ_k p_k B_kA_k‖_F / ‖Σ_k p_k B_kA_k‖_F.

For K random clients with factors B_k (m×r), A_k (r×n) (either a shared A — the
FFA-LoRA / FedASK setting, clients train B only — or independent A_k), every
server rule of ``fl.linalg`` is applied and its relative error measured with
:func:`fl.linalg.aggregation_error` (factored, ~1e-15 for an exact aggregate):

* ``fedavg``: B = Σp_kB_k, A = Σp_kA_k (cross-term error unless A or B is shared);
* ``ffa``: B = Σp_kB_k, A shared (only with a shared A; exact there);
* ``fedask``: two-stage sketch of width w = r + p (oversketch p). ``output_rank`` r is
  the method as specified (rank-r refactorization), ``output_rank`` w keeps the full
  sketch; exact iff w ≥ d = rank(S) (and the output rank ≥ d);
* ``fedpower``: PowerDP without noise (σ = 0, no clipping): the exact average W̄
  refactorized by subspace iteration, at output rank r and at d;
* ``flora``: stacking (exact at rank Σ r_k);
* ``flexlora``: the method's exact average, released as its truncated SVD at rank d
  (exact) and r;
* ``hetlora``: zero-pad to R and average B, A with the norm weights (inexact).

``rows`` carry ``output_rank``; the figure shows error vs oversketch p (FedASK) and
vs the number of clients K (all methods). From runs: each run's adapter is one
client; errors are pooled over modules (‖·‖ = sqrt of the summed squares).
"""

from __future__ import annotations

import math

import torch

from analysis import figures
from analysis import runs as runs_mod
from analysis.schemas import validate
from fl import linalg
from fl.errors import UsageError
from fl.methods import flexlora, hetlora
from fl.methods.fedask import fedask_layer
from fl.methods.flora import truncate_release
from fl.privacy import powerdp as pdp

NAME = "exactness"
METHODS = ("fedavg", "ffa", "fedask", "fedpower", "flora", "flexlora", "hetlora")

__all__ = ["run", "client_factors", "method_errors", "table"]


def client_factors(m: int, n: int, r: int, K: int, shared_a: bool, seed: int):
    """K random clients: B_k (m×r) N(0,1/m), A_k (r×n) N(0,1/n); one A if ``shared_a``.
    Weights p_k ∝ 1 + k/K (unequal, data-size-like, sum 1). Float64."""
    g = torch.Generator().manual_seed(int(seed))
    A0 = torch.randn(r, n, generator=g, dtype=torch.float64) / math.sqrt(n)
    Bs, As = [], []
    for _ in range(K):
        Bs.append(torch.randn(m, r, generator=g, dtype=torch.float64) / math.sqrt(m))
        As.append(
            A0 if shared_a else torch.randn(r, n, generator=g, dtype=torch.float64) / math.sqrt(n)
        )
    raw = [1.0 + k / K for k in range(K)]
    return Bs, As, [x / sum(raw) for x in raw]


def _sq_parts(Bg, Ag, Bs, As, w) -> tuple[float, float]:
    den = float(linalg.factored_sum_norm(Bs, As, w))
    err = float(linalg.aggregation_error(Bg, Ag, Bs, As, w))
    return (err * den) ** 2, den**2


def method_errors(Bs, As, w, oversketch=(0,), seed: int = 0, iters: int = 4) -> list[dict]:
    """All methods on one client set (one module). Returns dicts with method,
    oversketch (FedASK only, else None), output_rank, num_sq = ‖ΔW_g − S‖², den_sq = ‖S‖²."""
    r = Bs[0].shape[1]
    m, n = Bs[0].shape[0], As[0].shape[1]
    ranks = {B.shape[1] for B in Bs}
    shared = all(A.shape == As[0].shape and torch.equal(A, As[0]) for A in As)
    d = min(sum(B.shape[1] for B in Bs), m, n)  # generic rank of S
    out = []

    def add(method, Bg, Ag, p=None, orank=None):
        num, den = _sq_parts(Bg, Ag, Bs, As, w)
        out.append(
            {
                "method": method,
                "oversketch": p,
                "output_rank": orank or Bg.shape[1],
                "num_sq": num,
                "den_sq": den,
            }
        )

    if len(ranks) == 1:
        add("fedavg", *linalg.fedavg_aggregate(Bs, As, w))
        if shared:
            add("ffa", *linalg.ffa_aggregate(Bs, As, w))
        for p in oversketch:
            if r + p > m:
                continue  # the sketch cannot be wider than the column space
            add("fedask", *fedask_layer(Bs, As, w, r, p, seed), p, r)
            if p > 0:  # at p = 0 the full sketch is the rank-r output already
                Bw, Aw = _fedask_full(Bs, As, w, r + p, seed)
                add("fedask", Bw, Aw, p, r + p)
    for orank in sorted({r, d}):
        Bp, Ap, _ = pdp.powerdp(Bs, As, w, orank, iters, 0.0, math.inf, seed=seed)
        add("fedpower", Bp, Ap, None, orank)
    add("flora", *linalg.flora_stack(Bs, As, w))
    # FlexLoRA as trained: the server keeps the exact average; what is released is its
    # rank-R truncation (fl.methods.flexlora.server_layer, flora.truncate_release).
    Bg, Ag = flexlora.server_layer(Bs, As, w)
    for orank in sorted({r, d}):
        Bt, At, _, _ = truncate_release(Bg, Ag, orank, 1.0, Bs[0].dtype)
        add("flexlora", Bt, At, None, orank)
    add("hetlora", *hetlora.server_layer(Bs, As, max(ranks)))
    return out


def _fedask_full(Bs, As, w, width, seed):
    """FedASK keeping the whole sketch (output rank = width): B A = Q Qᵀ S."""
    return fedask_layer(Bs, As, w, width, 0, seed)


def _rows_from(results: list[dict], K: int, r: int, shared, extra: dict) -> list[dict]:
    rows = []
    for res in results:
        rel = math.sqrt(res["num_sq"]) / math.sqrt(res["den_sq"]) if res["den_sq"] > 0 else None
        rows.append(
            {
                "method": res["method"],
                "clients": K,
                "rank": r,
                "oversketch": res["oversketch"],
                "shared_a": shared,
                "relative_error": rel,
                "output_rank": res["output_rank"],
                **extra,
            }
        )
    return rows


def synthetic_rows(m, n, r, clients, oversketch, shared_options, seed) -> list[dict]:
    rows = []
    for shared in shared_options:
        for K in clients:
            Bs, As, w = client_factors(m, n, r, K, shared, seed + 31 * K + (1 if shared else 0))
            res = method_errors(Bs, As, w, oversketch, seed)
            rows += _rows_from(res, K, r, shared, {"m": m, "n": n})
    return rows


def run_rows(run_dirs, oversketch, seed) -> list[dict]:
    """Each run's adapter is one client (uniform weights); errors pooled over modules."""
    if len(run_dirs) < 2:
        raise UsageError("exactness from runs needs at least 2 run directories (one per client)")
    facs = [runs_mod.load_factors(d) for d in run_dirs]
    scales = [runs_mod.run_scaling(d) for d in run_dirs]
    mods = sorted(set.intersection(*[set(f) for f in facs]))
    if not mods:
        raise UsageError("the runs share no LoRA module")
    K = len(run_dirs)
    w = [1.0 / K] * K
    pooled: dict[tuple, list[float]] = {}
    shared_all, ranks = True, set()
    for mod in mods:
        Bs = [s * f[mod][0] for s, f in zip(scales, facs)]
        As = [f[mod][1] for f in facs]
        if {tuple(B.shape[0:1]) for B in Bs}.__len__() != 1 or len({A.shape[1] for A in As}) != 1:
            raise UsageError(f"module {mod!r} has different shapes across runs")
        ranks |= {B.shape[1] for B in Bs}
        shared_all &= all(torch.equal(A, As[0]) for A in As)
        for res in method_errors(Bs, As, w, oversketch, seed):
            key = (res["method"], res["oversketch"], res["output_rank"])
            acc = pooled.setdefault(key, [0.0, 0.0])
            acc[0] += res["num_sq"]
            acc[1] += res["den_sq"]
    results = [
        {"method": k[0], "oversketch": k[1], "output_rank": k[2], "num_sq": v[0], "den_sq": v[1]}
        for k, v in pooled.items()
    ]
    return _rows_from(
        results,
        K,
        max(ranks),
        shared_all,
        {"source": "runs", "modules": len(mods), "runs": [str(d) for d in run_dirs]},
    )


def _run(
    seed: int = 0,
    out=None,
    m: int = 64,
    n: int = 48,
    rank: int = 4,
    clients=(2, 4, 8),
    oversketch=None,
    shared_a=(True, False),
    runs=None,
    figure: bool = True,
) -> dict:
    """The exactness analysis. ``clients``: the K grid; ``oversketch``: FedASK's p grid
    (default 0..(max K − 1)·r + 2); ``shared_a``: which client settings to draw.
    ``runs``: run directories used as the clients instead. Returns the JSON document
    and writes exactness.{json,png,svg} to ``out`` when given."""
    if min(m, n, rank) <= 0 or not clients or min(clients) < 1:
        raise UsageError("m, n, rank and every K must be positive")
    if oversketch is None:
        top = (max(clients) - 1) * rank + 2
        oversketch = sorted({0, 1, 2, rank, *range(0, top + 1, rank), top, top - 2})
        oversketch = [p for p in oversketch if p >= 0]
    if runs:
        rows = run_rows(runs, oversketch, seed)
    else:
        rows = synthetic_rows(m, n, rank, list(clients), list(oversketch), list(shared_a), seed)
    doc = {
        "analysis": NAME,
        "seed": seed,
        "setting": {
            "m": m,
            "n": n,
            "rank": rank,
            "clients": list(clients),
            "oversketch": list(oversketch),
            "runs": bool(runs),
        },
        "rows": rows,
    }
    doc = figures.jsonable(doc)
    validate(doc)
    if out is not None:
        figures.write_json(doc, out, NAME)
        if figure:
            plot(doc, out)
    return doc


_FLOOR = 1e-17  # errors of exact methods are ~1e-16: drawn at a floor on the log axis


def plot(doc, out):
    rows = doc["rows"]
    fig, (ax1, ax2) = figures.subplots(ncols=2, width=3.8)
    Ks = sorted({r["clients"] for r in rows})
    Kp = max(Ks)
    for shared, ls in ((True, "-"), (False, "--")):
        for full, mk in ((False, "o"), (True, "s")):
            pts = [
                r
                for r in rows
                if r["method"] == "fedask"
                and r["clients"] == Kp
                and r["shared_a"] == shared
                and (r["output_rank"] > r["rank"]) == full
            ]
            if full:
                pts += [
                    r
                    for r in rows
                    if r["method"] == "fedask"
                    and r["clients"] == Kp
                    and r["shared_a"] == shared
                    and r["oversketch"] == 0
                ]
            pts.sort(key=lambda r: r["oversketch"])
            if not pts:
                continue
            ax1.plot(
                [r["oversketch"] for r in pts],
                [max(r["relative_error"] or 0.0, _FLOOR) for r in pts],
                ls,
                marker=mk,
                ms=3,
                label=f"FedASK, {'shared A' if shared else 'independent A_k'}, "
                f"output rank {'r+p' if full else 'r'}",
            )
        if not shared and any(r["shared_a"] is False for r in rows):
            r0 = next(r for r in rows if r["clients"] == Kp)
            ax1.axvline(
                (Kp - 1) * r0["rank"],
                color="gray",
                lw=0.8,
                ls=":",
                label=f"theory: exact for p ≥ (K−1)r = {(Kp - 1) * r0['rank']}",
            )
    ax1.set_yscale("log")
    ax1.set_xlabel(f"oversketch p (sketch width r + p), K = {Kp}")
    ax1.set_ylabel("relative aggregation error (dimensionless)")
    ax1.set_title("FedASK: error vs sketch width")
    ax1.legend(fontsize=6)
    series = {}
    for r in rows:
        if r["method"] == "fedask" and r["oversketch"] != max(
            x["oversketch"] for x in rows if x["method"] == "fedask"
        ):
            continue
        lab = r["method"] + (
            ""
            if r["output_rank"] is None
            else (" (rank r)" if r["output_rank"] == r["rank"] else " (full rank)")
        )
        if r["method"] in ("fedavg", "ffa", "hetlora", "flora"):
            lab = r["method"]
        lab += ", shared A" if r["shared_a"] else ", indep. A_k"
        series.setdefault(lab, []).append((r["clients"], max(r["relative_error"] or 0.0, _FLOOR)))
    for lab, pts in sorted(series.items()):
        pts.sort()
        ax2.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            ms=3,
            lw=1,
            ls="-" if "shared" in lab else "--",
            label=lab,
        )
    ax2.set_yscale("log")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("number of clients K")
    ax2.set_ylabel("relative aggregation error (dimensionless)")
    ax2.set_title(f"all methods (values ≤ {_FLOOR:g} are exact)")
    ax2.legend(fontsize=5, ncol=2)
    return figures.save_figure(fig, out, NAME)


def table(doc):
    Kp = max(r["clients"] for r in doc["rows"])
    pick = [r for r in doc["rows"] if r["clients"] == Kp]
    return figures.format_table(
        pick,
        ["method", "clients", "rank", "oversketch", "output_rank", "shared_a", "relative_error"],
        max_rows=60,
    )


def run(seed: int = 0, out=None, **kwargs) -> dict:
    """Run the analysis (see :func:`_run` for the keyword arguments) on one torch thread."""
    with figures.single_thread():
        return _run(seed=seed, out=out, **kwargs)


run.__doc__ = _run.__doc__
