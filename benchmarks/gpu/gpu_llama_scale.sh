#!/usr/bin/env bash
# Llama-architecture DP step on a GPU (issue #48, item 3), one prepared call:
#   `python -m benchmarks.perf.scale --device cuda` on random-init Llama models of the
#   scale benchmark's shape family (fl.models.decoders.decoder_shape: GQA 4:1, heads of 64,
#   tied embeddings, vocabulary 32,000), width 1024 (210 M) and 2048 (32 layers, 1.47 B
#   parameters), each written as a Hugging Face folder (safetensors) and loaded by the
#   engine's own path; in fp32 and bf16 autocast; LoRA rank 8 and 64 on q_proj/v_proj of
#   every layer; batch 8 of 128 and 512 tokens. Per point: seconds per non-DP and per
#   DP-SGD step (the engine's DpSgd: Opacus per-example gradients of the LoRA factors,
#   joint clipping, keyed noise; synchronized wall time, median of REPS interleaved),
#   their ratio, CUDA's peak allocated memory of each kind of step and its rise, and the
#   per-example gradient bytes against those of the whole base. Budget: ~3-6 min on an
#   H200 (most of it writing and loading the 1.47 B folder); the run stops at 540 s.
# Usage: benchmarks/gpu/gpu_llama_scale.sh RESULTS_DIR    (from the repository root)
# Needs: a CUDA build of torch with transformers 5, peft 0.21, opacus 1.6, cryptography,
# tokenizers, matplotlib (nothing downloaded: models and tokenizer are built here).
# Environment: PYTHON (interpreter), WIDTHS (default 1024,2048), RANKS (8,64),
# SEQS (128,512), BATCH (8), REPS (5), PRECISIONS (fp32,bf16);
# FEDLORA_SCALE_DEVICE=cpu runs the same call on the CPU (tiny settings: the script's own
# test, e.g. WIDTHS=64 RANKS=4 SEQS=16 BATCH=2 REPS=1).
# Writes RESULTS_DIR/{env.txt,log.txt,scale/results.json,scale/table.md,scale/scale.png}.
# Exits 2 with a message when no CUDA device is present (nothing is run).
set -u -o pipefail

DEVICE="${FEDLORA_SCALE_DEVICE:-cuda}"
if [ "$DEVICE" = "cuda" ]; then
  # shellcheck source=benchmarks/gpu/gpu_common.sh
  source "$(dirname "$0")/gpu_common.sh"
  gpu_prelude gpu_llama_scale "$@"
else
  if [ $# -ne 1 ]; then echo "usage: benchmarks/gpu/gpu_llama_scale.sh RESULTS_DIR" >&2; exit 2; fi
  OUT="$1"
  cd "$(dirname "$0")/../.." || exit 2
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi

mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/log.txt"
START=$(date +%s)
say() { echo "[gpu_llama_scale +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

{
  nvidia-smi 2>&1 || true
  uptime
  "$PY" -c 'import torch, transformers, opacus, peft; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda"); print("transformers", transformers.__version__, "opacus", opacus.__version__, "peft", peft.__version__)'
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1

THREADS=$(nproc 2>/dev/null || echo 4)
say "scale on $DEVICE: widths ${WIDTHS:-1024,2048}, ranks ${RANKS:-8,64}, seqs ${SEQS:-128,512}, batch ${BATCH:-8}, ${PRECISIONS:-fp32,bf16}"
PYTHONUNBUFFERED=1 timeout 540 "$PY" -m benchmarks.perf.scale --device "$DEVICE" \
  --widths "${WIDTHS:-1024,2048}" --ranks "${RANKS:-8,64}" --seqs "${SEQS:-128,512}" \
  --batch "${BATCH:-8}" --reps "${REPS:-5}" --precisions "${PRECISIONS:-fp32,bf16}" \
  --threads "$THREADS" --out "$OUT/scale" 2>&1 | tee -a "$LOG" >&2
status=$?
if [ -f "$OUT/scale/table.md" ]; then
  say "done (status $status)"
  cat "$OUT/scale/table.md" >&2
else
  say "failed (status $status): no table; see log.txt"
  status=1
fi
exit "$status"
