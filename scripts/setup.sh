#!/usr/bin/env bash
# Create .venv and install fedlora-audit with its pinned dependencies (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first, pinned, so nothing pulls a CUDA build.
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
# The pfl extra (library audits) in the same environment, --no-deps: pfl 0.6.0's metadata pins
# dp-accounting<0.6 and the toolkit pins 0.6.0, which changes none of the modules pfl imports;
# tests/benchmarks/test_accountants.py is the judge.
PFL_EXTRA=$(.venv/bin/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["pfl"]))')
# shellcheck disable=SC2086  # one word per pin
.venv/bin/python -m pip install -q --no-deps -c constraints.txt $PFL_EXTRA
# Headless Chromium for the report's browser test (tests/audit/test_report_browser.py):
# the Debian package, where apt-get and root are available; the test skips otherwise.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
      || echo "setup: could not install chromium (the report's browser test will be skipped)"
  else
    echo "setup: chromium missing and not installable here (needs root and apt-get)"
  fi
fi
# Bytecode for the toolkit's own modules and the tests' helpers (an editable install
# compiles none of them): each process that imports the toolkit -- the two test workers,
# Flower's and Ray's processes, the job's trainings -- then reads ~300 compiled modules
# instead of compiling them, and where PYTHONDONTWRITEBYTECODE is set (this machine's
# environment does) nothing would ever be cached. Stale files are recompiled as usual.
.venv/bin/python -m compileall -q -j 0 fl audit attacks analysis pipeline benchmarks flower_app tests
