# Shared start of the GPU scripts (sourced, not run): gpu_prelude NAME "$@"
# checks the one RESULTS_DIR argument (OUT), moves to the repository root, picks the
# interpreter (PY: $PYTHON, else .venv/bin/python, else python3), keeps Hugging Face
# offline, and exits 2 with a message when no CUDA device is present (nothing is run).
gpu_prelude() {
  local name="$1"
  shift
  if [ $# -ne 1 ]; then
    echo "usage: benchmarks/$name.sh RESULTS_DIR" >&2
    exit 2
  fi
  OUT="$1"
  cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "$name: no CUDA device available to $PY (torch.cuda.is_available() is False);" \
         "this script needs an NVIDIA GPU and a CUDA build of torch - nothing was run" >&2
    exit 2
  fi
}
