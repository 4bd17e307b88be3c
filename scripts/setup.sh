#!/usr/bin/env bash
# Create .venv (once) and install dare with its test extras. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dare-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  start=$(date +%s)
  echo "set-up: creating .venv (about 1-2 minutes, once): pip" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU wheel of torch 2.13.0 first, so no dependency range pulls a multi-GB CUDA build. --no-compile: pip would
  # byte-compile every module of torch, transformers and the rest (about 90 of a fresh set-up's 150 s on 2 cores);
  # Python compiles what a process imports and keeps it (scripts/run.sh and test.sh let it write the .pyc files).
  echo "set-up: torch 2.13.0 (the CPU wheel)" >&2
  .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
  echo "set-up: dare and its test dependencies (transformers, lm-eval, math-verify, ...)" >&2
  .venv/bin/python -m pip install -q --no-compile -e ".[dev]"
  touch "$stamp"
  echo "set-up: done in $(( $(date +%s) - start )) s; 'source .venv/bin/activate' puts dare on your PATH" >&2
fi
