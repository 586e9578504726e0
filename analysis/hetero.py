"""Initialization and aggregation noise per round of the heterogeneous-rank methods
(FLoRA, FlexLoRA, HETLoRA, Fed-PLoRA), from a fast synthetic federated simulation
built on the pure functions of ``fl.linalg``, or from runs' metrics.jsonl.

Noise definitions (ARCHITECTURE.md, ``fl.noise``), on the effective update ΔW:
* init_noise: mean over the round's clients of ‖W_client_start − W_global‖_F;
* agg_noise: ‖ΔW_server − Σ_k p_k ΔW_k‖_F (the server's new global update minus the
  exact data-weighted average of the clients' trained updates).

Simulation. Client k holds inputs X_k (n×N_k, N(0,1)) and targets Y_k = W_k* X_k with
W_k* = W0 + L + E_k (L a shared rank-R_true matrix, E_k a client-specific rank-2
matrix): loss_k = ½‖(W0 + ΔW)X_k − Y_k‖_F² / N_k, ΔW = B A. A client trains its
rank-r_k factors with ``steps`` full-batch gradient steps (∂B = G Aᵀ, ∂A = Bᵀ G,
G = ((W0+ΔW)X_k − Y_k)X_kᵀ/N_k), weights p_k = N_k/ΣN. Global rank R = max r_k.
Round 0 starts every method from ΔW = 0 with A random, B = 0.

* flora: clients start at the merged global model with fresh factors (B = 0, A
  random, rank r_k): init 0; the server stacks (exact) and merges: agg 0.
* flexlora: client gets the top-r_k SVD factors of the global update (init noise =
  the Eckart–Young tail sqrt(Σ_{j>r_k} σ_j²), drawn as the closed form); server:
  exact average then rank-R truncated SVD.
* hetlora: client gets the first r_k columns/rows of the global factors; server
  zero-pads and averages B and A with the norm weights.
* plora: rank-R global as R rank-1 modules; each client trains r_k of them (a
  seeded random choice each round) and folds the rest into its frozen base (start =
  global: init 0); the server averages each module over the clients that trained it.
"""

from __future__ import annotations

import math

import torch

from analysis import figures
from analysis import runs as runs_mod
from analysis.schemas import validate
from fl import linalg
from fl.errors import UsageError

NAME = "hetero"
METHODS = ("flora", "flexlora", "hetlora", "plora")

__all__ = ["run", "simulate", "run_rows", "table"]


class _Problem:
    def __init__(self, m, n, ranks, samples, seed, true_rank=4):
        g = torch.Generator().manual_seed(int(seed))
        K = len(ranks)
        self.m, self.n, self.ranks = m, n, list(ranks)
        self.W0 = torch.randn(m, n, generator=g, dtype=torch.float64) / math.sqrt(n)
        L = (
            (
                torch.randn(m, true_rank, generator=g, dtype=torch.float64)
                @ torch.randn(true_rank, n, generator=g, dtype=torch.float64)
            )
            / math.sqrt(m * n)
            * 2
        )
        self.Xs, self.Ys, sizes = [], [], []
        for k in range(K):
            Nk = int(samples * (1 + k) / K) + 8
            E = (
                torch.randn(m, 2, generator=g, dtype=torch.float64)
                @ torch.randn(2, n, generator=g, dtype=torch.float64)
            ) / math.sqrt(m * n)
            X = torch.randn(n, Nk, generator=g, dtype=torch.float64)
            self.Xs.append(X)
            self.Ys.append((self.W0 + L + E) @ X)
            sizes.append(Nk)
        self.p = [s / sum(sizes) for s in sizes]
        self.gen = g

    def grad(self, k, dW):
        X = self.Xs[k]
        return ((self.W0 + dW) @ X - self.Ys[k]) @ X.mT / X.shape[1]

    def loss(self, k, dW):
        X = self.Xs[k]
        return 0.5 * float(torch.sum(((self.W0 + dW) @ X - self.Ys[k]) ** 2)) / X.shape[1]

    def train(self, k, B, A, base, steps, lr, B_only=False):
        """GD on (B, A) with the fixed base update ``base`` (m×n) folded into W0."""
        B, A = B.clone(), A.clone()
        for _ in range(steps):
            G = self.grad(k, base + B @ A)
            gB, gA = G @ A.mT, B.mT @ G
            B = B - lr * gB
            if not B_only:
                A = A - lr * gA
        return B, A


