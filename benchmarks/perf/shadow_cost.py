"""Benchmark: the cost of one shadow model, the shared frozen-prefix pool against the path
before it, in one interleaved run.

Workload (full): the ε = 8 FedAvg-LoRA target of ``fedlora run``'s default preset
(:data:`TARGET`: minilm on tweets, LoRA on the top layer over a cached frozen prefix,
5 clients, 3 rounds × 6 DP-SGD steps of batch 128, 48 tokens) and an attacker pool of
3 000 tweets (members + non-members + test of that run: 2 000 + 500 + 500), with the
shadows' training shortened to :data:`STEPS` (1 round × 4 steps per client, so that
the benchmark fits a shared 2-core machine): a shadow's training cost scales with its
steps and is the same on both sides, the pool encode does not; ``details.projected``
derives the seconds per shadow step, (after − encode/K) / steps, and from it the cost per
shadow at the preset's steps on both sides (a projection, labelled so). Each side
trains ``K`` = 4 shadows on halves of the pool with ``attacks.reference.train_shadows``
in this process (one after another: the cost, not the parallelism), each repetition
from an empty process cache (what a fresh ``fedlora attack`` call pays):

- ``before``: ``share_prefix=False``, the path before the shared pool: each shadow
  encodes its own data sets (the process cache lets a complementary pair share its two
  halves, so K shadows encode the pool K/2 times);
- ``after``: ``share_prefix=True``: the pool is encoded once, every shadow gathers
  its rows;
- ``uncached`` (full mode only, ``K_UNCACHED`` = 1 shadow): ``prefix_cache=False``:
  every step runs the whole encoder (what a shadow cost before the frozen-prefix cache);
- ``encode``: one encode of the pool by the frozen prefix alone, so that the cost per
  shadow at any K can be read off: before ≈ train + encode/2, after ≈ train + encode/K.

Ratio: per-shadow seconds after / before (paired by repetition); the uncached and
encode figures are in ``details``, and the same in CPU seconds of this process
(``cpu_*``: all sides run here, so they hold all the work; on a shared machine they
move much less with the others' load than wall seconds).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.perf import harness

NAME = "shadow_cost"
K = 4
K_UNCACHED = 1
#: the ε = 8 FedAvg-LoRA run of `fedlora run --preset default` (pipeline.job: its preset
#: base with the run's overrides; tests/benchmarks/test_shadow_cost.py checks they agree)
TARGET = dict(model="minilm", dataset="tweets", members=2000, nonmembers=500, test=500)
TARGET |= dict(max_length=48, clients=5, rounds=3, eval_every=3, local_steps=6)
TARGET |= dict(batch_size=128, lr=1e-3, head_lr=3e-2, lora_layers=1, pooling="auto")
TARGET |= dict(head_init="zero", rank=8, alpha=16.0, dropout="off", method="fedavg", seed=0)
TARGET |= dict(dp_level="sample", epsilon=8.0)
#: the shadows' training in full mode: 1 round x 4 steps per client (20 DP steps)
STEPS = dict(rounds=1, eval_every=1, local_steps=4)
#: quick: tiny-bert with the same structure (LoRA on the top layer of two)
QUICK = dict(model="tiny-bert", dataset="synthetic", members=40, nonmembers=20, test=20)
QUICK |= dict(max_length=16, clients=2, rounds=1, local_steps=2, batch_size=16, lora_layers=1)
QUICK |= dict(method="fedavg", seed=0, dp_level="sample", epsilon=8.0)


def available() -> str | None:
    if importlib.util.find_spec("attacks.reference") is None:
        return "attacks.reference does not exist yet"
    return None


def _pool(spec: dict):
    """The target run's members ∪ non-members ∪ test (the pool of ``fedlora attack``)."""
    from fl.data.datasets import load_dataset, split_dataset

    ds = load_dataset(spec["dataset"])
    sp = split_dataset(len(ds), spec["members"], spec["nonmembers"], spec["test"], spec["seed"])
    idx = np.concatenate([sp.members, sp.nonmembers, sp.test])
    return [ds.ids[i] for i in idx], [ds.texts[i] for i in idx], ds.labels[idx], ds.num_classes


