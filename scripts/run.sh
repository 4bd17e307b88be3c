#!/usr/bin/env bash
# The main job on the embedded default: set up (if needed), then run `dare <args>`
# (default: SFT of a tiny LLaDA on CPU; becomes `dare quickstart` once it lands).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- train recipes/sft_tiny.yaml; fi
exec .venv/bin/dare "$@"
