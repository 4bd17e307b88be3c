#!/usr/bin/env bash
# The main job on the embedded default: set up (if needed), then run `dare <args>`
# (default: `dare quickstart`: a tiny LLaDA with a lazy-Sudoku habit on CPU, SFT checkpoint -> eval -> RL -> eval, table + PNG).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- quickstart; fi
exec .venv/bin/dare "$@"