def run(quick: bool, device: str = "cpu") -> dict:
    why = available()
    if why:
        return harness.not_available(NAME, why)
    import torch

    from attacks.reference import train_shadows
    from fl.data.tokenized import TokenizedData
    from fl.models import heads
    from fl.models.base import load_tokenizer
    from fl.run.config import TrainConfig
    from fl.run.trainer import LocalTrainer

    spec = QUICK if quick else TARGET
    cfg = TrainConfig(**{**spec, **({} if quick else STEPS)}, progress=False, device=device)
    uncached_cfg = TrainConfig.from_dict({**cfg.to_dict(), "prefix_cache": False})
    ids, texts, labels, c = _pool(spec)
    reps = 1 if quick else 2
    with tempfile.TemporaryDirectory(prefix="fedlora-bench-shadows-") as tmp:
        counter = iter(range(10**6))

        def shadows(config, k: int, share: bool):
            heads.clear_encoded_cache()  # a fresh process: nothing encoded yet
            train_shadows(
                config, ids, texts, labels, k, Path(tmp) / f"s{next(counter)}", device=device,
                progress=False, num_labels=c, workers=1, ray_address="none", share_prefix=share,
            )  # fmt: skip

        trainer = LocalTrainer(cfg, c, torch.device(device))
        pool = TokenizedData(texts, labels, load_tokenizer(cfg.model), cfg.max_length)
        sides = {
            "before": lambda: shadows(cfg, K, False),
            "after": lambda: shadows(cfg, K, True),
            "encode": lambda: trainer.prefix.encode(pool),
        }
        if not quick:
            sides["uncached"] = lambda: shadows(uncached_cfg, K_UNCACHED, False)
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        times = harness.interleaved({k: _logged(k, f, cpu[k]) for k, f in sides.items()}, reps, 0)
    before = [t / K for t in times["before"]]
    after = [t / K for t in times["after"]]
    spread = harness.paired_ratio(before, after)
    details = {
        "k": K,
        "pool": len(texts),
        "frozen_layers": trainer.prefix.depth,
        "dp_steps_per_shadow": cfg.rounds * cfg.local_steps * cfg.clients,
        "seconds_per_shadow_before": harness.summarize(before),
        "seconds_per_shadow_after": harness.summarize(after),
        "seconds_encode_pool": harness.summarize(times["encode"]),
        # CPU seconds of this process (every side runs here): on a shared machine they move
        # much less with the other processes' load than wall seconds do
        "cpu_seconds_per_shadow_before": harness.summarize([t / K for t in cpu["before"]]),
        "cpu_seconds_per_shadow_after": harness.summarize([t / K for t in cpu["after"]]),
        "cpu_seconds_encode_pool": harness.summarize(cpu["encode"]),
        "cpu_after_over_before": harness.paired_ratio(cpu["before"], cpu["after"]),
    }
    if not quick:
        enc = float(np.median(times["encode"]))
        steps = details["dp_steps_per_shadow"]
        per_step = (float(np.median(after)) - enc / K) / steps
        full = TARGET["rounds"] * TARGET["local_steps"] * TARGET["clients"]
        details["projected"] = {
            "note": "derived from the medians above, not timed: train = per_step x steps",
            "seconds_per_step": per_step,
            "preset_steps": full,
            "before_per_shadow_s": per_step * full + enc / 2,
            "after_per_shadow_s": per_step * full + enc / K,
            "after_per_shadow_s_k64": per_step * full + enc / 64,
        }
    if "uncached" in times:
        unc = [t / K_UNCACHED for t in times["uncached"]]
        details["seconds_per_shadow_uncached"] = harness.summarize(unc)
        details["after_over_uncached"] = harness.paired_ratio(unc, after)
    return harness.result(
        NAME,
        workload=(
            f"{cfg.model}/{cfg.dataset} ε = 8 FedAvg-LoRA (lora_layers={cfg.lora_layers}, "
            f"{cfg.clients} clients, {cfg.rounds} x {cfg.local_steps} steps, batch "
            f"{cfg.batch_size}), pool of {len(texts)}, {K} shadows per side in this process, "
            f"{reps} interleaved repetition(s)"
        ),
        baseline="per shadow, each shadow encoding its own halves (share_prefix=False)",
        candidate="per shadow, the pool encoded once and shared (share_prefix=True)",
        ratio=spread["median"],
        ratio_kind="time",
        details=details,
        spread=spread,
    )


def _logged(name: str, fn, cpu: list[float]):
    """``fn`` that appends its CPU seconds (this process, all threads) to ``cpu`` and
    prints them with its wall seconds to stderr (a long benchmark shows progress)."""
    import sys
    import time

    def call():
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        print(
            f"shadow_cost: {name} {time.perf_counter() - t0:.1f}s wall, {cpu[-1]:.1f}s CPU",
            file=sys.stderr,
            flush=True,
        )

    return call
