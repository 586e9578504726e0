"""The run's manifest (``RUN/manifest.json``): configuration, privacy (mechanism, σ, δ,
rates, steps, ε, ledger), data splits, versions, final metrics and the adapter's
checksum. :func:`build_manifest` assembles it from a finished
:class:`fl.run.engine.Engine` (passed in; this module does not import the engine).
"""

from __future__ import annotations

import math
import platform
from datetime import UTC, datetime
from pathlib import Path

from fl.data.datasets import ids_hash
from fl.data.lm import resolved_format
from fl.io import file_sha256
from fl.privacy.accounting import NEIGHBOURING
from fl.run.config import TrainConfig
from fl.run.rundir import ADAPTER_WEIGHTS, SCHEMA_VERSION, SPLITS, jsonable

#: what the stated neighbouring relation takes as given (``privacy.assumptions``)
ASSUMPTIONS = {
    "sample": [
        "client sizes are public: each client's n_k sets its sampling rate q_k = B/n_k, its "
        "σ_k and its aggregation weight, and the manifest discloses q_k; the add/remove-one-"
        "example guarantee is for those sizes held fixed (a neighbour is accounted at the "
        "same q_k and σ_k), as DP-SGD libraries treat the dataset size",
        "the partition of members into clients is a function of the public seed and the "
        "data set; it is not protected",
    ],
    "client": [
        "the number of clients K and the cohort scheme are public; a client's update is "
        "clipped to C whatever its size, so client sizes enter no noise scale",
    ],
}


def _clip_used(eng) -> float | None:
    """The clip bound σ is relative to: the method's own server-side clip at client level
    (FedPower's ``server_clip``), else the configured C."""
    cfg = eng.cfg
    if cfg.dp_level == "none":
        return None
    own = getattr(eng.method, "clip", None)
    if cfg.dp_level == "client" and callable(own):
        c = float(own())
        if math.isfinite(c):
            return c
    return cfg.clip


def build_manifest(eng, adapter: Path, wall: float, final: dict, eps: dict) -> dict:
    """The manifest dict of the run ``eng`` (an :class:`fl.run.engine.Engine` after its
    last round): ``adapter`` the saved adapter directory, ``final`` the last metrics
    row with an accuracy, ``eps`` {"pld", "rdp"} (None without DP)."""
    cfg = eng.cfg
    sizes = dict(eng.public_sizes)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "tool": "fedlora-audit",
        "tool_version": _version(),
        "created": datetime.now(UTC).isoformat(),
        "config": cfg.to_dict(),
        "method": cfg.method,
        "method_options": jsonable(vars(eng.options)),
        "released": eng.method.release_note,
        "privacy": {
            "level": cfg.dp_level,
            "mechanism": _mechanism_text(cfg),
            "noise_multiplier": eng.sigma,
            # sample level: σ_k of each client (calibrated to its own q_k and steps);
            # noise_multiplier is their maximum
            "client_noise_multipliers": eng.client_sigmas() if cfg.dp_level == "sample" else {},
            "clipping_norm": _clip_used(eng),
            "delta": eng.delta,
            "target_epsilon": cfg.epsilon if cfg.epsilon > 0 else None,
            "sampling": "poisson",
            "sample_rates": {c: min(1.0, cfg.batch_size / n) for c, n in sizes.items()}
            if cfg.dp_level == "sample"
            else {},
            "client_sizes": sizes,
            "steps_per_round": {c: eng.local_steps_for(n) for c, n in sizes.items()},
            "rounds": cfg.rounds,
            "rounds_completed": len(eng.metrics_rows),
            "client_sampling": {
                "scheme": cfg.client_sampling,
                "clients_per_round": eng.expected_clients_per_round(),
                "total_clients": cfg.clients,
            },
            "participation_accounting": eng.participation_note,
            "method_mechanism": eng.method.privacy_note(),
            "public_log_note": "metrics.jsonl and run.log are the operator's logs (they name "
            "the sampled clients); the released artifact is the adapter",
            "neighbouring": NEIGHBOURING.get(cfg.dp_level),
            "assumptions": ASSUMPTIONS.get(cfg.dp_level, []),
            "noise": eng.rand.describe(),
            "epsilon": eps,
            "ledger": eng.ledger.state_dict(),
        },
        "data": {
            "dataset": cfg.dataset,
            "num_classes": eng.dataset.num_classes,
            "label_names": eng.dataset.label_names,
            "n_members": len(eng.split.members),
            "n_nonmembers": len(eng.split.nonmembers),
            "n_test": len(eng.split.test),
            "splits_sha256": file_sha256(eng.out / SPLITS),
            "members_sha256": ids_hash([eng.dataset.ids[i] for i in eng.split.members]),
        },
        "model": model_block(eng),
        "client_ranks": eng.client_ranks or None,
        "seeds": {"seed": cfg.seed},
        "versions": _versions(),
        "metrics": {
            "final": {
                k: final.get(k)
                for k in (
                    "accuracy",
                    "balanced_accuracy",
                    "loss",
                    "perplexity",
                    "val_accuracy",
                    "val_balanced_accuracy",
                    "val_perplexity",
                )
                if k in final
            }
        },
        "adapter_sha256": file_sha256(adapter / ADAPTER_WEIGHTS),
        "wall_seconds": wall,
        "log": eng._log_lines[-50:],
    }
    manifest["visibility"] = "operator"
    manifest["device"] = eng.device.type
    if cfg.inject_fault:  # --inject-fault (tests only): never released, never audited from
        manifest["injected_fault"] = cfg.inject_fault
    return manifest


def model_block(eng) -> dict:
    """How the model was built and trained: the resolved pooling (``auto`` read from the
    model folder), head initialization, LoRA layers, the frozen prefix and whether it
    was cached, and the two learning rates."""
    cfg, prefix = eng.cfg, eng.trainer.prefix
    from fl.models.base import resolve_pooling

    lm = cfg.task == "causal-lm"
    return {
        "name": cfg.model,
        "task": cfg.task,
        # causal-lm: the resolved data format; no head, so no pooling
        "lm_format": resolved_format(eng.dataset) if lm else None,
        "precision": cfg.precision,
        "pooling": None if lm else resolve_pooling(cfg.model, cfg.pooling),
        "head_init": cfg.head_init,
        "lora_layers": cfg.lora_layers or "all",
        "frozen_prefix_layers": prefix.depth,
        "prefix_cache": prefix.enabled,
        "lr": cfg.lr,
        "head_lr": cfg.head_lr or cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "head_warmup_rounds": cfg.head_warmup_rounds,
    }


def _mechanism_text(cfg: TrainConfig) -> str:
    if cfg.dp_level == "sample":
        share = getattr(cfg, "head_clip_share", 0.0)
        clip = (
            f"per-example ℓ2 clipping of the head to C·√{share:g} and of the other trainable "
            f"parameters to C·√{1 - share:g} (within C together; one clip to C where only "
            "one of the two is trained)"
            if share > 0
            else "per-example ℓ2 clipping to C over all trainable parameters"
        )
        return (
            f"DP-SGD on each client: Poisson sampling, {clip} (Opacus per-sample "
            "gradients), Gaussian noise σ·C per step"
        )
    if cfg.dp_level == "client":
        return "server-side: each client update clipped to C, Gaussian noise σ·C on the sum"
    return "none"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fedlora-audit")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "0+unknown"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "opacus", "dp-accounting", "numpy", "flwr"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
