"""The grids that decide the seeds' utility claims (issue 18, item 5).

The *claims scale* (``CLAIMS``) is where private runs learn and a run costs about two
minutes on 2 cores: minilm / tweets, 5 000 members over 5 IID clients (1 000 each), mean
pooling and a zero-initialized head, LoRA on the top layer over the cached frozen prefix,
48 tokens, 3 rounds × 20 Poisson batches of 128 (q = 0.128, 60 DP-SGD steps per client),
LoRA lr chosen per method, head lr 3e-2, C = 1, δ = 1e-5; test n = 1 000; 1 000 non-members
score the hyperparameters (``val_*``), never the test set. At ε = 3 FedAvg-LoRA reaches
0.842 / 0.773 here (one seed, 137 s); the label prior is 0.70 / 0.50.

- ``claims-tune``: the learning rate of each method, at ε = 3 on seed 100 (not an evaluation
  seed), chosen on the non-member pool: ``CLAIMS_LR`` holds the result.
- ``claims-fedask``: FedASK (clip space w and b), FFA-LoRA, FedAvg-LoRA and the DP linear
  probe at ε ∈ {1, 3, 8}, and the non-private runs (probe excepted).
- ``claims-hetero``: Fed-PLoRA, FLoRA, FlexLoRA, HETLoRA (ranks {4, 8, 16}, R = 16) under IID,
  Dirichlet(0.5) and Dirichlet(0.1), non-private and ε = 8.
- ``claims-fedpower``: client-level DP over ``CLAIMS_CLIENTS`` clients (see there).
- ``claims-bbc``: the FedASK and Fed-PLoRA comparisons on bbc (5 classes).

Jobs are listed seed-major so that a worker's consecutive jobs share the members and
reuse the frozen prefix's cache (it lives in the worker's process).
"""

from __future__ import annotations

CLAIMS = dict(
    model="minilm",
    dataset="tweets",
    members=5000,
    nonmembers=1000,
    test=1000,
    clients=5,
    rounds=3,
    local_steps=20,
    batch_size=128,
    max_length=48,
    lora_layers=1,
    lr=1e-3,
    head_lr=3e-2,
    pooling="auto",
    head_init="zero",
    eval_every=3,
    eval_nonmembers=True,
    delta=1e-5,
    clip=1.0,
)

#: the methods compared in claims-fedask: name → config fields
FEDASK_VARIANTS = {
    "fedask-w": dict(method="fedask", opts={"clip_space": "w"}),
    "fedask-b": dict(method="fedask", opts={"clip_space": "b"}),
    "ffa": dict(method="ffa"),
    "fedavg": dict(method="fedavg"),
    "probe": dict(method="probe"),
}

#: learning rates tried by claims-tune (the probe's lr is its head's)
TUNE_LRS = {
    "fedask-w": (1e-3, 3e-3, 1e-2),
    "fedask-b": (1e-3, 3e-3, 1e-2),
    "ffa": (1e-3, 3e-3, 1e-2),
    "fedavg": (1e-3, 3e-3),
    "probe": (3e-2, 1e-1),
}
TUNE_SEED = 100
TUNE_EPSILON = 3.0

#: The learning rate of each method: the highest val_balanced_accuracy (the non-member
#: pool) of claims-tune (ε = 3, seed 100; all 13 runs, benchmarks/results/claims/tune/,
#: completed 2026-12-02). FedASK (w) 3e-3 (0.673; 1e-3 0.663, 1e-2 0.667); FedASK (b) 1e-3
#: (0.777; 0.772, 0.768); FFA-LoRA 3e-3 (0.769; 1e-3 0.763, 1e-2 0.766); FedAvg-LoRA 1e-3
#: (0.764; 3e-3 0.754); the probe 0.1 (0.816; 0.03 0.772). One seed scores each lr (the
#: pool's standard error is about 0.013), so close choices are the rule's, not a finding.
CLAIMS_LR: dict[str, float] = {
    "fedask-w": 3e-3,
    "fedask-b": 1e-3,
    "ffa": 3e-3,
    "fedavg": 1e-3,
    "probe": 0.1,
}


def _privacy(eps) -> dict:
    return {"dp_level": "none"} if eps is None else {"dp_level": "sample", "epsilon": eps}


def _tag(eps) -> str:
    return "nodp" if eps is None else f"eps{eps:g}"


