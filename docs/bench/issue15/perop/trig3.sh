#!/usr/bin/env bash
# Device: trigsplit.py with a long-lived writer thread (as bench trigger's), a thread per bump,
# and the loop; bench trigger once (the tree after 62b2d7e).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  for r in 1 2; do for p in shm tcp; do for m in writer thread loop; do
    PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P docs/bench/issue15/trigsplit.py $p $m
  done; done; done
  for p in shm tcp; do echo "--- $p"; PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered|^python "; done
  echo "=== end $(date +%T)"
} 2>&1 | grep -v "^afabric: [0-9]*/" | tee "$OUT/trig3.log"
