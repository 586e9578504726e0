"""Initialization and aggregation noise per round of the heterogeneous-rank methods
(FLoRA, FlexLoRA, HETLoRA, Fed-PLoRA), from a fast synthetic federated simulation
built on the pure functions of ``fl.linalg``, or from runs' metrics.jsonl.

Noise definitions (ARCHITECTURE.md, ``fl.linalg.noise``), on the effective update ΔW:
* init_noise: mean over the round's clients of ‖W_client_start − W_global‖_F;
* agg_noise: ‖ΔW_server − Σ_k p_k ΔW_k‖_F (the server's new global update minus the
  exact data-weighted average of the clients' trained updates).

Simulation. Client k holds inputs X_k (n×N_k, N(0,1)) and targets Y_k = W_k* X_k with
W_k* = W0 + L + E_k (L a shared rank-R_true matrix, E_k a client-specific rank-2
matrix): loss_k = ½‖(W0 + ΔW)X_k − Y_k‖_F² / N_k, ΔW = B A. A client trains its
rank-r_k factors with ``steps`` full-batch gradient steps (∂B = G Aᵀ, ∂A = Bᵀ G,
G = ((W0+ΔW)X_k − Y_k)X_kᵀ/N_k), weights p_k = N_k/ΣN. Global rank R = max r_k.
Round 0 starts every method from ΔW = 0 with A random, B = 0. The LoRA scale is 1.

Every client start and server step is the method's own pure function (one
implementation; tests/fl/test_method_math.py ties this simulation to the methods):

* flora: clients start at the merged global model with fresh factors (B = 0, A
  random, rank r_k): init 0; the server stacks (exact) and merges
  (``fl.methods.flora.server_layer``): agg 0.
* flexlora: client gets the top-r_k SVD factors of the exact global update G
  (``fl.methods.flexlora.client_start_factors``: a rank with σ_j(G) = 0, e.g. every
  rank in round 0, gets B = 0 and the initial A row): init noise = the Eckart–Young
  tail sqrt(Σ_{j>r_k} σ_j(G)²), drawn as the closed form. The server keeps the exact
  average G (``server_layer``; no rank-R truncation — only the released adapter is
  truncated): agg 0.
* hetlora: client gets the first r_k columns/rows of the global factors; the server
  zero-pads and averages B and A with the norm weights ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F
  (norms only, as the method trains; ``fl.methods.hetlora.server_layer``).
* plora: rank-R global as R rank-1 modules; each client trains r_k of them (the
  method's ``select_random`` policy, seeded per round and client) and folds the rest
  into its frozen base (start = global: init 0); the server averages each module over
  the clients that trained it (``fl.methods.plora.server_layer``).
"""

from __future__ import annotations

import math

import torch

from analysis import figures
from analysis import runs as runs_mod
from analysis.schemas import validate
from fl import linalg
from fl.errors import UsageError
from fl.methods import flexlora as flexlora_m
from fl.methods import flora as flora_m
from fl.methods import hetlora as hetlora_m
from fl.methods import plora as plora_m
from fl.privacy.rng import derive_seed

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


def _split(mods):
    return [b for b, _ in mods], [a for _, a in mods]


def _global_update(method: str, state: dict) -> torch.Tensor:
    """The global update ΔW (m×n) of a simulation state."""
    if method == "flora":
        if state["merged"] is None:
            return torch.zeros(state["Bg"].shape[0], state["Ag"].shape[1], dtype=state["Bg"].dtype)
        return state["merged"][0] @ state["merged"][1]
    return state["Bg"] @ state["Ag"]


