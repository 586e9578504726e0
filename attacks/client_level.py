"""Client-level membership inference: given a candidate client's data, did that client take
part in training?

Design (a run directory; the client shards are in its ``splits.json``):

- Participating clients: the run's client shards (every client of the federation is IN,
  whether or not it was sampled in a round — client-level DP protects exactly the
  presence of a client's data set, sampled or not). Ids that are not candidates (audit
  canaries, see :func:`attacks.rundata.load_run`) are dropped from a shard.
- Non-participating clients: *twins*, drawn without replacement from the run's non-member
  pool — for each participating client (in a seeded random order) one twin with the same
  number of examples of each label, as long as the pool can supply it. Twins thus have the
  participants' size distribution and label skew (a non-IID partition's skew would
  otherwise separate the two groups by itself); for a causal-LM run (one label) they
  match sizes only. With as many non-members as members every client gets its twin (half
  of the candidates participated).
- Score of a client: the **mean** of an example-level attack's scores (higher = member)
  over the client's examples; every example-level attack gives one client-level result
  of the same name. The mean is size-free, so clients of different sizes are comparable.
- Metrics: ROC over the candidate clients (AUC, TPR at 1% / 0.1% FPR, bootstrap 95%
  intervals resampling clients), and a threshold calibrated on non-participating clients:
  a seeded half of the twins sets τ, the (1 − fpr) empirical quantile of their scores
  (a client is called a participant when its score is > τ); TPR and FPR at τ are measured
  on the participants and the other half of the twins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attacks.metrics import roc_metrics
from fl.errors import UsageError

THREAT_MODEL = (
    "the candidate client's whole data set; the example-level attack's access to the "
    "released adapter; same-distribution clients known not to have participated, to "
    "calibrate the threshold"
)


@dataclass(frozen=True, eq=False)
class ClientPopulation:
    """Candidate clients over the n evaluation points of an example-level attack."""

    names: tuple[str, ...]  # (G,) the run's client id, or "twin:<client>" for a twin
    groups: tuple[np.ndarray, ...]  # (G,) evaluation-point indices of each client
    participated: np.ndarray  # (G,) bool

    def __post_init__(self):
        if not (len(self.names) == len(self.groups) == len(self.participated)):
            raise ValueError("names, groups and participated need one entry per client")
        if any(len(g) == 0 for g in self.groups):
            raise ValueError("every candidate client needs at least one example")
        flat = np.concatenate(self.groups) if self.groups else np.zeros(0, np.int64)
        if len(np.unique(flat)) != len(flat):
            raise ValueError("candidate clients must not share examples")


def twin_clients(
    shard_labels: list[np.ndarray], pool_labels: np.ndarray, seed: int
) -> list[tuple[int, np.ndarray]]:
    """Non-participating twins of participating clients, drawn from a pool.

    Args:
        shard_labels: the labels of each participating client's examples.
        pool_labels: (m,) labels of the non-member pool.
        seed: the order in which clients get twins, and which pool examples.
    Returns: [(participating client index, pool indices of its twin)], a twin having
        exactly the client's count of each label; clients the remaining pool cannot
        match get none.
    """
    rng = np.random.default_rng([seed, 0xC7]).spawn(2)
    pool = np.asarray(pool_labels, dtype=np.int64)
    free = {int(c): list(rng[0].permutation(np.flatnonzero(pool == c))) for c in np.unique(pool)}
    out = []
    for j in rng[1].permutation(len(shard_labels)):
        need = np.unique(np.asarray(shard_labels[j], np.int64), return_counts=True)
        if any(len(free.get(int(c), [])) < k for c, k in zip(*need)):
            continue
        twin = [free[int(c)].pop() for c, k in zip(*need) for _ in range(k)]
        out.append((int(j), np.sort(np.asarray(twin, dtype=np.int64))))
    return out


def population(
    eval_ids, labels, is_member, clients: dict[str, list[str]], seed: int
) -> ClientPopulation:
    """Participating clients (the run's shards) and their twins (non-members).

    Args:
        eval_ids: (n,) ids of the evaluation points; labels (n,); is_member (n,) bool.
        clients: client id → the ids of its examples (``splits.json``'s ``clients``).
    """
    labels = np.asarray(labels, dtype=np.int64)
    is_member = np.asarray(is_member, dtype=bool)
    pos = {str(i): k for k, i in enumerate(eval_ids)}
    names, shards = [], []
    for cid, ids in clients.items():
        idx = np.asarray(sorted(pos[i] for i in ids if i in pos), dtype=np.int64)
        if len(idx) and not is_member[idx].all():
            raise UsageError(f"client {cid!r} has examples that are not members of the run")
        if len(idx):
            names.append(str(cid))
            shards.append(idx)
    if not shards:
        raise UsageError("the run has no client shard with candidate examples")
    non = np.flatnonzero(~is_member)
    twins = twin_clients([labels[s] for s in shards], labels[non], seed)
    if not twins:
        raise UsageError(
            f"the {len(non)} non-members cannot form a twin of any client (smallest client: "
            f"{min(len(s) for s in shards)} examples); train with more --nonmembers"
        )
    names += [f"twin:{names[j]}" for j, _ in twins]
    groups = shards + [non[t] for _, t in twins]
    part = np.r_[np.ones(len(shards), bool), np.zeros(len(twins), bool)]
    return ClientPopulation(tuple(names), tuple(groups), part)


def aggregate(scores, groups) -> np.ndarray:
    """(G,) mean of the example scores (n,) over each group's indices."""
    s = np.asarray(scores, dtype=np.float64)
    if not np.isfinite(s).all():
        raise ValueError("example scores must be finite")
    which = np.concatenate([np.full(len(g), j) for j, g in enumerate(groups)])
    idx = np.concatenate(groups)
    return np.bincount(which, s[idx], len(groups)) / np.bincount(which, minlength=len(groups))


def calibrated_threshold(nonparticipant_scores, fpr: float) -> float:
    """τ with at most a fraction ``fpr`` of the given scores > τ: the ⌈(1 − fpr)·N⌉-th
    smallest score (the largest when fpr·N < 1)."""
    s = np.sort(np.asarray(nonparticipant_scores, dtype=np.float64))
    if len(s) == 0:
        raise ValueError("no non-participating client to calibrate on")
    if not 0.0 <= fpr < 1.0:
        raise ValueError(f"fpr must be in [0, 1), got {fpr}")
    j = max(1, math.ceil((1.0 - fpr) * len(s) - 1e-9))
    return float(s[j - 1])


def operating_point(client_scores, participated, fpr: float, seed: int) -> dict:
    """The calibrated rule: τ from a seeded half of the non-participants; TPR on the
    participants and FPR on the other half of the non-participants."""
    c = np.asarray(client_scores, dtype=np.float64)
    part = np.asarray(participated, dtype=bool)
    non = np.random.default_rng([seed, 0xCA1]).permutation(np.flatnonzero(~part))
    cal, held = non[: len(non) // 2], non[len(non) // 2 :]
    if len(cal) == 0:
        return {"target_fpr": fpr, "threshold": None, "note": "fewer than 2 non-participants"}
    tau = calibrated_threshold(c[cal], fpr)
    return {
        "target_fpr": fpr,
        "threshold": tau,
        "n_calibration": int(len(cal)),
        "tpr": float((c[part] > tau).mean()),
        "fpr_held_out": float((c[held] > tau).mean()),
        "n_held_out": int(len(held)),
    }


def client_level(
    example_scores: dict[str, np.ndarray],
    pop: ClientPopulation,
    fpr: float = 0.05,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> tuple[dict, dict]:
    """Client-level results of every example-level attack: ({name: roc_metrics +
    calibrated operating point}, {name: (G,) client scores})."""
    results, scores = {}, {}
    for name, s in example_scores.items():
        c = aggregate(s, pop.groups)
        r = roc_metrics(c, pop.participated, n_bootstrap=n_bootstrap, seed=seed)
        r["calibrated"] = operating_point(c, pop.participated, fpr, seed)
        r["threat_model"] = THREAT_MODEL
        results[name], scores[name] = r, c
    return results, scores


def plot_histograms(scores: dict[str, np.ndarray], participated, path_stem) -> Path | None:
    """Per-client score histograms, participating vs not, one panel per attack (PNG + SVG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not scores:
        return None
    part = np.asarray(participated, dtype=bool)
    cols = min(3, len(scores))
    rows = math.ceil(len(scores) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows))
    FigureCanvasAgg(fig)
    for k, (name, c) in enumerate(scores.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        bins = np.histogram_bin_edges(c, bins=20)
        ax.hist(c[part], bins=bins, alpha=0.6, label=f"participated ({part.sum()})")
        ax.hist(c[~part], bins=bins, alpha=0.6, label=f"did not ({(~part).sum()})")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("client score (mean of example scores)", fontsize=8)
        ax.set_ylabel("clients", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    png = stem.with_name(stem.name + ".png")
    fig.savefig(png, dpi=130)
    fig.savefig(stem.with_name(stem.name + ".svg"))
    return png


def write_client_level(target, example_scores: dict, config, out: Path) -> dict:
    """The client-level attack of a target run (its example-level ``example_scores`` over
    ``target.eval_idx``): writes clients.json, client_scores.npz, roc_clients.png/svg and
    client_hist.png/svg to ``out``; returns clients.json's document."""
    from attacks.metrics import plot_roc
    from fl.io import atomic_write_json

    if not target.clients:
        raise UsageError(
            "--client-level needs a run directory: the client shards are in its splits.json"
        )
    ev = target.eval_idx
    pop = population(
        [target.ids[i] for i in ev],
        target.labels[ev],
        target.is_member,
        target.clients,
        config.seed,
    )
    results, cscores = client_level(
        example_scores, pop, config.client_fpr, config.bootstrap, config.seed
    )
    np.savez(
        out / "client_scores.npz",
        clients=np.asarray(pop.names),
        participated=pop.participated,
        sizes=np.asarray([len(g) for g in pop.groups]),
        **cscores,
    )
    plot_roc(results, out / "roc_clients", title="Client-level membership inference ROC")
    plot_histograms(cscores, pop.participated, out / "client_hist")
    sizes = np.asarray([len(g) for g in pop.groups])
    doc = {
        "schema_version": 1,
        "target": target.document(),
        "design": (
            "participating = the run's client shards; non-participating = twins drawn from "
            "the run's non-members with each participant's label histogram (seeded); client "
            "score = mean of the example-level scores over the client's examples; τ from half "
            "of the twins"
        ),
        "aggregate": "mean",
        "n_participating": int(pop.participated.sum()),
        "n_nonparticipating": int((~pop.participated).sum()),
        "client_size": {
            "min": int(sizes.min()),
            "mean": float(sizes.mean()),
            "max": int(sizes.max()),
        },
        "seed": config.seed,
        "attacks": results,
    }
    atomic_write_json(out / "clients.json", doc)
    return doc
