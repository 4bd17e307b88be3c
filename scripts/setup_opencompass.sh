#!/usr/bin/env bash
# OpenCompass's own environment, .venv-oc (OpenCompass pins numpy<2 and datasets<4, which dare's training stack
# cannot use: docs/eval.md). Idempotent: reinstalls only when pyproject.toml or the pins changed. The CPU wheel of
# torch goes first, so no dependency range pulls a CUDA build; everything else is pinned by
# scripts/opencompass-constraints.txt (no resolver backtracking). Measured on 2 busy CPU cores: about 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# One build at a time: scripts/test.sh starts it in the background and its test runs it again (then it waits here).
exec 9>.venv-oc.lock
flock 9
PY=${PYTHON:-python3}
if [ ! -x .venv-oc/bin/python ]; then
  "$PY" -m venv .venv-oc
fi
stamp=.venv-oc/.dare-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/opencompass-constraints.txt -nt "$stamp" ]; then
  .venv-oc/bin/python -m pip install -q --upgrade pip
  # --no-compile: the one test that uses this environment imports a small part of it (Python compiles what it imports)
  .venv-oc/bin/python -m pip install -q --no-compile "torch==2.13.0"
  .venv-oc/bin/python -m pip install -q --no-compile -c scripts/opencompass-constraints.txt opencompass "pyarrow<21" -e .
  touch "$stamp"
fi
