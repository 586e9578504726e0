"""Benchmark 2: FedASK's W-space clipping vs B-space clipping vs no DP.

FedASK's DP mode trains B (and the head) with A fixed. Three local trainings on one
shared ``LocalTrainer`` with the same batches:
- none: plain backward (trainable B + head);
- b-space: Opacus per-sample gradients of B and head, flat clipping + noise
  (``fl.privacy.dpsgd.clip_and_noise``) — FedASK's ``clip_space=b``;
- w-space: per-sample ‖∂l/∂W‖ by the Gram identity from captured activations, noise
  in W-space projected by s·Aᵀ (``fl.privacy.wspace.WSpaceClipper``) — the paper's.
The reported ratio is W-space / B-space (time); both DP variants over no DP are in
``details``.
"""

from __future__ import annotations

import importlib.util

import torch

from benchmarks.perf import harness
from benchmarks.perf.dp_overhead import bench_streams, dp_params, make_trainer

NAME = "fedask_clip"


def available() -> str | None:
    """None if FedASK and the W-space clipper exist, else why not."""
    for mod in ("fl.methods.fedask", "fl.privacy.wspace"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} does not exist yet"
    return None


def run(quick: bool, device: str = "cpu") -> dict:
    why = available()
    if why:
        return harness.not_available(NAME, why)
    from fl.privacy.wspace import WSpaceClipper

    model = "tiny-bert" if quick else "minilm"
    steps, reps, bs, seq = (1, 2, 16, 32) if quick else (2, 3, 32, 64)
    n = bs * 10
    trainer, data, pos, start = make_trainer(model, bs, seq, n, device=device)
    dp = dp_params(bs, n)
    trainable = {"B", "head"}
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def none():
        trainer.train(
            start,
            data,
            pos,
            steps,
            trainable,
            None,
            streams=bench_streams("fedask"),
            dropout_seed=0,
        )
        sync()

    def bspace():
        trainer.train(
            start, data, pos, steps, trainable, dp, streams=bench_streams("fedask"), dropout_seed=0
        )
        sync()

    def wspace():
        with WSpaceClipper.from_model(trainer.model, trainer.scaling) as gt:
            trainer.train(
                start,
                data,
                pos,
                steps,
                trainable,
                dp,
                streams=bench_streams("fedask"),
                dropout_seed=0,
                grad_transform=gt,
            )
        sync()

    times = harness.interleaved({"none": none, "b": bspace, "w": wspace}, reps=reps, warmup=1)
    w_over_b = harness.paired_ratio(times["b"], times["w"])
    details = {
        "model": model,
        "steps_per_rep": steps,
        "none_step": harness.summarize(times["none"], steps),
        "bspace_step": harness.summarize(times["b"], steps),
        "wspace_step": harness.summarize(times["w"], steps),
        "bspace_over_none": harness.paired_ratio(times["none"], times["b"]),
        "wspace_over_none": harness.paired_ratio(times["none"], times["w"]),
        "wspace_over_bspace": w_over_b,
    }
    return harness.result(
        NAME,
        workload=(
            f"LocalTrainer.train on {model}, trainable B + head (A fixed, FedASK DP mode), "
            f"{steps} steps per repetition, expected batch {bs}, sequence {seq}; "
            f"{reps} interleaved repetitions of none / B-space / W-space"
        ),
        baseline="B-space DP-SGD clipping (Opacus per-sample grads of B and head)",
        candidate="W-space clipping (Gram-identity per-sample norms, W-space noise)",
        ratio=w_over_b["median"],
        ratio_kind="time",
        target=None,
        met=None,
        details=details,
        spread=w_over_b,
    )
