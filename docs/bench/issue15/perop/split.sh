#!/usr/bin/env bash
# Device: where an awaited 8 B write's time goes (latsplit.py), shm / cma / tcp, adaptive and spin.
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  for r in 1 2; do for p in shm cma tcp; do for pol in adaptive spin; do
    PYTHONPATH=/tmp/site-new timeout 60 "$PY" -P docs/bench/issue15/latsplit.py $p $pol
  done; done; done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/split.log"