def _fro(M):
    return float(torch.linalg.matrix_norm(M))


def simulate(
    method: str, m=32, n=32, ranks=(2, 4, 6, 8), rounds=8, steps=10, lr=0.1, samples=64, seed=0
) -> list[dict]:
    """One synthetic run of ``method``; returns one row per round
    {method, round, init_noise, agg_noise, init_noise_closed_form, agg_noise_closed_form, loss}."""
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    P = _Problem(m, n, ranks, samples, seed)
    R = max(ranks)
    K = len(ranks)
    g = torch.Generator().manual_seed(int(seed) + 17)
    A0 = torch.randn(R, n, generator=g, dtype=torch.float64) / math.sqrt(n)
    Bg, Ag = torch.zeros(m, R, dtype=torch.float64), A0
    merged = torch.zeros(m, n, dtype=torch.float64)  # FLoRA's merged-into-base update
    rows = []
    for rnd in range(rounds):
        Wg = merged + Bg @ Ag  # the global update
        loss = sum(p * P.loss(k, Wg) for k, p in enumerate(P.p))
        starts, finals, init_cf = [], [], []
        client_mods = []
        for k, r in enumerate(ranks):
            if method == "flora":
                A = torch.randn(r, n, generator=g, dtype=torch.float64) / math.sqrt(n)
                B = torch.zeros(m, r, dtype=torch.float64)
                base = merged
                init_cf.append(0.0)
            elif method == "flexlora":
                if rnd == 0:  # zero update: take the first r rows of the initial A
                    B, A = linalg.hetlora_truncate(Bg, Ag, r)
                    init_cf.append(0.0)
                else:
                    B, A = linalg.flexlora_redistribute(Bg, Ag, r)
                    s = torch.linalg.svdvals(Bg @ Ag)
                    init_cf.append(math.sqrt(float(torch.sum(s[r:] ** 2))))
                base = torch.zeros_like(merged)
            elif method == "hetlora":
                B, A = linalg.hetlora_truncate(Bg, Ag, r)
                base = torch.zeros_like(merged)
                init_cf.append(_fro(Bg[:, r:] @ Ag[r:, :]))
            else:  # plora
                idx = torch.randperm(R, generator=g)[:r].sort().values.tolist()
                (Bd, Ad), B, A = linalg.fold_modules(Bg, Ag, idx)
                base = Bd @ Ad
                init_cf.append(0.0)
            start = base + B @ A
            starts.append(start)
            Bt, At = P.train(k, B, A, base, steps, lr)
            finals.append(base + Bt @ At)
            if method == "plora":
                client_mods.append((idx, Bt, At))
            else:
                client_mods.append((Bt, At))
        init_noise = sum(_fro(s - Wg) for s in starts) / K
        ideal = sum(p * f for p, f in zip(P.p, finals))
        if method == "flora":
            Bs = [b for b, _ in client_mods]
            As = [a for _, a in client_mods]
            Bst, Ast = linalg.flora_stack(Bs, As, P.p)
            merged = merged + Bst @ Ast  # merge into the base, re-init next round
            Bg = torch.zeros(m, R, dtype=torch.float64)
            new = merged
        elif method == "flexlora":
            Bg, Ag = linalg.flexlora_aggregate(
                [b for b, _ in client_mods], [a for _, a in client_mods], P.p, R
            )
            new = Bg @ Ag
        elif method == "hetlora":
            Bg, Ag = linalg.hetlora_aggregate(
                [b for b, _ in client_mods], [a for _, a in client_mods], R, P.p
            )
            new = Bg @ Ag
        else:
            Bg, Ag = linalg.plora_aggregate(Bg, Ag, client_mods, P.p)
            new = Bg @ Ag
        agg = _fro(new - ideal)
        rows.append(
            {
                "method": method,
                "round": rnd,
                "init_noise": init_noise,
                "agg_noise": agg,
                "init_noise_closed_form": sum(init_cf) / K,
                "agg_noise_closed_form": 0.0 if method == "flora" else None,
                "relative_agg_noise": agg / _fro(ideal) if _fro(ideal) > 0 else None,
                "loss": loss,
                "source": "synthetic",
            }
        )
    return rows


