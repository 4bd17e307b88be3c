#!/usr/bin/env bash
# The test command: set up (if needed), then the default suite, then the slow tests (multi-process,
# end-to-end). Pass --fast to skip the slow ones; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
fast=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
export PYTHONHASHSEED=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python -m pytest -q -m "not slow" "${args[@]}"
if [ "$fast" = 0 ]; then
  set +e
  .venv/bin/python -m pytest -q -m slow "${args[@]}"
  rc=$?
  set -e
  # pytest exits 5 when no test is selected; that is not a failure here.
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi
fi
