"""Benchmark: the keyed CSPRNG noise streams vs torch's seeded generator, per DP-SGD step.

Both sides run ``fl.run.engine.LocalTrainer.train`` with DP on (sample level, σ=1, C=1;
Opacus per-sample grads of LoRA A, B and head) on ONE shared trainer (the trainer of
``dp_overhead``: same model, same data, same dropout seed); the only difference is
``streams``:

- baseline: ``fl.privacy.rng.SeededSource(seed, parts)`` for the noise and the Poisson
  batches (torch's generator; ``--insecure-deterministic-noise``);
- candidate: ``NoiseKey.generate().stream(...)`` (AES-256-CTR keystream, Box–Muller in
  float64) — the default of a private run.

Streams are created inside every timed call, as the engine creates them per client and
stage. Workload: Poisson rate q = 0.1 over n = 10·batch examples (batch 32, sequence
length 64, like ``dp_overhead``). The two generators give different Poisson batches, and
a batch of 28 against one of 36 would swamp a 1% difference, so each side uses the first
stream name whose Poisson batches have exactly ``batch`` examples at every step: both
sides then do the same amount of model work on every step.

``details`` also times the draws alone, interleaved keyed/seeded: the noise of one step
(one Gaussian draw per trainable parameter through ``fl.privacy.dpsgd.gaussian_noise``,
as ``clip_and_noise`` does) and its Poisson mask (n uniforms), in microseconds, with the
number of noise coordinates per step and the cost of creating a stream; and
``ratio_from_draws`` = 1 + (keyed − seeded draw time) / seeded step time, a low-noise
estimate of the same ratio.
"""

from __future__ import annotations

import torch

from benchmarks.perf import harness
from benchmarks.perf.dp_overhead import dp_params, make_trainer, precision_autocast

NAME = "noise_source"
TARGET = 1.02  # keyed-CSPRNG DP step / seeded-generator DP step on minilm
SEED = 0  # the baseline's public seed


def trainable_params(trainer, trainable) -> list[torch.nn.Parameter]:
    """The parameters ``LocalTrainer.train`` trains (and noises) for ``trainable``, in its
    order: LoRA factors, then the head."""
    params = [p for ab in trainer.lora.values() for w, p in ab.items() if w in trainable]
    if "head" in trainable:
        params += list(trainer.head.values())
    return params


def keyed_factory(key):
    def make(*name):
        return key.stream("dpsgd-noise", *name), key.stream("poisson-batches", *name)

    return make


def seeded_factory(seed: int):
    from fl.privacy.rng import SeededSource

    def make(*name):
        return (
            SeededSource(seed, ("dpsgd-noise", *name)),
            SeededSource(seed, ("poisson-batches", *name)),
        )

    return make


def matched_name(make, base: tuple, n: int, q: float, steps: int, size: int) -> tuple:
    """The first stream name ``base + (i,)`` whose Poisson batches (as ``train`` draws
    them) have exactly ``size`` examples at each of ``steps`` steps."""
    from fl.run.engine import poisson_masks

    for i in range(100_000):
        name = (*base, i)
        masks = poisson_masks(make(*name)[1], n, q, steps)
        if all(int(m.sum()) == size for m in masks):
            return name
    raise RuntimeError(f"no stream name gives {steps} Poisson batches of {size} of {n}")


def measure_draws(
    params, std: float, n: int, q: float, sources: dict, reps: int, inner: int, sync=None
):
    """Microseconds per step of the noise draws (every parameter) and of the Poisson mask,
    per source, interleaved; plus stream creation."""
    from fl.privacy import rng as R
    from fl.privacy.dpsgd import gaussian_noise

    shapes = [(tuple(p.shape), p.dtype, p.device) for p in params]

    def noise_fn(src):
        def f():
            for _ in range(inner):
                for shape, dtype, dev in shapes:
                    gaussian_noise(shape, std, src, dtype, dev)
            if sync is not None:
                sync()

        return f

    def mask_fn(src):
        def f():
            for _ in range(inner):
                R.bernoulli_mask(src, n, q)

        return f

    def make_fn(make):
        def f():
            for i in range(inner):
                make("bench-draw", i)

        return f

    out: dict = {}
    fns = {}
    for side, make in sources.items():
        noise_src, batch_src = make("bench-draw")
        fns[f"{side}/noise"] = noise_fn(noise_src)
        fns[f"{side}/mask"] = mask_fn(batch_src)
        fns[f"{side}/streams"] = make_fn(make)
    times = harness.interleaved(fns, reps=reps, warmup=2)
    for side in sources:
        noise = harness.summarize(times[f"{side}/noise"], inner / 1e6)
        mask = harness.summarize(times[f"{side}/mask"], inner / 1e6)
        streams = harness.summarize(times[f"{side}/streams"], inner / 1e6)
        out[side] = {
            "noise_us": noise["median_s"],
            "mask_us": mask["median_s"],
            "step_draw_us": noise["median_s"] + mask["median_s"],
            "two_streams_us": streams["median_s"],
            "noise_min_us": noise["min_s"],
        }
    out["noise_ratio"] = harness.paired_ratio(times["seeded/noise"], times["keyed/noise"])
    return out


