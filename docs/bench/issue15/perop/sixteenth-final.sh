#!/usr/bin/env bash
# Device, one call: resumed.py (64 lanes: writes gone alone, time per write) with the tree
# before the resumed-together change (old, 1ac1f89) and after (new), alternated twice (shm,
# cma, tcp); then with the new wheel where an awaited 8 B write's time goes (latsplit.py,
# uvloop; alone.py in one process), and the standard rows (wheels.sh).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm cma tcp; do run "$w" 60 docs/bench/issue15/perop/resumed.py $p; done
}
ab_rounds resumed-ab2.log one_round
{
  echo "=== split $(date +%T)"
  for p in shm cma; do run new 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  for p in shm cma; do run new 60 docs/bench/issue15/alone.py $p; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/sixteenth-final.log"
