#!/usr/bin/env bash
# Install (if needed), lint (ruff, import contracts), and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # layer contracts of pyproject.toml (no cycles, fl below the rest)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 MPLBACKEND=Agg
# pytest caches its assertion-rewritten test modules only where Python may write bytecode:
# a re-run (and each pytester session) then reads them instead of rewriting 128 files.
unset PYTHONDONTWRITEBYTECODE
# --dist loadfile: each test file runs on one worker, so a module's fixtures (trained runs,
# a Flower simulation, a Ray instance) are built once, not once per worker. (loadgroup's
# xdist_group marks are silently ignored with pytest 9 and xdist 3.8: xdist renames
# item._nodeid, which pytest 9 no longer reads; measured 2026-12-03.)
# --no-loadscope-reorder: the files go longest first, as tests/conftest.py sorted them from
# tests/durations.json (xdist's own order is most tests first), so the workers end together.
# FEDLORA_SUITE_BUDGET=1: the session fails when one file exceeds the budget of
# pyproject.toml [tool.fedlora.test-budget] (tests/suite_budget.py).
FEDLORA_SUITE_BUDGET=1 .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder \
  --timeout 600 "$@"