def measure(
    model: str,
    steps: int,
    reps: int,
    draw_reps: int,
    batch_size: int = 32,
    seq: int = 64,
    device: str = "cpu",
    trainable=("A", "B", "head"),
) -> dict:
    """Seconds per DP step with seeded and keyed streams (interleaved), their ratio, and
    the draw costs."""
    from fl.privacy.rng import NoiseKey

    n = batch_size * 10
    trainer, data, pos, start = make_trainer(model, batch_size, seq, n, device=device)
    dp = dp_params(batch_size, n)
    q = dp.sample_rate
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sources = {"seeded": seeded_factory(SEED), "keyed": keyed_factory(NoiseKey.generate())}
    names = {
        side: matched_name(make, ("bench", model), n, q, steps, batch_size)
        for side, make in sources.items()
    }

    def run(side: str):
        make, name = sources[side], names[side]

        def f():
            with precision_autocast(device):
                trainer.train(
                    start,
                    data,
                    pos,
                    steps,
                    set(trainable),
                    dp,
                    streams=make(*name),
                    dropout_seed=0,
                )
            sync()

        return f

    times = harness.interleaved({"seeded": run("seeded"), "keyed": run("keyed")}, reps, warmup=1)
    spread = harness.paired_ratio(times["seeded"], times["keyed"])
    seeded_step = harness.summarize(times["seeded"], steps)
    params = trainable_params(trainer, set(trainable))
    std = dp.noise_multiplier * dp.clip
    draws = measure_draws(params, std, n, q, sources, draw_reps, inner=5, sync=sync)
    extra = draws["keyed"]["step_draw_us"] - draws["seeded"]["step_draw_us"]
    return {
        "model": model,
        "device": device,
        "batch_size": batch_size,
        "seq_len": seq,
        "examples": n,
        "sample_rate": q,
        "steps_per_rep": steps,
        "noise_coordinates_per_step": sum(p.numel() for p in params),
        "noised_tensors_per_step": len(params),
        "seeded_step": seeded_step,
        "keyed_step": harness.summarize(times["keyed"], steps),
        "ratio": spread["median"],
        "spread": spread,
        "draws": draws,
        "ratio_from_draws": 1.0 + extra * 1e-6 / seeded_step["median_s"],
        "stream_names": {side: list(nm) for side, nm in names.items()},
    }


def run(quick: bool, device: str = "cpu") -> dict:
    models = ["tiny-bert"] if quick else ["tiny-bert", "minilm"]
    # --quick: a smoke-sized workload (the shared CI machine), same code path.
    steps, reps, draw_reps, bs, seq = (1, 2, 3, 16, 32) if quick else (1, 30, 100, 32, 64)
    per = {m: measure(m, steps, reps, draw_reps, bs, seq, device=device) for m in models}
    main = per.get("minilm") or per["tiny-bert"]
    met = (main["ratio"] <= TARGET) if "minilm" in per else None
    return harness.result(
        NAME,
        workload=(
            f"LocalTrainer.train with DP-SGD (σ=1, C=1), {steps} local step(s) per repetition, "
            f"Poisson q=0.1 over {10 * bs} examples with batches of exactly {bs} on both sides, "
            f"sequence length {seq}, LoRA r=8 on query/value + head; models "
            f"{', '.join(models)}; {reps} interleaved repetitions; draws alone: {draw_reps} "
            "interleaved repetitions of 5 steps"
        ),
        baseline="SeededSource streams (torch generator from the public seed; insecure)",
        candidate="NoiseKey streams (AES-256-CTR keystream + float64 Box-Muller)",
        ratio=main["ratio"],
        ratio_kind="time",
        target=f"keyed step <= {TARGET}x seeded step on minilm",
        met=met,
        details={"per_model": per, "ratio_model": main["model"]},
        spread=main["spread"],
    )
