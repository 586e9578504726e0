"""Benchmark: length buckets (``TrainConfig.length_buckets``) vs one padded pass.

Both sides run ``LocalTrainer.train`` with DP-SGD on one shared trainer (same model, same
keyed Poisson batches, same noise), interleaved; the only difference is the config's
``length_buckets``:

- ``single``: each Poisson batch in one forward/backward pass, padded to its longest text;
- ``buckets``: each batch split by :func:`fl.data.tokenized.length_chunks` into sub-batches of
  similar length, each padded to its own longest text (the per-example gradients are the
  same up to float rounding: ``tests/fl/test_length_buckets.py``).

Workload: the real tweets corpus (not the synthetic full-length texts of
``dp_overhead``, where every text has the same length and the buckets do nothing),
48 tokens, Poisson batches of expected size 128 from 1 000 texts, LoRA r = 8 on the top
layer over the frozen-prefix cache and the head: the claims scale and the default job's
set-up. Also reported: the fraction of real (non-padding) tokens among those computed,
per side.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.perf import harness
from benchmarks.perf.dp_overhead import bench_streams, dp_params

NAME = "length_buckets"


def _trainer(model: str, n: int, batch_size: int, seq: int, buckets: bool):
    from fl.data.datasets import load_dataset
    from fl.models.base import load_tokenizer
    from fl.run.config import TrainConfig
    from fl.run.engine import LocalTrainer, TokenizedData

    cfg = TrainConfig(
        model=model,
        dataset="tweets",
        max_length=seq,
        batch_size=batch_size,
        lora_layers=1,
        lr=1e-3,
        head_lr=3e-2,
        length_buckets=buckets,
        progress=False,
    )
    trainer = LocalTrainer(cfg, 2, torch.device("cpu"))
    ds = load_dataset("tweets")
    data = TokenizedData(ds.texts[:n], np.asarray(ds.labels[:n]), load_tokenizer(model), seq)
    return trainer, data


def _token_fractions(trainer, data, n: int, q: float, steps: int) -> float:
    """Real tokens / computed (padded) tokens over the Poisson batches of one rep."""
    from fl.run.engine import poisson_masks

    real = padded = 0
    lengths = data.lengths
    for mask in poisson_masks(bench_streams("bench-buckets")[1], n, q, steps):
        idx = torch.arange(n)[mask]
        for part in trainer._chunks(data, idx):
            if len(part):
                real += int(lengths[part].sum())
                padded += len(part) * int(lengths[part].max())
    return real / max(padded, 1)


def run(quick: bool, device: str = "cpu") -> dict:
    if device != "cpu":
        return harness.not_available(NAME, "length buckets run on the CPU only")
    model = "tiny-bert" if quick else "minilm"
    n, bs, seq = (200, 32, 32) if quick else (1000, 128, 48)
    steps, reps = (1, 2) if quick else (3, 5)
    t0 = time.perf_counter()
    single, data = _trainer(model, n, bs, seq, buckets=False)
    buckets, _ = _trainer(model, n, bs, seq, buckets=True)
    buckets.model.load_state_dict(single.model.state_dict())
    start = single.initial_state()
    dp = dp_params(bs, n)
    pos = np.arange(n)

    def side(trainer):
        def f():
            trainer.train(
                start, data, pos, steps, {"A", "B", "head"}, dp,
                streams=bench_streams("bench-buckets"), dropout_seed=0,
            )  # fmt: skip

        return f

    times = harness.interleaved(
        {"single": side(single), "buckets": side(buckets)}, reps=reps, warmup=1
    )
    spread = harness.paired_ratio(times["single"], times["buckets"])
    q = min(1.0, bs / n)
    details = {
        "model": model,
        "examples": n,
        "batch_size": bs,
        "seq_len": seq,
        "steps_per_rep": steps,
        "single_step": harness.summarize(times["single"], steps),
        "buckets_step": harness.summarize(times["buckets"], steps),
        "real_token_fraction": {
            "single": _token_fractions(single, data, n, q, steps),
            "buckets": _token_fractions(buckets, data, n, q, steps),
        },
        "overhead_tokens": buckets.BUCKET_OVERHEAD_TOKENS,
        "torch_threads": torch.get_num_threads(),
    }
    return harness.result(
        NAME,
        workload=(
            f"LocalTrainer.train with DP-SGD (σ=1, C=1), {model} on tweets, {seq} tokens, "
            f"Poisson batches of expected size {bs} from {n} texts, LoRA r=8 on the top layer "
            f"over the frozen-prefix cache + head; {steps} steps per repetition, {reps} "
            f"interleaved repetitions; {time.perf_counter() - t0:.0f} s"
        ),
        baseline="each batch in one pass padded to its longest text",
        candidate="each batch as length buckets (fl.data.tokenized.length_chunks)",
        ratio=spread["median"],
        ratio_kind="time",
        details=details,
        spread=spread,
    )
