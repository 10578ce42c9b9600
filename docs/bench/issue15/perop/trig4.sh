#!/usr/bin/env bash
# Device: triggered writes and write_many with the seventh session's tree (new) against
# edd5f1e (old), alternated twice: bench trigger (shm, tcp), trigsplit.py (loop mode).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do for p in shm tcp; do
    echo "--- $w $p"
    PYTHONPATH=/tmp/site-$w timeout 120 "$PY" -P -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered|^python "
  done; done; done
  for p in shm tcp; do for w in old new; do
    echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 120 "$PY" docs/bench/issue15/trigsplit.py $p loop  # not -P: it imports latsplit from its directory
  done; done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/trig4.log"
