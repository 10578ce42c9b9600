#!/usr/bin/env bash
# Device: the awaited write's path with _alone's look accounting inlined and its arguments
# passed as they are (new) against the tuple and method call (old), alternated twice:
# alone.py (one process; cma, shm, tcp) and perop.py (64 lanes; shm).
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do
    for w in old new; do
      echo "--- $w $(date +%T)"
      for p in cma shm tcp; do run "$w" 60 docs/bench/issue15/alone.py $p; done
      run "$w" 60 docs/bench/issue15/perop/perop.py shm
    done
  done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/alone-ab.log"
