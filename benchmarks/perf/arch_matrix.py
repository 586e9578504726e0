"""Every method × DP level on Llama and Qwen2 folders (issue #48):
``python -m benchmarks.perf.arch_matrix [--out DIR]``.

Tiny random-init Llama and Qwen2 causal LMs (:func:`fl.models.decoders.write_decoder_folder`:
GQA, tied embeddings, RoPE, RMSNorm, byte-level BPE, safetensors) are loaded by ``--model
DIR`` as a user's checkpoint and trained by every registered method at every DP level it
lists, with ``--task causal-lm`` (``probe``, head-only, is refused there by design) and
``--task classification``; a DP run is then audited (:func:`audit.bundle.audit.audit_run`:
ε recomputed from the configuration and from the ledger must equal the manifest's).
Writes ``methods.md`` and ``methods.json`` (pass/fail, seconds, ε) next to the scale
results.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from benchmarks.paths import RESULTS

OUT = RESULTS / "scale"
EXTRA = {"flexlora": dict(client_ranks_list="2,4"), "hetlora": dict(client_ranks_list="2,4")}


def one(folder: str, task: str, method: str, level: str, out: Path) -> dict:
    from audit.bundle.audit import audit_run
    from fl.run.engine import train
    from fl.testing import tiny_config, tiny_lm_config

    kw = dict(EXTRA.get(method, {}), model=folder, method=method)
    if level != "none":
        kw.update(dp_level=level, noise_multiplier=1.0, insecure_deterministic_noise=True)
    if level == "client":
        kw.update(clip=0.5)
    if task == "causal-lm":
        cfg = tiny_lm_config(**kw)
    else:
        cfg = tiny_config(
            members=60,
            nonmembers=20,
            test=20,
            max_length=16,
            clients=2,
            rounds=1,
            local_steps=2,
            batch_size=8,
            **kw,
        )
    t0 = time.perf_counter()
    row = {"task": task, "method": method, "level": level}
    try:
        man = train(cfg, out, quiet=True)
        final = man["metrics"]["final"]
        row["seconds"] = time.perf_counter() - t0
        row["loss"] = final.get("loss")
        ok = math.isfinite(final["loss"]) if final.get("loss") is not None else True
        if level != "none":
            eps = man["privacy"]["epsilon"]["pld"]
            res = audit_run(out)
            rec = (res["recomputed"]["config"]["pld"], res["recomputed"]["ledger"]["pld"])
            row["epsilon"] = eps
            ok = ok and all(math.isclose(r, eps, rel_tol=1e-6) for r in rec)
        row["result"] = "pass" if ok else "fail"
    except Exception as exc:  # a failing cell is a finding, not a crash of the table
        row["seconds"] = time.perf_counter() - t0
        row["result"] = f"fail: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return row


def main(argv=None) -> int:
    import torch

    from fl.methods import registry
    from fl.models.decoders import DecoderShape, write_decoder_folder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = DecoderShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, context=64)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedlora-arch-") as tmp:
        for kind in ("llama", "qwen2"):
            folder = write_decoder_folder(Path(tmp) / kind, kind, shape, vocab_size=300)["path"]
            for task in ("causal-lm", "classification"):
                for name in registry.names():
                    if task == "causal-lm" and name == "probe":
                        continue
                    for level in registry.get(name).dp_levels:
                        run = Path(tmp) / "runs" / f"{kind}-{task}-{name}-{level}"
                        row = {"arch": kind, **one(folder, task, name, level, run)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "methods.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Every method × DP level on Llama and Qwen2 folders "
        "(`python -m benchmarks.perf.arch_matrix`)\n",
        f"Measured {time.strftime('%Y-%m-%d', time.gmtime())}: tiny random decoders (width 32, "
        "2 layers, 4 query / 2 key-value heads, tied embeddings, byte-level BPE of 300 tokens) "
        "loaded from their folders; 2 clients, 1 round, 2 local steps of 8 (σ = 1, C = 1; "
        "client level C = 0.5), one torch thread; a DP run passes when its loss is finite and "
        "the audit recomputes the manifest's ε from the configuration and from the ledger.\n",
        "| arch | task | method | DP level | result | seconds | ε (PLD) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = f"{r['epsilon']:.3f}" if "epsilon" in r else "—"
        lines.append(
            f"| {r['arch']} | {r['task']} | {r['method']} | {r['level']} | {r['result']} | "
            f"{r['seconds']:.2f} | {eps} |"
        )
    passed = sum(r["result"] == "pass" for r in rows)
    lines.append(f"\n{passed} of {len(rows)} cells pass.\n")
    (out / "methods.md").write_text("\n".join(lines))
    print(f"{passed} of {len(rows)} pass; wrote {out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
