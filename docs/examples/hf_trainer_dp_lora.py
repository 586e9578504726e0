"""DP fine-tuning of a PEFT LoRA adapter with the Hugging Face Trainer and Opacus, audited.

    python docs/examples/hf_trainer_dp_lora.py [--out DIR] [--steps 60] [--sigma 1.0]
                                               [--records 480] [--batch 16] [--canaries 32]

The recipe (docs/audit_hf_trainer.md):

1. a tiny BERT classifier from a config (no download) with PEFT LoRA on query/value, and
   synthetic token records as dicts (``input_ids``, ``attention_mask``, ``labels``);
2. sampler canaries (:class:`audit.libraries.opacus.SamplerCanaries`): canary records in the
   train set (:class:`CanaryRecords`, a ``canary_id`` column) and the canary block in the
   model (:class:`CanaryClassifier`, what ``make_private`` wraps);
3. Opacus's ``make_private``: a ``GradSampleModule``, a ``DPOptimizer`` and a Poisson
   ``DPDataLoader``; the Trainer gets the DP optimizer (``optimizers=(opt, None)``) and the
   Poisson loader (:class:`OpacusTrainer`), ``remove_unused_columns=False`` (Opacus's
   ``GradSampleModule.forward(*args, **kwargs)`` names no column) and
   ``logging_strategy="no"`` (the Trainer's logged ``grad_norm`` is the non-private
   gradient's norm), and torch's generator, which the Trainer seeded with ``args.seed`` and
   from which Opacus draws its noise, reseeded from the OS's entropy;
4. :class:`OpacusAuditCallback` audits the run at the end of training against the claim
   the PrivacyEngine makes, writes ``<out>/library_audit.json`` and logs the verdict.

The exit code is the audit's: 0 pass, 1 a finding. One CPU core, seconds.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, Path(__file__).resolve().parent):  # run from a checkout without installing
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def records(n: int, vocab: int, seed: int) -> list[dict]:
    """opacus_peft_audit.synthetic_data's token records, as the dicts the Trainer's
    collators take."""
    from opacus_peft_audit import synthetic_data

    x, mask, y = synthetic_data(n, vocab=vocab, seed=seed).tensors
    return [{"input_ids": x[i], "attention_mask": mask[i], "labels": y[i]} for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the Trainer's output_dir (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer (noised) steps")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--records", type=int, default=480)
    ap.add_argument("--batch", type=int, default=16, help="expected Poisson batch")
    ap.add_argument("--canaries", type=int, default=32)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument(
        "--seed", type=int, default=0, help="model, data, Opacus's draws (not the canaries)"
    )
    ap.add_argument(
        "--noise-seed",
        type=int,
        default=None,
        help="seed Opacus's noise (tests; default: the OS's entropy)",
    )
    ap.add_argument(
        "--canary-seed",
        type=int,
        default=None,
        help="seed the canaries' inclusion bits (tests; a real audit draws them from the OS)",
    )
    a = ap.parse_args(argv)

    import torch
    from opacus import PrivacyEngine
    from opacus_peft_audit import build_model
    from transformers import TrainingArguments, default_data_collator
    from transformers.utils import logging as hf_logging

    from audit.libraries.hf_trainer import (
        FILENAME,
        CanaryClassifier,
        CanaryRecords,
        OpacusAuditCallback,
        OpacusTrainer,
    )
    from audit.libraries.opacus import SamplerCanaries

    warnings.filterwarnings("ignore", module="opacus")
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    out = Path(a.out or tempfile.mkdtemp(prefix="hf-trainer-dp-lora-"))

    # 1-2: the user's model and records, with the sampler canaries (inclusion bits from the
    # OS's entropy: keep them secret until the audit)
    can = SamplerCanaries(m=a.canaries, seed=a.canary_seed)
    train = CanaryRecords(records(a.records, a.vocab, a.seed), can)
    held_out = records(128, a.vocab, a.seed + 1)
    peft_model = build_model(seed=a.seed, vocab=a.vocab)
    # a model from from_pretrained is in eval mode, where Opacus records no activations;
    # the Trainer's training_step calls model.train() on every step (and evaluation's
    # model.eval() is undone the same way): shown here by starting in eval mode
    peft_model.eval()
    model = CanaryClassifier(peft_model, can)

    # 3: Opacus (Poisson sampling, flat clipping) on the model, the optimizer, the loader
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    loader = torch.utils.data.DataLoader(
        train, batch_size=a.batch, collate_fn=default_data_collator
    )
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=a.sigma,
        max_grad_norm=a.clip,
        poisson_sampling=True,
    )
    audit = OpacusAuditCallback(can, engine, opt, loader, delta=a.delta)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,  # Opacus's Poisson sampling forbids accumulation
        learning_rate=0.05,
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        label_names=["labels"],  # the Trainer finds none in GradSampleModule.forward
        logging_strategy="no",
        eval_strategy="steps",  # an evaluation mid-training (model.eval(), then .train())
        eval_steps=max(1, a.steps // 2),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=a.seed,
    )
    trainer = OpacusTrainer(
        model=model,
        args=args,
        train_dataloader=loader,
        eval_dataset=held_out,
        data_collator=default_data_collator,
        optimizers=(opt, None),
        callbacks=[audit],
    )
    # the Trainer seeded torch's generator with args.seed, and Opacus draws its noise and
    # Poisson coins from it: reseed it from the OS's entropy (a public seed is no secret)
    torch.manual_seed(a.noise_seed if a.noise_seed is not None else secrets.randbits(63))
    trainer.train()  # 4: the audit runs at the end of training
    res = audit.result
    acc = trainer.evaluate()
    print(
        f"trained {res['run']['steps']} Opacus steps at q = {res['run']['sample_rate']:.4g}, "
        f"σ = {res['run']['noise_multiplier']}: claimed ε = {res['claimed_epsilon']:.3f} "
        f"(Opacus's accountant), recomputed ε = {res['recomputed_epsilon']:.3f}, one-run ε "
        f"lower bound = {res['epsilon_lower_bound']}, held-out loss {acc['eval_loss']:.3f}"
    )
    print(f"verdict: {res['verdict']}; findings: {[f['code'] for f in res['findings']]}")
    print(f"wrote {out / FILENAME}")
    return res["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