def _lr(name: str) -> dict:
    if name not in CLAIMS_LR:
        raise KeyError(
            f"no learning rate chosen for {name!r}: run the claims-tune grid first and "
            "record its choice in benchmarks.grids.claims.CLAIMS_LR"
        )
    lr = CLAIMS_LR[name]
    return {"lr": lr, "head_lr": 0.0} if name == "probe" else {"lr": lr}


def jobs_tune(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    out = []
    for name, lrs in TUNE_LRS.items():
        for lr in lrs:
            cfg = {**CLAIMS, **FEDASK_VARIANTS[name], **(overrides or {}), "lr": lr}
            if name == "probe":
                cfg["head_lr"] = 0.0
            cfg.update(seed=TUNE_SEED, **_privacy(TUNE_EPSILON))
            out.append({"grid": "claims-tune", "group": f"{name}/lr{lr:g}", "cfg": cfg})
    return out


def best_lrs(rows: list[dict]) -> dict[str, float]:
    """Per method of claims-tune: the lr with the highest val_balanced_accuracy."""
    best: dict[str, tuple[float, float]] = {}
    for r in rows:
        if r.get("grid") != "claims-tune" or r.get("val_balanced_accuracy") is None:
            continue
        name, lr = r["group"].split("/lr")
        score = r["val_balanced_accuracy"]
        if name not in best or score > best[name][0]:
            best[name] = (score, float(lr))
    return {k: v[1] for k, v in best.items()}


def jobs_fedask(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    """ε ∈ {8, 3, 1} for every variant and seed; the non-private ceiling on the first seed."""
    out = []
    for seed in seeds:
        for eps in (8.0, 3.0, 1.0, None):
            for name, over in FEDASK_VARIANTS.items():
                if eps is None and (name == "probe" or seed != seeds[0]):
                    continue
                cfg = {**CLAIMS, **over, **_lr(name), **(overrides or {})}
                cfg.update(seed=seed, **_privacy(eps))
                out.append({"grid": "claims-fedask", "group": f"{name}/{_tag(eps)}", "cfg": cfg})
    return out


#: heterogeneous ranks: R = 16, client ranks {4, 8, 16}; clients of Dirichlet partitions
#: below 100 examples are redrawn (a client of n_k examples gets σ_k for q_k = B / n_k)
HETERO = dict(rank=16, alpha=32.0, client_ranks="4,8,16", min_client_size=100)
HETERO_METHODS = ("plora", "flora", "flexlora", "hetlora")
PARTITIONS = {
    "iid": dict(partition="iid"),
    "dirichlet0.5": dict(partition="dirichlet", dirichlet_alpha=0.5),
    "dirichlet0.1": dict(partition="dirichlet", dirichlet_alpha=0.1),
}


def jobs_hetero(base: dict, seeds, overrides: dict | None = None, scale=None) -> list[dict]:
    """Fed-PLoRA vs FLoRA, FlexLoRA, HETLoRA under IID, Dirichlet(0.5) and (0.1), at ε = 8
    and non-private (the ε = 8 cells first). The LoRA lr is FedAvg-LoRA's."""
    scale = CLAIMS if scale is None else scale
    grid = "claims-hetero" if scale is CLAIMS else "claims-bbc"
    out = []
    for eps in (8.0, None):
        for seed in seeds:
            for part, pcfg in PARTITIONS.items():
                for method in HETERO_METHODS:
                    cfg = {**scale, **HETERO, **pcfg, "method": method, **_lr("fedavg")}
                    cfg.update(**(overrides or {}), seed=seed, **_privacy(eps))
                    group = f"{method}/{part}/{_tag(eps)}"
                    out.append({"grid": grid, "group": group, "cfg": cfg})
    return out


# Client-level DP needs many clients per round: the Gaussian noise on the average has
# norm about σ·C·√d / K for d released coordinates and K clients in a round. 2 000
# clients of 4 examples (8 000 members), Poisson client sampling q = 0.5 (about 1 000
# clients per round, amplification used), 5 rounds of one local SGD step on the client's
# 4 examples; LoRA r = 8 on the top layer (the frozen prefix is cached), zero head.
CLAIMS_CLIENTS = dict(
    CLAIMS,
    members=8000,
    clients=2000,
    min_client_size=4,
    clients_per_round=0.5,
    client_sampling="poisson",
    rounds=5,
    local_steps=1,
    batch_size=4,
    optimizer="sgd",
    lr=2.0,
    head_lr=0.0,
    eval_every=5,
)
#: clip bounds tried by claims-fedpower-tune, at ε = 6 on seed 100 (not an evaluation seed)
TUNE_CLIPS = (0.3, 0.5, 1.0, 1.5, 3.0)
CLIENT_METHODS = ("fedpower", "ffa", "fedavg")
#: the client-level clip bound of each method, chosen on the non-member pool by
#: claims-fedpower-tune (:func:`best_clips`; benchmarks/results/claims/fedpower-tune):
#: val balanced accuracy at C = 0.3 / 0.5 / 1 / 1.5 / 3 was FedPower 0.528 / 0.631 /
#: 0.701 / 0.622 / 0.500, FFA-LoRA 0.525 / 0.603 / 0.674 / 0.710 / 0.654, FedAvg-LoRA
#: 0.536 / 0.611 / 0.671 / 0.712 / 0.500 (one seed). PowerDP's input and output
#: perturbation variants use FedPower's bound.
CLIENT_CLIP = {"fedpower": 1.0, "fedavg": 1.5, "ffa": 1.5}


def jobs_fedpower_tune(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    """The client-level clip bound of each method at ε = 6, seed ``TUNE_SEED``, scored
    on the non-member pool (``val_balanced_accuracy``)."""
    out = []
    for clip in TUNE_CLIPS:
        for method in CLIENT_METHODS:
            cfg = {**CLAIMS_CLIENTS, "method": method, "clip": clip, **(overrides or {})}
            cfg.update(seed=TUNE_SEED, dp_level="client", epsilon=6.0)
            group = f"{method}/clip{clip:g}"
            out.append({"grid": "claims-fedpower-tune", "group": group, "cfg": cfg})
    return out


def best_clips(rows: list[dict]) -> dict[str, float]:
    """Per method of claims-fedpower-tune: the clip bound with the highest
    val_balanced_accuracy (ties: the smaller bound)."""
    best: dict[str, tuple[float, float]] = {}
    for r in rows:
        if r.get("grid") != "claims-fedpower-tune" or r.get("val_balanced_accuracy") is None:
            continue
        name, clip = r["group"].split("/clip")
        key = (r["val_balanced_accuracy"], -float(clip))
        if name not in best or key > best[name]:
            best[name] = key
    return {k: -v[1] for k, v in best.items()}


def jobs_fedpower(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    """Client-level ε ∈ {3, 6, 9}: FedPower (PowerDP), FFA-LoRA and FedAvg-LoRA; input and
    output perturbation at ε = 6."""
    out = []
    for seed in seeds:
        for eps in (6.0, 3.0, 9.0):
            cells = [(m, m, {}) for m in ("fedpower", "ffa", "fedavg")]
            if eps == 6.0:
                cells += [
                    (f"fedpower-{p}", "fedpower", {"opts": {"perturbation": p}})
                    for p in ("input", "output")
                ]
            for name, method, extra in cells:
                cfg = {**CLAIMS_CLIENTS, "method": method, "clip": CLIENT_CLIP[method], **extra}
                cfg.update(**(overrides or {}), seed=seed, dp_level="client", epsilon=eps)
                out.append({"grid": "claims-fedpower", "group": f"{name}/eps{eps:g}", "cfg": cfg})
    return out


#: bbc (2 225 articles, 5 classes): 1 500 members over 5 clients, the first 64 tokens of
#: each article (its headline and opening sentence, which name the topic; 128 tokens
#: would double every step's cost on 2 cores)
BBC = dict(CLAIMS, dataset="bbc", members=1500, nonmembers=300, test=425, max_length=64)


def jobs_bbc(base: dict, seeds, overrides: dict | None = None) -> list[dict]:
    """The FedASK comparison at ε = 8 and the Fed-PLoRA comparison (ε = 8 and non-private)
    on bbc."""
    out = []
    for seed in seeds:
        for name, over in FEDASK_VARIANTS.items():
            cfg = {**BBC, **over, **_lr(name), **(overrides or {}), "seed": seed}
            cfg.update(**_privacy(8.0))
            out.append({"grid": "claims-bbc", "group": f"{name}/eps8", "cfg": cfg})
    return out + jobs_hetero(base, seeds, overrides, scale=BBC)


GRIDS = {
    "claims-tune": jobs_tune,
    "claims-fedask": jobs_fedask,
    "claims-hetero": jobs_hetero,
    "claims-fedpower-tune": jobs_fedpower_tune,
    "claims-fedpower": jobs_fedpower,
    "claims-bbc": jobs_bbc,
}
