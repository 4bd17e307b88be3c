#!/usr/bin/env bash
# The test command: set up (if needed), then the unit tier, then the integration tier (multi-process launches,
# harnesses, learning claims, whole commands: CONTRIBUTING.md "Test tiers"). --fast runs the unit tier alone; other
# arguments go to pytest. Both tiers run on every core (pytest-xdist, one torch thread per worker; the multi-process
# tests one at a time), and each prints its 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
fast=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
# One OpenMP thread per process: the tests' models are tiny (overhead-bound) and the workers share the cores.
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1
# Let Python keep the bytecode it compiles (some machine images set PYTHONDONTWRITEBYTECODE=1): otherwise every process
# compiles every module it imports from source again, torch's and transformers' included (the set-up installs
# without compiling), and OpenCompass's 6,000 modules take 33 s per process instead of a few.
unset PYTHONDONTWRITEBYTECODE
workers=${DARE_TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(len(os.sched_getaffinity(0)), 8))")}
pytest=(.venv/bin/python -m pytest -q -n "$workers" --dist loadgroup --durations=25)

oc=""
if [ "$fast" = 0 ]; then
  # OpenCompass's own environment (the integration tier's harness test) builds beside the unit tier: most of its
  # time is downloads. Its test waits for it (the set-up script holds a lock).
  bash scripts/setup_opencompass.sh > .venv-oc.log 2>&1 &
  oc=$!
  trap '[ -n "$oc" ] && kill "$oc" 2>/dev/null || true' EXIT
fi

start=$SECONDS
echo "== unit tier (${workers} workers)"
"${pytest[@]}" -m "not integration" "${args[@]}"
echo "== unit tier: $((SECONDS - start)) s"
[ "$fast" = 1 ] && exit 0

if ! wait "$oc"; then
  oc=""
  echo "OpenCompass set-up failed (scripts/setup_opencompass.sh); its log:" >&2
  tail -n 40 .venv-oc.log >&2
  exit 1
fi
oc=""
start=$SECONDS
echo "== integration tier (${workers} workers)"
set +e
"${pytest[@]}" -m integration "${args[@]}"
rc=$?
set -e
echo "== integration tier: $((SECONDS - start)) s"
# pytest exits 5 when no test is selected (a -k that matches only unit tests); that is not a failure here.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi
