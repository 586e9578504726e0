"""Run set-up pieces of :class:`fl.run.engine.Engine` that need nothing of it but the
configuration: per-client ranks, the run's noise streams (secret key or public seed)
and the audit canaries. The engine calls them from ``setup`` / ``_start_files``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fl.errors import UsageError
from fl.privacy import rng as R
from fl.run.config import TrainConfig, config_sha256


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


def check_client_sizes(parts: list, cfg: TrainConfig) -> None:
    """Every client holds at least one example: an empty client has no sampling rate
    (q = B/0), trains nothing and would be accounted for nothing."""
    empty = [k for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise UsageError(
            f"the {cfg.partition} partition of {cfg.members} members over {cfg.clients} "
            f"clients leaves {len(empty)} client(s) with no examples (client {empty[0]}); "
            "use fewer --clients, more --members or a larger --dirichlet-alpha"
        )


def _model_positions(model: str) -> int | None:
    """How many positions the model embeds (None when its config does not say)."""
    from fl.models.base import model_folder

    folder = model_folder(model)
    if folder is None:  # tiny-bert / tiny-gpt2 (fl.models.base.tiny_model_config)
        return 256
    try:
        conf = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = conf.get(k) if isinstance(conf, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_max_length(cfg: TrainConfig) -> None:
    """``--max-length`` fits the model's position embeddings (checked before anything is
    tokenized: sequences are padded to it)."""
    limit = _model_positions(cfg.model)
    if limit is not None and cfg.max_length > limit:
        raise UsageError(
            f"max_length {cfg.max_length} exceeds the {limit} positions of model {cfg.model!r}"
        )


def run_randomness(
    cfg: TrainConfig,
    noise_key,
    out: Path,
    resume: bool,
    warn_lines: list[str],
    allow_key_reuse: bool = False,
) -> R.RunRandomness:
    """The run's noise streams: keyed by the secret run key (default), or seeded
    from the public seed under --insecure-deterministic-noise (not private).
    ``noise_key``: the ``--noise-key`` argument (a path or key, or None: the run's own
    key under ``out``, read on ``resume``, else a fresh one). Warnings for the run log
    are appended to ``warn_lines``.

    A key *file* is checked against the binding written beside it when it was made
    (``private/key_binding.json``: the configuration hash it was made for). The same
    configuration is a replay (identical draws on identical data: private). Anything
    else — another configuration, or a key without a binding — is refused unless
    ``allow_key_reuse``: two releases under one key with different data or settings let
    their noise cancel in a difference, so such a run is recorded as NOT private
    (``privacy.noise.reused_key``). A key *object* (the audit's in-process replay) is
    taken as it is."""
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
    this = config_sha256(cfg)
    bound: str | None = this  # the configuration this run's key binding names
    reused = None
    if isinstance(key, str | Path):
        path = Path(key)
        key = R.NoiseKey.read(path)
        binding = R.read_key_binding(path.parent, key)
        original = binding.get("config_sha256") if binding else None
        if binding and binding.get("reused_key"):
            original = None  # that key was itself reused: no replay of it is private
        if original != this:
            made_for = (
                f"configuration {original}"
                if original
                else f"an unknown configuration (no valid {R.BINDING_FILE} beside it)"
            )
            if not allow_key_reuse:
                raise UsageError(
                    f"--noise-key {path}: the key was made for {made_for}, this run's "
                    f"configuration is {this}; noise drawn twice under one key for different "
                    "runs cancels in their difference. Replay the same configuration, leave "
                    "--noise-key out for a fresh key, or pass --allow-key-reuse to make a run "
                    "that is recorded as NOT private"
                )
            reused = {
                "key_id": key.key_id,
                "original_config_sha256": original,
                "config_sha256": this,
            }
            bound = original
            warn_lines.append(
                f"warning: noise key {key.key_id} from {path} was made for {made_for}, not "
                f"this run's configuration {this} (--allow-key-reuse): its noise cancels "
                "against that run's, so this run is NOT private and `fedlora export` refuses it"
            )
        else:
            # A replay: the same configuration and key draw the same noise on the same
            # data. Publishing both releases nothing new; publish at most one otherwise.
            warn_lines.append(
                f"noise key {key.key_id} reused from {path}: this run replays that run's "
                "noise streams (same configuration); publish at most one of the two"
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
            # a run made with a reused key stays not private when resumed
            binding = R.read_key_binding(own.parent, key)
            reused = (binding or {}).get("reused_key") or None
            bound = (binding or {}).get("config_sha256")  # (a resume writes no key files)
        else:
            key = R.NoiseKey.generate()
    return R.RunRandomness(key, cfg.seed, reused_key=reused, binding_sha256=bound)


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
