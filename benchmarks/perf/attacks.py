"""Benchmark 5: attack costs — seconds per shadow model, signal extraction throughput.

Shadow models: ``attacks.reference.train_shadows`` (k = 2 shadows, each a fedlora
run on half of a pool of synthetic examples, written to a local JSONL dataset)
versus the baseline ``fl.run.engine.train`` of the same configuration and sizes directly
on the built-in dataset; ratio = seconds per shadow / seconds of the plain run, i.e.
the shadow pipeline's overhead (pool split, JSONL, split check) on top of training.

Signal extraction: ``attacks.signals.adapter_signals`` end to end (load the base model
and the adapter, tokenize, batched forward, per-example signals) on the members and
non-members of a trained run, in examples per second; its baseline is the bare
batched forward of the already loaded model on pre-tokenized batches. The headline
ratio is the shadow one; the signal figures are in ``details.signals``.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.perf import harness

NAME = "attacks"


def available() -> str | None:
    for mod in ("attacks.signals", "attacks.reference", "attacks.run"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} does not exist yet"
    return None


def _cfg(quick: bool, members: int, test: int, device: str):
    from fl.run.config import TrainConfig

    return TrainConfig(
        model="tiny-bert",
        dataset="synthetic",
        members=members,
        nonmembers=0,
        test=test,
        max_length=16 if quick else 32,
        clients=2 if quick else 3,
        rounds=1 if quick else 2,
        local_steps=1 if quick else 5,
        batch_size=16,
        rank=4,
        alpha=8.0,
        eval_every=1 if quick else 2,
        progress=False,
        device=device,
    )


def run(quick: bool, device: str = "cpu") -> dict:
    why = available()
    if why:
        return harness.not_available(NAME, why)
    from attacks.reference import train_shadows
    from attacks.signals import adapter_signals, load_adapter_model, model_logits
    from fl.data.datasets import load_dataset
    from fl.models.base import load_tokenizer
    from fl.run.engine import train

    pool_n = 80 if quick else 400
    half = pool_n // 2
    reps = 1 if quick else 2
    cfg = _cfg(quick, half, pool_n - half, device)
    ds = load_dataset("synthetic")
    ids, texts, labels = ds.ids[:pool_n], ds.texts[:pool_n], ds.labels[:pool_n]
    with tempfile.TemporaryDirectory(prefix="fedlora-bench-attacks-") as tmp:
        tmp = Path(tmp)
        counter = iter(range(10**6))

        def plain():
            train(cfg, tmp / f"plain{next(counter)}", quiet=True)

        def shadows():
            train_shadows(
                cfg,
                ids,
                texts,
                labels,
                2,
                tmp / f"shadows{next(counter)}",
                device=device,
                progress=False,
                num_labels=ds.num_classes,
            )

        times = harness.interleaved({"plain": plain, "shadows": shadows}, reps=reps, warmup=0)
        per_shadow = [t / 2 for t in times["shadows"]]
        spread = harness.paired_ratio(times["plain"], per_shadow)

        # Signal extraction on the adapter of the first plain run.
        run_dir = tmp / "plain0"
        n_sig = 128 if quick else 1024
        sig_texts = (texts * (n_sig // len(texts) + 1))[:n_sig]
        sig_labels = np.resize(np.asarray(labels), n_sig)
        adapter = run_dir / "adapter"

        def extract():
            adapter_signals(
                adapter,
                "tiny-bert",
                sig_texts,
                sig_labels,
                cfg.max_length,
                device=device,
                seed=cfg.seed,
                num_labels=ds.num_classes,
                progress=False,
            )

        model = load_adapter_model(
            adapter, "tiny-bert", ds.num_classes, seed=cfg.seed, device=device
        )
        tok = load_tokenizer("tiny-bert")

        def forward():
            model_logits(model, tok, sig_texts, cfg.max_length, device)

        st = harness.interleaved(
            {"forward": forward, "extract": extract}, reps=reps + 1, warmup=0 if quick else 1
        )
    sig = {
        "examples": n_sig,
        "extract_examples_per_s": n_sig / float(np.median(st["extract"])),
        "forward_examples_per_s": n_sig / float(np.median(st["forward"])),
        "extract_over_forward": harness.paired_ratio(st["forward"], st["extract"]),
    }
    return harness.result(
        NAME,
        workload=(
            f"tiny-bert, pool of {pool_n} synthetic examples, shadows on halves of {half} "
            f"({cfg.clients} clients, {cfg.rounds} round(s), {cfg.local_steps} local steps); "
            f"signals on {n_sig} examples; {reps} interleaved repetition(s)"
        ),
        baseline="fl.run.engine.train of the same configuration and sizes (one plain run)",
        candidate="one shadow model of attacks.reference.train_shadows (k=2, per shadow)",
        ratio=spread["median"],
        ratio_kind="time",
        target=None,
        met=None,
        details={
            "seconds_per_shadow": harness.summarize(per_shadow),
            "seconds_plain_run": harness.summarize(times["plain"]),
            "signals": sig,
        },
        spread=spread,
    )
