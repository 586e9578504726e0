"""Orchestration: signals of the target and the shadows → every attack → metrics and files.

:func:`attack` runs the attacks of an :class:`attacks.config.AttackConfig` on an
:class:`attacks.target.Target` (a loop over :mod:`attacks.registry`); :func:`run_attacks`
and :func:`run_attacks_adapter` are its keyword-argument forms for a run directory and a
foreign adapter.

Outputs (in ``out``, default ``RUN_DIR/attacks/``):
- ``attacks.json``: {"schema_version", "target": {...}, "seed", "attacks": {name:
  roc_metrics(...) + threat_model + seconds (scoring) [+ shared_shadow_seconds: training
  + signals of the shadows, shared by the reference-based attacks]}, "shadows": {...}};
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

from attacks import registry
from attacks.config import FAMILIES, AttackConfig, parse_attacks
from attacks.metrics import plot_roc, roc_metrics
from attacks.target import Target
from fl.errors import UsageError

__all__ = ["attack", "run_attacks", "run_attacks_adapter", "parse_attacks", "ATTACKS"]

ATTACKS = FAMILIES  # the name this module has always exported
_D = AttackConfig()  # the defaults of the keyword-argument forms below


def _train_shadows(target: Target, cfg: AttackConfig, shadow_dir: Path, only=None):
    """:func:`attacks.reference.train_shadows` for ``target`` under ``cfg`` (one call for
    the attack and for shadows trained ahead: the same arguments, so the same specs)."""
    from attacks.reference import train_shadows

    return train_shadows(
        target.shadow_config,
        list(target.ids),
        list(target.texts),
        target.labels,
        cfg.shadows,
        shadow_dir,
        seed=cfg.seed,
        device=cfg.device,
        progress=cfg.progress and only is None,
        num_labels=target.num_labels,
        workers=cfg.workers if only is None else 1,
        ray_address=cfg.ray_address if only is None else "none",
        only=only,
    )


def train_shadow_ahead(
    run_dir, j: int, shadows: int = _D.shadows, seed: int = _D.seed, out=None
) -> float:
    """Train shadow ``j`` of the ``shadows`` that :func:`run_attacks` (same ``run_dir``,
    ``shadows``, ``seed`` and ``out``) trains for its reference-model attacks, here and
    now, so that the attack reuses it: ``fedlora run`` trains its shadows as tasks beside
    its other trainings. Returns the training's seconds."""
    target = Target.from_run(run_dir)
    cfg = _config(("loss",), shadows, _D.device, seed, None, _D.rmia_a, _D.rmia_gamma, False, 0)
    out = Path(out) if out is not None else target.default_out
    sset = _train_shadows(target, cfg, out / "shadows", only=[j])
    return float(sset.seconds[j])


def _shadow_stage(target: Target, cfg: AttackConfig, out: Path, shadow_dir):
    """Train (or reuse) the shadows and compute their signals on the pool:
    (ShadowSignals, attacks.json's ``shadows`` block)."""
    scfg = target.shadow_config
    texts = list(target.texts)
    sset = _train_shadows(
        target, cfg, Path(shadow_dir) if shadow_dir is not None else out / "shadows"
    )
    t0 = time.perf_counter()
    sigs = [
        target.signals_of(d, int(scfg.seed), cfg.device, out / "cache", False, cfg.min_k)
        for d in sset.adapter_dirs
    ]
    sig_secs = time.perf_counter() - t0
    trained = [s for s, r in zip(sset.seconds, sset.reused) if not r]
    doc = {
        "k": cfg.shadows,
        "design": (
            "each shadow is a fedlora training run with the target's configuration "
            "(method, federation, steps, DP level and seed) on a "
            "random half of the attacker pool (complementary pairs: every pool example "
            f"is IN half of the shadows); pool = {target.pool_note}"
        ),
        "pool_size": len(texts),
        "train_seconds_each": sset.seconds,
        "mean_train_seconds": float(np.mean(sset.seconds)),
        "trained_now": len(trained),
        "signal_seconds_total": sig_secs,
        "config": {
            k: sset.config.get(k)
            for k in ("model", "method", "clients", "rounds", "local_steps", "dp_level")
        },
    }
    return registry.ShadowSignals.stack(sset.in_mask, sigs), doc


