#!/usr/bin/env bash
# The main job on the embedded default: set up (if needed), then run `dare <args>`
# (default: `dare quickstart`: a tiny LLaDA with a lazy-Sudoku habit on CPU, SFT checkpoint -> eval -> RL -> eval, table + PNG).
set -euo pipefail
cd "$(dirname "$0")/.."
# Let Python keep the bytecode it compiles (some machine images set PYTHONDONTWRITEBYTECODE=1): otherwise every process
# compiles every module it imports from source again, torch's and transformers' included (the set-up installs
# without compiling), and OpenCompass's 6,000 modules take 33 s per process instead of a few.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- quickstart; fi
exec .venv/bin/dare "$@"
