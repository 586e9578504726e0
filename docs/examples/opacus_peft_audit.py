"""Audit an Opacus-trained PEFT LoRA adapter with gradient canaries, end to end.

    python docs/examples/opacus_peft_audit.py [--work DIR] [--canaries 2000] [--steps 8]
                                             [--sigma 1.0] [--records 64] [--batch 16]

1. builds a tiny BERT classifier from a config (no download) and wraps it with PEFT LoRA;
2. writes its trainable parameters and makes a canary set:
   ``fedlora canaries new --kind gradient --count M --params params.json --clip C --out DIR``;
3. trains it with Opacus DP-SGD (Poisson sampling) on synthetic data, with the canaries
   added by ``audit.canaries.hooks.GradientCanaryHook.attach_opacus``, and writes the observations;
4. writes the claim Opacus's accountant makes (``claim.toml``) and runs
   ``fedlora audit --canaries DIR --observations obs.npz --claim claim.toml``,
   printing the certified lower bound on ε next to the claimed ε.

The exit code is the audit's: 0 consistent, 1 leaks more than claimed, 2 bad input, 4 incomplete
(a part of the mechanism untested: here the training's own sampler is not observed).
Everything runs on the CPU in seconds at the default size (docs/audit.md, "Auditing a
training done elsewhere").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def build_model(seed: int = 0, vocab: int = 200, rank: int = 8):
    """A tiny BERT sequence classifier (2 classes) with LoRA on query/value and a trained
    classifier head, in train mode (Opacus records activations only in train mode)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    net = BertForSequenceClassification(cfg)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=["query", "value"],
        lora_dropout=0.0,
        modules_to_save=["classifier"],
        init_lora_weights="gaussian",
    )
    model = get_peft_model(net, lora)
    model.train()
    return model


def synthetic_data(n: int, length: int = 16, vocab: int = 200, seed: int = 0):
    """n token sequences; the label is whether token 7 appears (learnable, public)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(10, vocab, (n, length), generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    x[y == 1, 3] = 7
    return torch.utils.data.TensorDataset(x, torch.ones_like(x), y)


def train(model, canaries: Path, obs_path: Path, *, sigma, clip, steps, records, batch, lr=0.05,
          seed=0, tamper=None):  # fmt: skip
    """Opacus DP-SGD with the canary hook; returns (Opacus's ε at δ, q, steps). ``tamper``
    (tests only) is called with the DPOptimizer before the hook attaches: a planted fault."""
    import secrets

    import torch
    from opacus import PrivacyEngine

    from audit.canaries.hooks import GradientCanaryHook

    # Opacus draws its Poisson batches and noise from torch's generator: seed it from OS
    # entropy (the public seed above made the model and the data only)
    torch.manual_seed(secrets.randbits(63))
    data = synthetic_data(records, seed=seed)
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        poisson_sampling=True,
    )
    if tamper is not None:
        tamper(opt)
    hook = GradientCanaryHook.load(canaries)
    hook.attach_opacus(opt, model, data_loader=loader)
    model.train()
    done = 0
    while done < steps:
        for x, mask, y in loader:
            if done == steps:
                break
            opt.zero_grad()
            if len(y):
                out = model(input_ids=x, attention_mask=mask).logits
                torch.nn.functional.cross_entropy(out, y).backward()
            else:  # an empty Poisson batch: Opacus still takes a (noise-only) step
                for p in model.parameters():
                    if p.requires_grad:
                        p.grad_sample = torch.zeros((0, *p.shape))
            opt.step()
            done += 1
    hook.write_observations(obs_path)
    return engine, loader.sample_rate, done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", help="folder for the files (default: a temporary folder)")
    ap.add_argument("--canaries", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args(argv)

    import torch

    from audit.canaries.hooks import write_params
    from pipeline.cli import main as fedlora

    torch.set_num_threads(1)
    work = Path(a.work or tempfile.mkdtemp(prefix="opacus-peft-audit-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(rank=a.rank)
    write_params(model, work / "params.json")
    canaries = work / "canaries"
    rc = fedlora(["canaries", "new", "--kind", "gradient", "--count", str(a.canaries),
                  "--params", str(work / "params.json"), "--clip", str(a.clip),
                  "--out", str(canaries)])  # fmt: skip
    if rc:
        return rc
    engine, q, steps = train(
        model, canaries, work / "obs.npz", sigma=a.sigma, clip=a.clip, steps=a.steps,
        records=a.records, batch=a.batch,
    )  # fmt: skip
    eps = engine.get_epsilon(a.delta)
    claim = {
        "name": "Opacus DP-SGD, tiny BERT + LoRA (docs/examples/opacus_peft_audit.py)",
        "level": "sample",
        "noise_multiplier": a.sigma,
        "clipping_norm": a.clip,
        "sampling": "poisson",
        "sample_rate": q,
        "steps_per_round": steps,
        "rounds": 1,
        "accounting": "composed",
        "noise_source": "unknown",
        "notes": "torch's generator (Mersenne Twister) seeded from OS entropy; Opacus's "
        "secure_mode (torchcsprng) would make it a CSPRNG",
        "claimed_epsilon": round(eps, 6),
        "delta": a.delta,
    }
    (work / "claim.toml").write_text(
        "".join(f"{k} = {json.dumps(v)}\n" for k, v in claim.items()), encoding="utf-8"
    )
    print(f"trained {steps} Opacus steps at q = {q:.4g}, σ = {a.sigma}: Opacus's ε = {eps:.3f}")
    return fedlora(["audit", "--canaries", str(canaries), "--observations",
                    str(work / "obs.npz"), "--claim", str(work / "claim.toml")])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
