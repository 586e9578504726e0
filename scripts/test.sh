#!/usr/bin/env bash
# Install (if needed), lint (ruff, import contracts), and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # layer contracts of pyproject.toml (no cycles, fl below the rest)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 MPLBACKEND=Agg
.venv/bin/python -m pytest -n 2 --dist loadgroup --timeout 600 "$@"
