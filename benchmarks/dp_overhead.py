"""Benchmark 1: DP-SGD local step vs the same step without DP.

Both sides run ``fl.engine.LocalTrainer.train`` on ONE shared trainer (same model,
same Poisson batches, same seeds); the only difference is ``dp``: per-sample
gradients through Opacus hooks for the trainable LoRA A, B and head parameters,
joint ℓ2 clipping and Gaussian noise (``fl.privacy.dpsgd.clip_and_noise``), versus
a plain backward. Workload: batch 32 (expected Poisson batch q·n = 32), sequence
length 64 (every text fills the 64 tokens), tiny-bert and minilm.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from benchmarks import harness

NAME = "dp_overhead"
TARGET = 1.05  # DP step / non-DP step on minilm (issue 20)


def make_texts(n: int, seed: int = 0, words: int = 80) -> tuple[list[str], np.ndarray]:
    """n random texts of ``words`` common English words (more than 64 WordPiece
    tokens, so truncation at 64 gives full-length sequences) and binary labels."""
    vocab = (
        "the of and to in is was for on that with as by at from his her they this which "
        "have are be one all were their there been has when who will more no if out so "
        "said what up its about into than them can only other new some could time these "
        "two may then do first any my now such like our over man me even most made after"
    ).split()
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(vocab, size=words)) for _ in range(n)]
    return texts, rng.integers(0, 2, size=n)


_CACHE: dict = {}
_KEY = None


def bench_streams(*name) -> tuple:
    """(noise, batch) streams of the run's keyed CSPRNG, as the engine uses them; the
    same name gives the same Poisson batches on every call (one key per process)."""
    global _KEY
    from fl.privacy.rng import NoiseKey

    if _KEY is None:
        _KEY = NoiseKey.generate()
    return _KEY.stream("dpsgd-noise", *name), _KEY.stream("poisson-batches", *name)


def make_trainer(model: str, batch_size: int, seq: int, n: int, rank: int = 8, device="cpu"):
    """(LocalTrainer, TokenizedData, positions, initial state) for ``model`` with n
    examples of ``seq`` tokens; the trainer's config has Poisson rate q = batch_size/n.

    Cached per arguments within the process (building a model costs more than the
    measured steps); every ``train`` call loads its start state, so sharing is safe.
    """
    key = (model, batch_size, seq, n, rank, str(device))
    if key not in _CACHE:
        _CACHE[key] = _build(model, batch_size, seq, n, rank, device)
    return _CACHE[key]


def _build(model: str, batch_size: int, seq: int, n: int, rank: int, device):
    from fl.config import TrainConfig
    from fl.engine import LocalTrainer, TokenizedData
    from fl.models import load_tokenizer

    cfg = TrainConfig(
        model=model,
        dataset="synthetic",
        max_length=seq,
        batch_size=batch_size,
        rank=rank,
        alpha=2.0 * rank,
        progress=False,
        device=str(device),
    )
    trainer = LocalTrainer(cfg, 2, torch.device(device))
    texts, labels = make_texts(n)
    data = TokenizedData(texts, labels, load_tokenizer(model), seq)
    return trainer, data, np.arange(n), trainer.initial_state()


def dp_params(batch_size: int, n: int, sigma: float = 1.0, clip: float = 1.0):
    from fl.privacy.dpsgd import DpSgdParams

    q = min(1.0, batch_size / n)
    return DpSgdParams(sigma, clip, q, q * n)


def _is_bf16(device: str) -> bool:
    return device.startswith("cuda") and os.environ.get("FEDLORA_BENCH_BF16") == "1"


def _autocast(device: str):
    """bf16 autocast on CUDA when FEDLORA_BENCH_BF16=1 (GPU script); else a no-op."""
    if _is_bf16(device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def measure(
    model: str,
    steps: int,
    reps: int,
    batch_size: int = 32,
    seq: int = 64,
    device: str = "cpu",
    trainable=("A", "B", "head"),
) -> dict:
    """Seconds per local step with and without DP (interleaved) and their ratio."""
    n = batch_size * 10
    trainer, data, pos, start = make_trainer(model, batch_size, seq, n, device=device)
    dp = dp_params(batch_size, n)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(with_dp: bool):
        def f():
            with _autocast(device):
                trainer.train(
                    start,
                    data,
                    pos,
                    steps,
                    set(trainable),
                    dp if with_dp else None,
                    streams=bench_streams("bench", model),
                    dropout_seed=0,
                )
            sync()

        return f

    times = harness.interleaved({"nodp": run(False), "dp": run(True)}, reps=reps, warmup=1)
    spread = harness.paired_ratio(times["nodp"], times["dp"])
    return {
        "model": model,
        "device": device,
        "precision": "bf16" if _is_bf16(device) else "fp32",
        "batch_size": batch_size,
        "seq_len": seq,
        "steps_per_rep": steps,
        "nodp_step": harness.summarize(times["nodp"], steps),
        "dp_step": harness.summarize(times["dp"], steps),
        "ratio": spread["median"],
        "spread": spread,
    }


def run(quick: bool, device: str = "cpu") -> dict:
    models = ["tiny-bert"] if quick else ["tiny-bert", "minilm"]
    # The GPU script adds a BERT-base-sized model folder (comma-separated names/paths).
    if not quick and os.environ.get("FEDLORA_BENCH_DP_MODELS"):
        models = [m for m in os.environ["FEDLORA_BENCH_DP_MODELS"].split(",") if m]
    # --quick: a smoke-sized workload (the shared CI machine), same code path.
    steps, reps, bs, seq = (1, 2, 16, 32) if quick else (2, 5, 32, 64)
    per = {m: measure(m, steps, reps, bs, seq, device=device) for m in models}
    main = per.get("minilm") or per["tiny-bert"]
    met = (main["ratio"] <= TARGET) if "minilm" in per else None
    return harness.result(
        NAME,
        workload=(
            f"LocalTrainer.train, {steps} local steps per repetition, Poisson batch of expected "
            f"size {bs}, sequence length {seq}, LoRA r=8 on query/value + head, AdamW; models "
            f"{', '.join(models)}; {reps} interleaved repetitions"
        ),
        baseline="the same local steps without DP (plain backward)",
        candidate="DP-SGD (Opacus per-sample grads, joint clipping C=1, noise σ=1)",
        ratio=main["ratio"],
        ratio_kind="time",
        target=f"DP step <= {TARGET}x non-DP step on minilm",
        met=met,
        details={"per_model": per, "ratio_model": main["model"]},
        spread=main["spread"],
    )