def attack(target: Target, config: AttackConfig = _D, out=None, shadow_dir=None) -> dict:
    """Every attack of ``config`` (default: the target's default attacks) on ``target``.

    ``shadow_dir`` (default ``out/shadows``) holds the shadow runs; finished shadows with
    the same configuration and data are reused (e.g. by several targets of one set-up).
    Writes attacks.json, scores.npz and roc.png/svg to ``out`` (default
    ``target.default_out``); returns the attacks.json document.
    """
    from fl.io import atomic_write_json

    chosen = registry.select(config.attacks or target.default_attacks, target.task)
    if not chosen:
        raise UsageError(f"none of the attacks {config.attacks} applies to a {target.task} target")
    needs_shadows = any(a.needs_shadows for a in chosen)
    if needs_shadows and config.shadows < 2:
        raise UsageError(f"reference-model attacks need --shadows >= 2, got {config.shadows}")
    if any(a.family == "lira" for a in chosen) and config.shadows < 4:
        # complementary pairs: with 2 shadows every example is IN one and OUT of one, so
        # no within-example spread of φ exists and LiRA's Gaussians cannot be fitted
        raise UsageError(
            f"LiRA needs --shadows >= 4 (got {config.shadows}): with 2 every example is IN "
            "one shadow and OUT of the other, so the spread of its confidence cannot be "
            "estimated; use 4 or more, or drop lira from --attacks"
        )
    if needs_shadows and target.prompts is not None:
        raise UsageError(
            "shadow models of instruction-format (prompt/response) data are not supported; "
            f"use --attacks loss,lm on {target.source}"
        )
    out = Path(out) if out is not None else target.default_out
    pool = target.signals(config.device, out / "cache", config.progress, config.min_k)
    out.mkdir(parents=True, exist_ok=True)
    shadows, shadow_doc = None, None
    if needs_shadows:
        shadows, shadow_doc = _shadow_stage(target, config, out, shadow_dir)
    inputs = registry.Inputs(pool, target.eval_idx, target.z_idx, shadows, config)

    is_member = target.is_member
    scores: dict[str, np.ndarray] = {}
    results: dict[str, dict] = {}
    for a in chosen:
        t0 = time.perf_counter()
        scores[a.name] = np.asarray(a.score(inputs), dtype=np.float64)
        seconds = time.perf_counter() - t0  # scoring only
        r = roc_metrics(scores[a.name], is_member, n_bootstrap=config.bootstrap, seed=config.seed)
        r["threat_model"] = a.threat_model(config)
        r["seconds"] = seconds
        if shadow_doc is not None and a.needs_shadows:
            # The shadows' cost, shared by every reference-based attack of this call.
            r["shared_shadow_seconds"] = float(
                np.nansum(shadow_doc["train_seconds_each"]) + shadow_doc["signal_seconds_total"]
            )
        results[a.name] = r
    np.savez(
        out / "scores.npz",
        ids=np.asarray([target.ids[i] for i in target.eval_idx]),
        is_member=np.asarray(is_member, dtype=bool),
        **scores,
    )
    plot_roc(results, out / "roc")
    doc = {
        "schema_version": 1,
        "target": target.document(),
        "seed": config.seed,
        "attacks": results,
        "shadows": shadow_doc,
    }
    if target.task == "causal-lm":  # the LM's perplexity per role, adapter on and off
        from attacks.lm_signals import perplexities

        doc["lm"] = {"perplexity": perplexities(pool, target.role), "min_k": config.min_k}
    atomic_write_json(out / "attacks.json", doc)
    if config.client_level:  # clients.json beside attacks.json (attacks.client_level)
        from attacks.client_level import write_client_level

        doc["client_level"] = write_client_level(target, scores, config, out)
    return doc


def _config(
    attacks,
    shadows,
    device,
    seed,
    global_variance,
    rmia_a,
    rmia_gamma,
    progress,
    n_bootstrap,
    **more,
) -> AttackConfig:
    """The AttackConfig of the keyword-argument forms' parameters (``more``: other fields)."""
    return AttackConfig.with_variance(
        global_variance,
        **more,
        attacks=attacks,
        shadows=shadows,
        device=device,
        seed=seed,
        rmia_a=rmia_a,
        rmia_gamma=rmia_gamma,
        progress=progress,
        bootstrap=n_bootstrap,
    )


def run_attacks(
    run_dir,
    attacks=ATTACKS,
    shadows: int = _D.shadows,
    out=None,
    device: str = _D.device,
    seed: int = _D.seed,
    global_variance: bool | None = None,
    rmia_a: float = _D.rmia_a,
    rmia_gamma: float = _D.rmia_gamma,
    progress: bool = _D.progress,
    n_bootstrap: int = _D.bootstrap,
    shadow_dir=None,
    workers: int = _D.workers,
    ray_address: str = _D.ray_address,
) -> dict:
    """All requested attacks on a run directory's released adapter.

    Evaluation points: the run's members (label 1) and non-members (label 0). Attacker
    pool for shadows: members ∪ non-members ∪ test examples of the run (the test examples
    are the attacker's own same-distribution data); RMIA's population z = the test examples.
    ``global_variance``: None = auto; ``workers``, ``ray_address``: where the shadows train
    (:func:`attacks.reference.train_shadows`). See :func:`attack`; returns the attacks.json
    document.
    """
    cfg = _config(
        attacks,
        shadows,
        device,
        seed,
        global_variance,
        rmia_a,
        rmia_gamma,
        progress,
        n_bootstrap,
        workers=workers,
        ray_address=ray_address,
    )
    return attack(Target.from_run(run_dir), cfg, out=out, shadow_dir=shadow_dir)


def run_attacks_adapter(
    adapter,
    model: str,
    members_file,
    nonmembers_file,
    attacks=("loss",),
    shadows: int = _D.shadows,
    out=None,
    device: str = _D.device,
    seed: int = _D.seed,
    max_length: int = 64,
    base_seed: int = 0,
    shadow_config: dict | None = None,
    global_variance: bool | None = None,
    rmia_a: float = _D.rmia_a,
    rmia_gamma: float = _D.rmia_gamma,
    progress: bool = _D.progress,
    n_bootstrap: int = _D.bootstrap,
) -> dict:
    """Attacks on a PEFT LoRA adapter trained elsewhere (see
    :meth:`attacks.target.Target.from_adapter` for the reference pipeline of the shadows);
    the attacker pool is members ∪ non-members from the two files (so the attacker is
    assumed to know the candidates and to train on the same distribution), and RMIA's z
    are the whole pool."""
    cfg = _config(
        attacks, shadows, device, seed, global_variance, rmia_a, rmia_gamma, progress, n_bootstrap
    )
    target = Target.from_adapter(
        adapter, model, members_file, nonmembers_file, max_length, base_seed, shadow_config
    )
    return attack(target, cfg, out=out)
