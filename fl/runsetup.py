"""Run set-up pieces of :class:`fl.engine.Engine` that need nothing of it but the
configuration: per-client ranks, the run's noise streams (secret key or public seed)
and the audit canaries. The engine calls them from ``setup`` / ``_start_files``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fl.config import TrainConfig
from fl.errors import UsageError
from fl.privacy import rng as R


def draw_client_ranks(cfg: TrainConfig) -> dict[str, int]:
    """Per-client ranks (heterogeneous ranks): ``--client-ranks-list`` gives them,
    ``--client-ranks`` draws each from a list (public seed); {} when neither is set."""
    if cfg.client_ranks_list:
        try:
            ranks = [int(x) for x in cfg.client_ranks_list.split(",")]
        except ValueError:
            raise UsageError(
                f"--client-ranks-list must be integers, got {cfg.client_ranks_list!r}"
            ) from None
        if len(ranks) != cfg.clients:
            raise UsageError(
                f"--client-ranks-list gives {len(ranks)} ranks for {cfg.clients} clients"
            )
    elif cfg.client_ranks:
        try:
            choices = [int(x) for x in cfg.client_ranks.split(",")]
        except ValueError:
            raise UsageError(f"--client-ranks must be integers, got {cfg.client_ranks!r}") from None
        rng = np.random.default_rng([cfg.seed, 0xA11])
        ranks = [int(rng.choice(choices)) for _ in range(cfg.clients)]
    else:
        return {}
    bad = [r for r in ranks if r < 1 or r > cfg.rank]
    if bad:
        raise UsageError(f"client ranks must be in [1, R={cfg.rank}], got {bad}")
    return {str(k): r for k, r in enumerate(ranks)}


def run_randomness(
    cfg: TrainConfig, noise_key, out: Path, resume: bool, warn_lines: list[str]
) -> R.RunRandomness:
    """The run's noise streams: keyed by the secret run key (default), or seeded
    from the public seed under --insecure-deterministic-noise (not private).
    ``noise_key``: the ``--noise-key`` argument (a path or key, or None: the run's own
    key under ``out``, read on ``resume``, else a fresh one). Warnings for the run log
    are appended to ``warn_lines``."""
    if cfg.dp_level == "none" and not cfg.insecure_deterministic_noise:
        # No DP claimed, nothing to keep secret: draws from the public seed keep a
        # non-private run (a shadow model, a baseline) reproducible from its config.
        if noise_key is not None:
            raise UsageError("--noise-key needs a DP run (--dp-level sample or client)")
        return R.RunRandomness(None, cfg.seed, no_dp=True)
    if cfg.insecure_deterministic_noise:
        if noise_key is not None:
            raise UsageError("--noise-key and --insecure-deterministic-noise exclude each other")
        return R.RunRandomness(None, cfg.seed, insecure=True)
    key = noise_key
    if isinstance(key, str | Path):
        path = Path(key)
        key = R.NoiseKey.read(path)
        # A reused key replays the same noise: two runs that differ in anything but
        # publish both would let their difference cancel the noise. Say so.
        warn_lines.append(
            f"noise key {key.key_id} reused from {path}: this run replays that run's noise "
            "streams; publish at most one of two runs made with one key unless they are "
            "identical (a replay)"
        )
        if not R.key_file_is_private(path):
            warn_lines.append(
                f"warning: noise key file {path} is readable by others than its owner"
            )
    elif key is None:
        own = out / R.PRIVATE_DIR / R.KEY_FILE
        if resume:
            if not own.is_file():
                raise UsageError(
                    f"--resume: {own} is missing; a private run cannot be resumed "
                    "without its noise key (fresh noise would release the resumed "
                    "rounds twice)"
                )
            key = R.NoiseKey.read(own)
        else:
            key = R.NoiseKey.generate()
    return R.RunRandomness(key, cfg.seed)


def make_canaries(cfg: TrainConfig, ds, split, rand: R.RunRandomness, cids: list[str]) -> dict:
    """Audit canaries: M canaries, each ADDED with probability 1/2 to a random
    client's data (never replacing a member). Every choice (source example, label,
    text, inclusion, client) comes from the run's secret stream ``canaries``: the
    one-run audit needs inclusions nobody can predict. ``cids``: the client ids."""
    if cfg.canaries <= 0:
        return {}
    if cfg.canary_kind not in ("mislabel", "random_text"):
        raise UsageError(f"unknown canary kind {cfg.canary_kind!r}; use mislabel or random_text")
    pool = split.nonmembers
    if len(pool) < cfg.canaries:
        raise UsageError(f"--canaries {cfg.canaries} needs at least as many non-member examples")
    src = rand.stream("canaries")
    M, C = cfg.canaries, ds.num_classes
    chosen = pool[R.random_subset(src, len(pool), M)]
    order = R.integers(src, 1 << 30, M)  # shuffle the sorted subset
    chosen = chosen[np.argsort(order, kind="stable")]
    client_of = R.integers(src, len(cids), M)
    included = R.bernoulli_mask(src, M, 0.5).numpy()
    shift = R.integers(src, max(C - 1, 1), M)
    words = R.integers(src, 9000, 12 * M).reshape(M, 12) + 1000
    rand_labels = R.integers(src, C, M)
    canaries = []
    for j, i in enumerate(chosen):
        y = int(ds.labels[i])
        if cfg.canary_kind == "mislabel":
            text, label = ds.texts[i], int((y + 1 + shift[j]) % C)
        else:
            text = " ".join(f"zq{w}" for w in words[j])
            label = int(rand_labels[j])
        canaries.append(
            {
                "id": f"canary:{j}",
                "source_id": ds.ids[i],
                "text": text,
                "label": label,
                "included": bool(included[j]),
                "client": cids[int(client_of[j])] if included[j] else None,
            }
        )
    return {"canaries": canaries}
