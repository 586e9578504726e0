"""How a run's per-example gradients split between the head and the LoRA factors.

``python -m benchmarks.perf.grad_share RUN_DIR [--examples 64] [--json]``

Sample-level DP-SGD clips each example's gradient over all trained parameters to C and
adds noise of scale σC to every coordinate. When the LoRA factors' part of that gradient
is large, clipping shrinks the head's part with it, and the head learns as if its noise
were larger than the probe's at the same σ. This diagnostic reloads the run's final
adapter, computes the gradient of the cross-entropy loss of each of the first
``--examples`` members one at a time (dropout off: the obvious per-example loop, no
Opacus), and reports the head's and the factors' norms and the factors' share of the
squared norm. ``--head-clip-share`` (docs/privacy.md) is the remedy to try when that
share is large.

Only the factors that the method trains matter for its clip; this reports all of the
adapter's (FFA-LoRA's frozen A included), so it is an upper bound there.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def gradient_norms(run_dir: str, examples: int = 64) -> dict:
    """Per-example ℓ2 norms of the head's and the LoRA factors' loss gradients at the
    run's final adapter: {"head": [...], "lora": [...], "summary": {...}}."""
    from attacks.rundata import load_run
    from attacks.signals import load_adapter_model
    from fl.errors import UsageError
    from fl.models.base import load_tokenizer

    rd = load_run(run_dir)
    cfg = rd.config
    if rd.task != "classification":
        raise UsageError(f"{run_dir}: grad_share reads classification runs only")
    model = load_adapter_model(
        f"{run_dir}/adapter", cfg["model"], rd.num_labels, seed=int(cfg.get("seed", 0))
    )
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    tok = load_tokenizer(cfg["model"])
    params = {n: p for n, p in model.named_parameters() if ".lora_" in n or "modules_to_save" in n}
    for p in params.values():
        p.requires_grad_(True)
    members = np.where(rd.role == "member")[0][:examples]
    head, lora = [], []
    for i in members:
        enc = tok(
            rd.texts[i], truncation=True, max_length=int(cfg["max_length"]), return_tensors="pt"
        )
        loss = torch.nn.functional.cross_entropy(
            model(**enc).logits, torch.tensor([int(rd.labels[i])])
        )
        model.zero_grad(set_to_none=True)
        loss.backward()
        sq = {"head": 0.0, "lora": 0.0}
        for n, p in params.items():
            if p.grad is not None:
                sq["lora" if ".lora_" in n else "head"] += float(p.grad.double().pow(2).sum())
        head.append(sq["head"] ** 0.5)
        lora.append(sq["lora"] ** 0.5)
    h, lo = np.array(head), np.array(lora)
    share = lo**2 / np.maximum(h**2 + lo**2, 1e-300)
    clip = float(cfg.get("clip", 1.0))
    joint = np.sqrt(h**2 + lo**2)
    return {
        "run": str(run_dir),
        "examples": len(members),
        "head": head,
        "lora": lora,
        "summary": {
            "head_norm_median": float(np.median(h)),
            "lora_norm_median": float(np.median(lo)),
            "lora_share_of_squared_norm_median": float(np.median(share)),
            "lora_share_of_squared_norm_mean": float(np.mean(share)),
            "clip": clip,
            "frac_joint_norm_above_clip": float(np.mean(joint > clip)),
            # per example: the head's part after the joint clip to C over its part under
            # a head-only clip to C (what the probe keeps), median
            "head_kept_by_joint_clip_median": float(
                np.median(
                    np.minimum(1.0, clip / np.maximum(joint, 1e-300))
                    * h
                    / np.maximum(np.minimum(h, clip), 1e-300)
                )
            ),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.perf.grad_share", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("run_dir")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    a = ap.parse_args(argv)
    if a.examples < 1:
        ap.error("--examples must be >= 1")
    from fl.errors import UsageError

    try:
        res = gradient_norms(a.run_dir, a.examples)
    except UsageError as exc:
        print(f"grad_share: error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        json.dump(res, sys.stdout, indent=1)
        print()
    else:
        for k, v in res["summary"].items():
            print(f"{k}: {v:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
