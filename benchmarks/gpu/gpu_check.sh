#!/usr/bin/env bash
# GPU check (issue 10): on a machine with an NVIDIA GPU, within ~8 minutes,
#   1. a short DP training of every registered method on a BERT-base-sized random-init
#      model (hidden 768, 12 layers, 12 heads; ~110M parameters), under bf16 autocast
#      (falling back to fp32 for a method if bf16 fails; the record says which);
#   2. the DP-overhead benchmark on CUDA (minilm and the BERT-base model; fp32 and bf16);
#   3. the server-aggregation benchmark on CUDA (layer sizes up to 4096, K = 10, 100).
# Usage: benchmarks/gpu/gpu_check.sh RESULTS_DIR     (run from the repository root)
# GPU_CHECK_PARTS=methods|bench|all (default all) runs only part 1, only parts 2-3, or all;
# GPU_CHECK_METHODS=a,b limits part 1 to those methods.
# Writes RESULTS_DIR/{env.txt,methods.json,methods.md,bench_dp*/,bench_agg/,summary.md,log.txt}.
# Exits 2 with a clear message when no CUDA device is present (nothing is trained).
set -u -o pipefail

# shellcheck source=benchmarks/gpu/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
gpu_prelude gpu_check "$@"

mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
START=$(date +%s)
status=0
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

{
  nvidia-smi 2>&1 || true
  "$PY" -c 'import torch, transformers, opacus; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0)); print("transformers", transformers.__version__, "opacus", opacus.__version__)'
} > "$OUT/env.txt" 2>&1

# ---- 1. every method with DP on a BERT-base-sized random-init model -------------------
say "building the BERT-base-sized random-init model folder"
MODEL_DIR="$OUT/bert-base-random"
timeout 60 "$PY" - "$MODEL_DIR" >>"$LOG" 2>&1 <<'EOF' || { say "model build failed"; exit 1; }
import sys
import torch
from transformers import BertConfig, BertForSequenceClassification
from fl.models.base import load_tokenizer
tok = load_tokenizer("minilm")  # offline WordPiece vocabulary (30522)
torch.manual_seed(0)
cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, num_labels=2)
BertForSequenceClassification(cfg).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print("saved", sys.argv[1], sum(p.numel() for p in BertForSequenceClassification(cfg).parameters()))
EOF

PARTS="${GPU_CHECK_PARTS:-all}"
if [ "$PARTS" != "bench" ]; then
say "training every method with DP (bf16 autocast where it works)"
timeout 240 "$PY" - "$MODEL_DIR" "$OUT" >>"$LOG" 2>&1 <<'EOF' || { say "method runs failed or timed out"; status=1; }
import json, sys, time, traceback
from pathlib import Path
import torch
from fl.run.config import TrainConfig
from fl.run.engine import train
from fl.methods import registry

model_dir, out = sys.argv[1], Path(sys.argv[2])
HETERO = {"flora", "flexlora", "hetlora", "plora"}
rows, failed = [], 0
import os
only = [m for m in os.environ.get("GPU_CHECK_METHODS", "").split(",") if m]
for name in registry.names():
    if only and name not in only:
        continue
    kw = dict(method=name, model=model_dir, dataset="synthetic", members=600, nonmembers=0,
              test=200, max_length=64, clients=3, rounds=2, local_steps=5, batch_size=32,
              rank=8, alpha=16.0, dp_level="sample", epsilon=8.0, device="cuda",
              progress=False, eval_batch_size=200)
    if name in HETERO:
        kw["client_ranks_list"] = "4,8,8"
    row = {"method": name}
    for precision in ("bf16", "fp32"):
        run_dir = out / "runs" / f"{name}-{precision}"
        try:
            t = time.perf_counter()
            if precision == "bf16":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    man = train(TrainConfig(**kw), run_dir, quiet=True)
            else:
                man = train(TrainConfig(**kw), run_dir, quiet=True)
            torch.cuda.synchronize()
            row.update(precision=precision, seconds=time.perf_counter() - t,
                       accuracy=man["metrics"]["final"].get("accuracy"),
                       epsilon_pld=man["privacy"]["epsilon"]["pld"],
                       peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30, ok=True)
            break
        except Exception as exc:  # noqa: BLE001 - recorded; fp32 is tried next
            row.setdefault("errors", {})[precision] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            torch.cuda.reset_peak_memory_stats()
    else:
        row["ok"] = False
        failed += 1
    rows.append(row)
    print(json.dumps(row), flush=True)
(out / "methods.json").write_text(json.dumps(rows, indent=2))
lines = ["| method | precision | seconds | accuracy | ε (PLD) | peak GiB | ok |", "|---|---|---|---|---|---|---|"]
for r in rows:
    f = lambda k, fmt: (fmt % r[k]) if r.get(k) is not None else "–"
    lines.append(f"| {r['method']} | {r.get('precision', '–')} | {f('seconds', '%.1f')} | "
                 f"{f('accuracy', '%.3f')} | {f('epsilon_pld', '%.2f')} | "
                 f"{f('peak_mem_gib', '%.2f')} | {r['ok']} |")
(out / "methods.md").write_text("\n".join(lines) + "\n")
sys.exit(1 if failed else 0)
EOF
fi

# ---- 2. DP overhead on CUDA (fp32, then bf16 autocast) -----------------------------------
if [ "$PARTS" != "methods" ]; then
export FEDLORA_BENCH_DP_MODELS="minilm,$MODEL_DIR"
say "dp_overhead benchmark, fp32"
timeout 90 "$PY" -m pipeline.cli bench dp_overhead --device cuda --out "$OUT/bench_dp_fp32" \
  >>"$LOG" 2>&1 || { say "dp_overhead fp32 failed"; status=1; }
say "dp_overhead benchmark, bf16 autocast"
FEDLORA_BENCH_BF16=1 timeout 60 "$PY" -m pipeline.cli bench dp_overhead --device cuda \
  --out "$OUT/bench_dp_bf16" >>"$LOG" 2>&1 || { say "dp_overhead bf16 failed"; status=1; }
unset FEDLORA_BENCH_DP_MODELS

# ---- 3. server aggregation up to 4096 on CUDA --------------------------------------------
say "aggregation benchmark (384, 1024, 4096; K = 10, 100)"
timeout 60 "$PY" -m pipeline.cli bench aggregation --device cuda --out "$OUT/bench_agg" \
  >>"$LOG" 2>&1 || { say "aggregation failed"; status=1; }
fi

{
  echo "# gpu_check $(date -u +%FT%TZ), $(( $(date +%s) - START )) s, exit status $status"
  echo; echo '```'; head -20 "$OUT/env.txt"; echo '```'
  for f in methods.md bench_dp_fp32/bench.md bench_dp_bf16/bench.md bench_agg/bench.md; do
    echo; echo "## $f"; echo; cat "$OUT/$f" 2>/dev/null || echo "(missing: see log.txt)"
  done
} > "$OUT/summary.md"
rm -rf "$MODEL_DIR" "$OUT/runs"/*/checkpoint 2>/dev/null
say "done (status $status); summary in $OUT/summary.md"
exit $status
