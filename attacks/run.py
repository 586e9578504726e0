"""Orchestration: signals of the target and the shadows → every attack → metrics and files.

Outputs (in ``out``, default ``RUN_DIR/attacks/``):
- ``attacks.json``: {"attacks": {name: roc_metrics(...) + threat_model + seconds (scoring)
  [+ shared_shadow_seconds: training + signals of the shadows, shared by the reference-based
  attacks]}, "shadows": {...}, "target": {...}};
- ``scores.npz``: ``ids`` (n,), ``is_member`` (n,) bool and one (n,) float64 array of
  scores per attack (higher = member), over the evaluation points;
- ``roc.png`` / ``roc.svg``: log-log ROC of all attacks;
- ``shadows/`` (shadow runs, reused across calls) and ``cache/`` (signals, npz).

Attack names and the results they produce:
loss → loss; calibration → calibration; shadow → shadow (one attack model per class) and
shadow_single; lira → lira_online and lira_offline; rmia → rmia_online and rmia_offline.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from attacks import calibration, lira, loss, rmia, shadow
from attacks.metrics import plot_roc, roc_metrics
from attacks.signals import Signals, adapter_signals, load_run, read_adapter_config, run_signals
from fl.errors import UsageError

ATTACKS = ("loss", "calibration", "shadow", "lira", "rmia")
NEEDS_SHADOWS = ("calibration", "shadow", "lira", "rmia")
# Carlini et al. recommend a global variance below ~64 shadows; per-example fits need
# several IN and OUT values per example, so switch at 16 (8 IN / 8 OUT).
GLOBAL_VARIANCE_BELOW = 16


def parse_attacks(spec) -> tuple[str, ...]:
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [s for s in names if s]
    bad = [s for s in names if s not in ATTACKS]
    if bad or not names:
        raise UsageError(f"unknown attack(s) {bad or names}; choose from {','.join(ATTACKS)}")
    return tuple(dict.fromkeys(names))


def _stack(sigs: list[Signals], field: str) -> np.ndarray:
    return np.stack([getattr(s, field) for s in sigs])


def _attack_core(
    target: Signals,
    pool_ids: list[str],
    pool_texts: list[str],
    pool_labels: np.ndarray,
    eval_idx: np.ndarray,
    is_member: np.ndarray,
    z_idx: np.ndarray,
    shadow_cfg,
    base_model: str,
    max_length: int,
    num_labels: int,
    attacks,
    shadows: int,
    out: Path,
    device: str,
    seed: int,
    global_variance,
    rmia_a: float,
    rmia_gamma: float,
    progress: bool,
    n_bootstrap: int,
    pool_note: str,
    shadow_dir=None,
) -> dict:
    from attacks.reference import train_shadows

    attacks = parse_attacks(attacks)
    out.mkdir(parents=True, exist_ok=True)
    scores: dict[str, np.ndarray] = {}
    threat: dict[str, str] = {}
    secs: dict[str, float] = {}
    tx = target.subset(eval_idx)

    def timed(name, tm, fn):
        t0 = time.perf_counter()
        scores[name] = np.asarray(fn(), dtype=np.float64)
        secs[name] = time.perf_counter() - t0
        threat[name] = tm

    if "loss" in attacks:
        timed("loss", loss.THREAT_MODEL, lambda: loss.loss_scores(tx.loss))

    shadow_doc = None
    if any(a in NEEDS_SHADOWS for a in attacks):
        if shadows < 2:
            raise UsageError(f"reference-model attacks need --shadows >= 2, got {shadows}")
        sset = train_shadows(
            shadow_cfg,
            pool_ids,
            pool_texts,
            pool_labels,
            shadows,
            Path(shadow_dir) if shadow_dir is not None else out / "shadows",
            seed=seed,
            device=device,
            progress=progress,
            num_labels=num_labels,
        )
        t0 = time.perf_counter()
        ssig = [
            adapter_signals(
                d,
                base_model,
                pool_texts,
                pool_labels,
                max_length,
                device=device,
                seed=int(shadow_cfg.seed),
                num_labels=num_labels,
                cache_dir=out / "cache",
                progress=False,
            )
            for d in sset.adapter_dirs
        ]
        sig_secs = time.perf_counter() - t0
        m_in = sset.in_mask
        trained = [s for s, r in zip(sset.seconds, sset.reused) if not r]
        shadow_doc = {
            "k": shadows,
            "design": (
                "each shadow is a fedlora training run with the target's configuration "
                "(method, federation, steps, DP level and seed) on a "
                "random half of the attacker pool (complementary pairs: every pool example "
                f"is IN half of the shadows); pool = {pool_note}"
            ),
            "pool_size": len(pool_texts),
            "train_seconds_each": sset.seconds,
            "mean_train_seconds": float(np.mean(sset.seconds)),
            "trained_now": len(trained),
            "signal_seconds_total": sig_secs,
            "config": {
                k: sset.config.get(k)
                for k in ("model", "method", "clients", "rounds", "local_steps", "dp_level")
            },
        }
        gv = (shadows < GLOBAL_VARIANCE_BELOW) if global_variance is None else global_variance
        ev_in = m_in[:, eval_idx]
        if "calibration" in attacks:
            timed(
                "calibration",
                calibration.THREAT_MODEL,
                lambda: calibration.calibration_scores(
                    tx.loss, _stack(ssig, "loss")[:, eval_idx], ev_in
                ),
            )
        if "shadow" in attacks:
            sl = _stack(ssig, "logits")
            for name, pc in (("shadow", True), ("shadow_single", False)):
                timed(
                    name,
                    shadow.THREAT_MODEL,
                    lambda pc=pc: shadow.shadow_scores(
                        tx.logits, tx.labels, sl, pool_labels, m_in, per_class=pc, seed=seed
                    ),
                )
        if "lira" in attacks:
            sp = _stack(ssig, "phi")[:, eval_idx]
            note = f" (global variance: {gv})"
            timed(
                "lira_online",
                lira.THREAT_MODEL_ONLINE + note,
                lambda: lira.lira_online(tx.phi, sp, ev_in, global_variance=gv),
            )
            timed(
                "lira_offline",
                lira.THREAT_MODEL_OFFLINE + note,
                lambda: lira.lira_offline(tx.phi, sp, ev_in, global_variance=gv),
            )
        if "rmia" in attacks:
            pp = _stack(ssig, "p_true")
            for name, a in (("rmia_online", None), ("rmia_offline", rmia_a)):
                timed(
                    name,
                    rmia.THREAT_MODEL + (f" (offline a={a})" if a is not None else ""),
                    lambda a=a: rmia.rmia_scores(
                        tx.p_true,
                        pp[:, eval_idx],
                        ev_in,
                        target.p_true[z_idx],
                        pp[:, z_idx],
                        m_in[:, z_idx],
                        gamma=rmia_gamma,
                        offline_a=a,
                    ),
                )

    results = {}
    for name, s in scores.items():
        r = roc_metrics(s, is_member, n_bootstrap=n_bootstrap, seed=seed)
        r["threat_model"] = threat[name]
        r["seconds"] = secs[name]  # scoring only
        if shadow_doc is not None and name != "loss":
            # The shadows' cost, shared by every reference-based attack of this call.
            r["shared_shadow_seconds"] = float(
                np.nansum(shadow_doc["train_seconds_each"]) + shadow_doc["signal_seconds_total"]
            )
        results[name] = r
    ids = np.asarray([pool_ids[i] for i in eval_idx])
    np.savez(
        out / "scores.npz",
        ids=ids,
        is_member=np.asarray(is_member, dtype=bool),
        **{k: v for k, v in scores.items()},
    )
    plot_roc(results, out / "roc")
    return {"attacks": results, "shadows": shadow_doc}


def run_attacks(
    run_dir,
    attacks=ATTACKS,
    shadows: int = 8,
    out=None,
    device: str = "auto",
    seed: int = 0,
    global_variance: bool | None = None,
    rmia_a: float = 0.3,
    rmia_gamma: float = 1.0,
    progress: bool = True,
    n_bootstrap: int = 200,
    shadow_dir=None,
) -> dict:
    """All requested attacks on a run directory's released adapter.

    Evaluation points: the run's members (label 1) and non-members (label 0). Attacker
    pool for shadows: members ∪ non-members ∪ test examples of the run (the test examples
    are the attacker's own same-distribution data); RMIA's population z = the test examples.
    ``shadow_dir`` (default ``out/shadows``) holds the shadow runs; finished shadows with the
    same configuration and data are reused (e.g. by several targets of one set-up).
    Returns the attacks.json document (also written to ``out``).
    """
    from fl.config import TrainConfig
    from fl.io import atomic_write_json

    attacks = parse_attacks(attacks)
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.run_dir / "attacks"
    cfg = TrainConfig.from_dict(run.config)
    target = run_signals(run, device=device, cache_dir=out / "cache", progress=progress)
    eval_idx = np.flatnonzero(run.role != "test")
    is_member = run.role[eval_idx] == "member"
    z_idx = np.flatnonzero(run.role == "test")
    doc = _attack_core(
        target,
        run.ids,
        run.texts,
        run.labels,
        eval_idx,
        is_member,
        z_idx,
        cfg,
        cfg.model,
        cfg.max_length,
        run.num_labels,
        attacks,
        shadows,
        out,
        device,
        seed,
        global_variance,
        rmia_a,
        rmia_gamma,
        progress,
        n_bootstrap,
        "the run's members ∪ non-members ∪ test examples",
        shadow_dir,
    )
    doc = {
        "schema_version": 1,
        "target": {
            "run_dir": str(run.run_dir),
            "model": cfg.model,
            "dataset": cfg.dataset,
            "method": cfg.method,
            "dp_level": cfg.dp_level,
            "n_members": int(is_member.sum()),
            "n_nonmembers": int((~is_member).sum()),
        },
        "seed": seed,
        **doc,
    }
    atomic_write_json(out / "attacks.json", doc)
    return doc


def _joint_labels(datasets) -> tuple[list[np.ndarray], int]:
    """Map the label strings of several local files to one set of class indices (integers
    as themselves, else sorted names, as fl.data.load_local does for one file)."""
    raw = [[d.label_names[i] for i in d.labels] for d in datasets]
    names = sorted({v for r in raw for v in r})
    if all(v.lstrip("-").isdigit() for v in names):
        vals = [np.asarray([int(v) for v in r], np.int64) for r in raw]
        if min(int(v) for v in names) < 0:
            raise UsageError("integer labels must be >= 0")
        return vals, max(int(v) for v in names) + 1
    return [np.asarray([names.index(v) for v in r], np.int64) for r in raw], len(names)


def run_attacks_adapter(
    adapter,
    model: str,
    members_file,
    nonmembers_file,
    attacks=("loss",),
    shadows: int = 8,
    out=None,
    device: str = "auto",
    seed: int = 0,
    max_length: int = 64,
    base_seed: int = 0,
    shadow_config: dict | None = None,
    global_variance: bool | None = None,
    rmia_a: float = 0.3,
    rmia_gamma: float = 1.0,
    progress: bool = True,
    n_bootstrap: int = 200,
) -> dict:
    """Attacks on a PEFT LoRA adapter trained elsewhere.

    The loss attack needs only the adapter. The reference-model attacks train shadows with
    a reference pipeline: fedlora's centralised training (one client, non-private) of a
    LoRA of the adapter's rank, alpha and target modules on ``model``, with TrainConfig
    defaults overridden by ``shadow_config`` (fields of fl.config.TrainConfig); the attacker
    pool is members ∪ non-members from the two files (so the attacker is assumed to know
    the candidates and to train on the same distribution), and RMIA's z are the whole pool.
    """
    from fl.config import TrainConfig
    from fl.data import load_local
    from fl.io import atomic_write_json

    attacks = parse_attacks(attacks)
    acfg = read_adapter_config(adapter)
    mem = load_local(str(members_file))
    non = load_local(str(nonmembers_file))
    (ml, nl), n_cls = _joint_labels([mem, non])
    from attacks.signals import adapter_num_labels

    num_labels = adapter_num_labels(adapter) or n_cls
    if n_cls > num_labels:
        raise UsageError(f"the data has {n_cls} classes but the adapter's head has {num_labels}")
    texts = list(mem.texts) + list(non.texts)
    labels = np.concatenate([ml, nl])
    ids = [f"members:{i}" for i in range(len(mem))] + [f"nonmembers:{i}" for i in range(len(non))]
    is_member = np.arange(len(texts)) < len(mem)
    out = Path(out) if out is not None else Path(adapter) / "attacks"
    target = adapter_signals(
        adapter,
        model,
        texts,
        labels,
        max_length,
        device=device,
        seed=base_seed,
        num_labels=num_labels,
        cache_dir=out / "cache",
        progress=progress,
    )
    tm = acfg.get("target_modules")
    d = dict(
        model=model,
        dataset="synthetic",
        max_length=max_length,
        rank=int(acfg.get("r", 8)),
        alpha=float(acfg.get("lora_alpha", 16)),
        target_modules=",".join(tm) if isinstance(tm, list) else "",
        clients=1,
        seed=base_seed,
    )
    d.update(shadow_config or {})
    scfg = TrainConfig.from_dict(d)
    idx = np.arange(len(texts))
    doc = _attack_core(
        target,
        ids,
        texts,
        labels,
        idx,
        is_member,
        idx,
        scfg,
        model,
        max_length,
        num_labels,
        attacks,
        shadows,
        out,
        device,
        seed,
        global_variance,
        rmia_a,
        rmia_gamma,
        progress,
        n_bootstrap,
        "the given members ∪ non-members (reference pipeline: fedlora, "
        f"{scfg.clients} client(s), {scfg.rounds} rounds × {scfg.local_steps} steps, "
        f"dp_level={scfg.dp_level})",
    )
    doc = {
        "schema_version": 1,
        "target": {
            "adapter": str(adapter),
            "model": model,
            "n_members": int(is_member.sum()),
            "n_nonmembers": int((~is_member).sum()),
        },
        "seed": seed,
        **doc,
    }
    atomic_write_json(out / "attacks.json", doc)
    return doc
