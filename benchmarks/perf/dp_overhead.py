"""Benchmark 1: DP-SGD local step vs the same step without DP.

All sides run ``fl.run.engine.LocalTrainer`` on ONE shared trainer (same model, same
Poisson batches, same seeds), interleaved:

- ``nodp``: the local steps without DP (plain backward);
- ``dp``: DP-SGD as the engine runs it: per-sample gradients through Opacus hooks for
  the trainable LoRA A, B and head parameters, then the fused clipping and noise step
  (``fl.privacy.dpsgd.clip_and_noise``: one per-example norm over all parameters, one
  matrix-vector product, one noise vector, no host synchronization);
- ``dp_per_parameter``: the same with the per-parameter clipping and noise it replaced
  (``clip_and_noise_per_parameter``), the "before" of the same run.

Ratios: dp / nodp (the headline), dp_per_parameter / nodp, dp / dp_per_parameter.
``noise_draw`` is the keyed CSPRNG noise of one step alone (``flat_noise``). Workload:
batch 32 (expected Poisson batch q·n = 32), sequence length 64 (every text fills the
64 tokens), the default LoRA set-up (rank 8 on query/value of the top
``TrainConfig.lora_layers`` layers over the frozen-prefix cache, and the head);
tiny-bert and minilm on the CPU; on CUDA minilm and ``bert-base-random`` (BERT-base
sized, 110M parameters, random weights built here from a config: no download), in fp32,
or bf16 autocast, or both in the same run (``FEDLORA_BENCH_PRECISIONS=fp32,bf16``, as
``benchmarks/gpu/gpu_dp_step.sh`` runs it). On CUDA each case also counts the host
synchronizations (``torch.cuda.set_sync_debug_mode``) inside the DP step's privatizer
and in a whole local training.

Environment: ``FEDLORA_BENCH_DP_MODELS`` (comma-separated names or folders),
``FEDLORA_BENCH_PRECISIONS`` (``fp32,bf16``; ``FEDLORA_BENCH_BF16=1`` means bf16 only),
``FEDLORA_BENCH_DP_LORA_LAYERS`` (LoRA on the top N layers, 0 = all).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import numpy as np
import torch

from benchmarks.perf import harness

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


def make_trainer(
    model: str,
    batch_size: int,
    seq: int,
    n: int,
    rank: int = 8,
    device="cpu",
    lora_layers: int | None = None,
):
    """(LocalTrainer, TokenizedData, positions, initial state) for ``model`` with n
    examples of ``seq`` tokens; the trainer's config has Poisson rate q = batch_size/n
    and LoRA on the top ``lora_layers`` layers (None: the TrainConfig default).

    Cached per arguments within the process (building a model costs more than the
    measured steps); every ``train`` call loads its start state, so sharing is safe.
    """
    key = (model, batch_size, seq, n, rank, str(device), lora_layers)
    if key not in _CACHE:
        _CACHE[key] = _build(model, batch_size, seq, n, rank, device, lora_layers)
    return _CACHE[key]


def _build(model: str, batch_size: int, seq: int, n: int, rank: int, device, lora_layers):
    from fl.models.base import load_tokenizer
    from fl.run.config import TrainConfig
    from fl.run.engine import LocalTrainer, TokenizedData

    path = bert_base_random() if model == "bert-base-random" else model
    extra = {} if lora_layers is None else {"lora_layers": lora_layers}
    cfg = TrainConfig(
        model=path,
        dataset="synthetic",
        max_length=seq,
        batch_size=batch_size,
        rank=rank,
        alpha=2.0 * rank,
        progress=False,
        device=str(device),
        **extra,
    )
    trainer = LocalTrainer(cfg, 2, torch.device(device))
    texts, labels = make_texts(n)
    data = TokenizedData(texts, labels, load_tokenizer(path), seq)
    return trainer, data, np.arange(n), trainer.initial_state()


_BERT_BASE: list = []


def bert_base_random() -> str:
    """A BERT-base-sized classifier folder (hidden 768, 12 layers, 12 heads, FFN 3072:
    ~110M parameters) with seeded random weights and minilm's offline WordPiece
    vocabulary, built once per process in a temporary folder (nothing downloaded)."""
    if not _BERT_BASE:
        from transformers import BertConfig, BertForSequenceClassification

        from fl.models.base import load_tokenizer

        tmp = tempfile.TemporaryDirectory(prefix="fedlora-bert-base-random-")
        tok = load_tokenizer("minilm")
        cfg = BertConfig(
            vocab_size=tok.vocab_size,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            num_labels=2,
        )
        torch.manual_seed(0)
        BertForSequenceClassification(cfg).save_pretrained(tmp.name)
        tok.save_pretrained(tmp.name)
        _BERT_BASE.append(tmp)  # kept (and removed) with the process
    return _BERT_BASE[0].name


def dp_params(batch_size: int, n: int, sigma: float = 1.0, clip: float = 1.0):
    from fl.privacy.dpsgd import DpSgdParams

    q = min(1.0, batch_size / n)
    return DpSgdParams(sigma, clip, q, q * n)


def precisions(device: str) -> list[str]:
    """fp32 (``FEDLORA_BENCH_BF16=1`` on CUDA: bf16); ``FEDLORA_BENCH_PRECISIONS=fp32,bf16``
    measures both in one run (``benchmarks/gpu/gpu_dp_step.sh``)."""
    env = os.environ.get("FEDLORA_BENCH_PRECISIONS")
    if env:
        out = [p for p in env.split(",") if p]
        bad = [p for p in out if p not in ("fp32", "bf16")]
        if bad or (not device.startswith("cuda") and "bf16" in out):
            raise ValueError(f"FEDLORA_BENCH_PRECISIONS: {env!r} (fp32, bf16; bf16 on CUDA)")
        return out
    if not device.startswith("cuda"):
        return ["fp32"]
    return ["bf16"] if os.environ.get("FEDLORA_BENCH_BF16") == "1" else ["fp32"]


def precision_autocast(device: str, precision: str | None = None):
    """bf16 autocast on CUDA for precision bf16 (None: bf16 when FEDLORA_BENCH_BF16=1 on
    CUDA); else a no-op."""
    if precision is None:
        cuda = device.startswith("cuda")
        precision = "bf16" if cuda and os.environ.get("FEDLORA_BENCH_BF16") == "1" else "fp32"
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


class PerParameter:
    """The privatizer of DP-SGD before the fused step: the per-parameter path
    (``fl.privacy.dpsgd.clip_and_noise_per_parameter``), same noise stream."""

    per_sample = True

    def __init__(self, dp, noise):
        self.dp, self.noise = dp, noise

    def __call__(self, params, batch_size: int) -> dict:
        from fl.privacy.dpsgd import clip_and_noise_per_parameter

        if batch_size == 0:
            for p in params:
                p.grad_sample = None
        return clip_and_noise_per_parameter(params, self.dp, self.noise, batch_size)


def measure(
    model: str,
    steps: int,
    reps: int,
    batch_size: int = 32,
    seq: int = 64,
    device: str = "cpu",
    trainable=("A", "B", "head"),
    precision: str = "fp32",
    lora_layers: int | None = None,
) -> dict:
    """Seconds per local step without DP, with the fused DP step and with the
    per-parameter DP step (interleaved), their ratios, and the noise draw alone."""
    n = batch_size * 10
    trainer, data, pos, start = make_trainer(
        model, batch_size, seq, n, device=device, lora_layers=lora_layers
    )
    dp = dp_params(batch_size, n)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(kind: str):
        def f():
            streams = bench_streams("bench", model)
            with precision_autocast(device, precision):
                if kind == "dp_per_parameter":
                    trainer.run(
                        start, data, pos, steps, set(trainable), PerParameter(dp, streams[0]),
                        [], streams[1], 0,
                    )  # fmt: skip
                else:
                    trainer.train(
                        start, data, pos, steps, set(trainable), dp if kind == "dp" else None,
                        streams=streams, dropout_seed=0,
                    )  # fmt: skip
            sync()

        return f

    kinds = ("nodp", "dp", "dp_per_parameter")
    times = harness.interleaved({k: run(k) for k in kinds}, reps=reps, warmup=1)
    spread = harness.paired_ratio(times["nodp"], times["dp"])
    before = harness.paired_ratio(times["nodp"], times["dp_per_parameter"])
    fused = harness.paired_ratio(times["dp_per_parameter"], times["dp"])
    out = {
        "model": model,
        "device": device,
        "precision": precision,
        "lora_layers": trainer.cfg.lora_layers,
        "batch_size": batch_size,
        "seq_len": seq,
        "steps_per_rep": steps,
        "nodp_step": harness.summarize(times["nodp"], steps),
        "dp_step": harness.summarize(times["dp"], steps),
        "dp_per_parameter_step": harness.summarize(times["dp_per_parameter"], steps),
        "ratio": spread["median"],
        "spread": spread,
        "per_parameter_over_nodp": before,
        "fused_over_per_parameter": fused,
        "noise_draw": _noise_draw(trainer, trainable, dp, device, reps=max(5, 4 * reps)),
    }
    if device.startswith("cuda"):
        out["host_syncs"] = _count_syncs(trainer, start, data, pos, steps, trainable, dp)
    return out


def _noise_draw(trainer, trainable, dp, device: str, reps: int) -> dict:
    """Seconds of one step's noise alone (``flat_noise`` over the trainable parameters,
    the keyed stream created once per call as the engine does per client) and its
    number of coordinates."""
    from fl.privacy.dpsgd import flat_noise

    params = trainer._set_trainable(set(trainable))
    std = dp.noise_multiplier * dp.clip
    dev = torch.device(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def draw():
        flat_noise(params, std, bench_streams("noise-draw")[0], dev)
        sync()

    draw()
    secs = [harness.timed(draw) for _ in range(reps)]
    return {**harness.summarize(secs, 1), "coordinates": sum(p.numel() for p in params)}


def _count_syncs(trainer, start, data, pos, steps, trainable, dp) -> dict:
    """Host synchronizations CUDA reports (``set_sync_debug_mode("warn")``) inside the
    DP step's privatizer, and in one whole DP local training (the data transfer and
    the model's own checks included)."""
    from fl.run import local_step as T

    inner = T.DpSgd.__call__
    counts = {"privatizer": 0, "local_training": 0}

    def counted(self, params, b):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                return inner(self, params, b)
            finally:
                counts["privatizer"] += sum("synchroniz" in str(x.message) for x in w)

    T.DpSgd.__call__ = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            trainer.train(
                start, data, pos, steps, set(trainable), dp,
                streams=bench_streams("sync-check"), dropout_seed=0,
            )  # fmt: skip
            counts["local_training"] = sum("synchroniz" in str(x.message) for x in w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        T.DpSgd.__call__ = inner
    counts["local_training"] += counts["privatizer"]
    counts["steps"] = steps
    return counts


def run(quick: bool, device: str = "cpu") -> dict:
    cuda = device.startswith("cuda")
    models = (
        ["tiny-bert"]
        if quick
        else (["minilm", "bert-base-random"] if cuda else ["tiny-bert", "minilm"])
    )
    if not quick and os.environ.get("FEDLORA_BENCH_DP_MODELS"):
        models = [m for m in os.environ["FEDLORA_BENCH_DP_MODELS"].split(",") if m]
    layers_env = os.environ.get("FEDLORA_BENCH_DP_LORA_LAYERS")
    lora_layers = int(layers_env) if layers_env else None
    # --quick: a smoke-sized workload (the shared CI machine), same code path.
    steps, reps, bs, seq = (1, 2, 16, 32) if quick else (2, 5, 32, 64)
    if cuda and not quick:
        steps, reps = 5, 10  # a GPU step takes milliseconds
    t0 = time.perf_counter()
    cases = [
        measure(m, steps, reps, bs, seq, device=device, precision=p, lora_layers=lora_layers)
        for m in models
        for p in precisions(device)
    ]
    per = {}
    for c in cases:
        per.setdefault(c["model"], c)
    main = per.get("minilm") or cases[0]
    met = (main["ratio"] <= TARGET) if ("minilm" in per and not cuda) else None
    return harness.result(
        NAME,
        workload=(
            f"LocalTrainer.train, {steps} local steps per repetition, Poisson batch of expected "
            f"size {bs}, sequence length {seq}, LoRA r=8 on query/value of the top "
            f"{main['lora_layers'] or 'all'} layers + head, AdamW; models {', '.join(models)}; "
            f"precisions {', '.join(precisions(device))}; {reps} interleaved repetitions of "
            f"three sides (no DP, fused DP step, per-parameter DP step); "
            f"{time.perf_counter() - t0:.0f} s"
        ),
        baseline="the same local steps without DP (plain backward)",
        candidate="DP-SGD (Opacus per-sample grads, fused joint clipping C=1 and noise σ=1)",
        ratio=main["ratio"],
        ratio_kind="time",
        target=f"DP step <= {TARGET}x non-DP step on minilm (CPU)",
        met=met,
        details={"per_model": per, "cases": cases, "ratio_model": main["model"]},
        spread=main["spread"],
    )