def _client_start(method: str, state: dict, r: int, select_seed: int, g, rnd: int, k: int):
    """Client k's start: (base (m×n), B (m×r), A (r×n), idx or None, init closed form),
    by the method's own client-start function."""
    Bg, Ag = state["Bg"], state["Ag"]
    m, n = Bg.shape[0], Ag.shape[1]
    base = torch.zeros(m, n, dtype=Bg.dtype)
    idx = None
    if method == "flora":  # fresh LoRA on the merged base
        A = torch.randn(r, n, generator=g, dtype=torch.float64) / math.sqrt(n)
        B = torch.zeros(m, r, dtype=torch.float64)
        return _global_update(method, state), B, A, None, 0.0
    if method == "flexlora":
        B, A = flexlora_m.client_start_factors(Bg, Ag, r, r, state["A0"])
        s = linalg.factored_svd([Bg], [Ag], None)[1]
        return base, B, A, None, math.sqrt(float(torch.sum(s[r:] ** 2)))
    if method == "hetlora":
        B, A = linalg.hetlora_truncate(Bg, Ag, r)
        return base, B, A, None, _fro(Bg[:, r:] @ Ag[r:, :])
    R = Bg.shape[1]
    idx = plora_m.select_random(R, r, select_seed, rnd, str(k))
    (Bd, Ad), B, A = plora_m.client_split(Bg, Ag, idx)
    return Bd @ Ad, B, A, idx, 0.0


def _server_step(method: str, state: dict, client_mods: list, p: list[float], R: int) -> dict:
    """The server step of ``method`` (its own ``server_layer``) on the clients' trained
    factors ``client_mods`` ((B, A), or (idx, B, A) for plora); returns the new state."""
    state = dict(state)
    if method == "flora":
        state["merged"], _ = flora_m.server_layer(state["merged"], *_split(client_mods), p, 1.0)
    elif method == "flexlora":
        state["Bg"], state["Ag"] = flexlora_m.server_layer(*_split(client_mods), p)
    elif method == "hetlora":
        state["Bg"], state["Ag"] = hetlora_m.server_layer(*_split(client_mods), R)
    else:
        state["Bg"], state["Ag"] = plora_m.server_layer(state["Bg"], state["Ag"], client_mods, p)
    return state


def simulate(
    method: str, m=32, n=32, ranks=(2, 4, 6, 8), rounds=8, steps=10, lr=0.1, samples=64, seed=0
) -> list[dict]:
    """One synthetic run of ``method``; returns one row per round
    {method, round, init_noise, agg_noise, init_noise_closed_form, agg_noise_closed_form, loss}.

    Every client start and server step is the method's own pure function
    (``fl.methods.<method>``: ``server_layer``, ``client_start_factors``, ``client_split``,
    ``select_random``), so the figure describes the method as trained
    (tests/fl/test_method_math.py ties the two)."""
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    P = _Problem(m, n, ranks, samples, seed)
    R = max(ranks)
    K = len(ranks)
    g = torch.Generator().manual_seed(int(seed) + 17)
    A0 = torch.randn(R, n, generator=g, dtype=torch.float64) / math.sqrt(n)
    # The global state. flora: the merged update (B_m, A_m) (None before round 0);
    # flexlora: the exact average G = B_g A_g (round 0: B = 0, A = the initial A, as the
    # method's init_state); hetlora / plora: the rank-R global factors.
    state = {"Bg": torch.zeros(m, R, dtype=torch.float64), "Ag": A0, "A0": A0, "merged": None}
    rows = []
    for rnd in range(rounds):
        Wg = _global_update(method, state)
        loss = sum(p * P.loss(k, Wg) for k, p in enumerate(P.p))
        starts, finals, init_cf = [], [], []
        client_mods = []
        for k, r in enumerate(ranks):
            sel = derive_seed(seed, "hetero", rnd, k)
            base, B, A, idx, cf = _client_start(method, state, r, sel, g, rnd, k)
            init_cf.append(cf)
            starts.append(base + B @ A)
            Bt, At = P.train(k, B, A, base, steps, lr)
            finals.append(base + Bt @ At)
            client_mods.append((idx, Bt, At) if method == "plora" else (Bt, At))
        init_noise = sum(_fro(s - Wg) for s in starts) / K
        ideal = sum(p * f for p, f in zip(P.p, finals))
        state = _server_step(method, state, client_mods, P.p, R)
        new = _global_update(method, state)
        agg = _fro(new - ideal)
        rows.append(
            {
                "method": method,
                "round": rnd,
                "init_noise": init_noise,
                "agg_noise": agg,
                "init_noise_closed_form": sum(init_cf) / K,
                "agg_noise_closed_form": 0.0 if method in ("flora", "flexlora") else None,
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