def run_rows(run_dirs) -> list[dict]:
    """Rows from runs' metrics.jsonl (init_noise / agg_noise per round; null if absent)."""
    rows = []
    for d in run_dirs:
        man = runs_mod.read_manifest(d)
        method = man.get("method") or man.get("config", {}).get("method", "?")
        metrics = runs_mod.read_metrics(d)
        if not metrics:
            raise UsageError(f"{d}: no metrics.jsonl rows")
        for i, row in enumerate(metrics):
            rows.append(
                {
                    "method": str(method),
                    "round": int(row.get("round", i)),
                    "init_noise": _num(row.get("init_noise")),
                    "agg_noise": _num(row.get("agg_noise")),
                    "loss": _num(row.get("loss", row.get("train_loss"))),
                    "source": str(d),
                }
            )
    return rows


def _num(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _run(
    seed: int = 0,
    out=None,
    methods=METHODS,
    m: int = 32,
    n: int = 32,
    ranks=(2, 4, 6, 8),
    rounds: int = 8,
    steps: int = 10,
    lr: float = 0.1,
    samples: int = 64,
    runs=None,
    figure: bool = True,
) -> dict:
    """The hetero analysis (synthetic simulation, or ``runs``' metrics). Returns the
    JSON document; writes hetero.{json,png,svg} to ``out`` when given."""
    if runs:
        rows = run_rows(runs)
    else:
        bad = [x for x in methods if x not in METHODS]
        if bad:
            raise UsageError(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
        if not ranks or min(ranks) <= 0 or max(ranks) > min(m, n) or rounds < 1:
            raise UsageError("need ranks in 1..min(m, n) and rounds >= 1")
        rows = []
        for meth in methods:
            rows += simulate(meth, m, n, ranks, rounds, steps, lr, samples, seed)
    doc = {
        "analysis": NAME,
        "seed": seed,
        "setting": {
            "m": m,
            "n": n,
            "ranks": list(ranks),
            "rounds": rounds,
            "steps": steps,
            "lr": lr,
            "samples": samples,
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


_FLOOR = 1e-17


def plot(doc, out):
    rows = doc["rows"]
    fig, axes = figures.subplots(ncols=2)
    for ax, key in zip(axes, ("init_noise", "agg_noise")):
        for i, meth in enumerate(dict.fromkeys(r["method"] for r in rows)):
            pts = [r for r in rows if r["method"] == meth and r[key] is not None]
            c = f"C{i}"
            ax.plot(
                [r["round"] for r in pts],
                [max(r[key], _FLOOR) for r in pts],
                "o",
                ms=3,
                color=c,
                label=f"{meth} (measured)",
            )
            cf = [r for r in pts if r.get(f"{key}_closed_form") is not None]
            if cf:
                ax.plot(
                    [r["round"] for r in cf],
                    [max(r[f"{key}_closed_form"], _FLOOR) for r in cf],
                    "-",
                    lw=1,
                    color=c,
                    label=f"{meth} (closed form)",
                )
        ax.set_yscale("log")
        ax.set_xlabel("round")
        what = "initialization" if key == "init_noise" else "aggregation"
        ax.set_ylabel(f"{what} noise ‖·‖_F (weight units)")
        ax.set_title(f"{what} noise (≤{_FLOOR:g}: exact zero)")
        ax.legend(fontsize=6)
    return figures.save_figure(fig, out, NAME)


def table(doc):
    rows = doc["rows"]
    last = {}
    for r in rows:
        last[r["method"]] = r
    summary = []
    for meth in last:
        pts = [r for r in rows if r["method"] == meth]
        inits = [r["init_noise"] for r in pts if r["init_noise"] is not None]
        aggs = [r["agg_noise"] for r in pts if r["agg_noise"] is not None]
        summary.append(
            {
                "method": meth,
                "rounds": len(pts),
                "mean_init_noise": sum(inits) / len(inits) if inits else None,
                "mean_agg_noise": sum(aggs) / len(aggs) if aggs else None,
                "last_loss": last[meth].get("loss"),
            }
        )
    return figures.format_table(
        summary, ["method", "rounds", "mean_init_noise", "mean_agg_noise", "last_loss"]
    )


def run(seed: int = 0, out=None, **kwargs) -> dict:
    """Run the analysis (see :func:`_run` for the keyword arguments) on one torch thread."""
    with figures.single_thread():
        return _run(seed=seed, out=out, **kwargs)


run.__doc__ = _run.__doc__
