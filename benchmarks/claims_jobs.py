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

#: chosen by claims-tune (highest val_balanced_accuracy); see benchmarks/results/claims/
CLAIMS_LR: dict[str, float] = {}


def _privacy(eps) -> dict:
    return {"dp_level": "none"} if eps is None else {"dp_level": "sample", "epsilon": eps}


def _tag(eps) -> str:
    return "nodp" if eps is None else f"eps{eps:g}"


def _lr(name: str) -> dict:
    if name not in CLAIMS_LR:
        raise KeyError(
            f"no learning rate chosen for {name!r}: run the claims-tune grid first and "
            "record its choice in benchmarks.claims_jobs.CLAIMS_LR"
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
    out = []
    for seed in seeds:
        for eps in (8.0, 3.0, 1.0, None):
            for name, over in FEDASK_VARIANTS.items():
                if eps is None and name == "probe":
                    continue
                cfg = {**CLAIMS, **over, **_lr(name), **(overrides or {})}
                cfg.update(seed=seed, **_privacy(eps))
                out.append({"grid": "claims-fedask", "group": f"{name}/{_tag(eps)}", "cfg": cfg})
    return out


GRIDS = {"claims-tune": jobs_tune, "claims-fedask": jobs_fedask}
