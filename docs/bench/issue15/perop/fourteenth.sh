#!/usr/bin/env bash
# Device: the Python floor (floor.py) beside afabric's per-operation cost (perop.py) and its
# awaited 8 B write (latsplit.py) in one call, twice; where a triggered write's tail comes
# from (trigsplit.py, 1000 bumps from a long-lived writer thread); `bench trigger` at its
# full 2000 iterations (its p99 over 300 samples is the third-worst one).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs $("$PY" -V)"
  for r in 1 2; do
    run new 120 docs/bench/issue15/floor.py
    for p in shm cma; do run new 90 docs/bench/issue15/perop/perop.py $p; done
    for p in shm cma; do run new 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  done
  for p in shm tcp; do
    # not -P: trigsplit.py imports latsplit.py from its directory
    PYTHONPATH=/tmp/site-new timeout 90 "$PY" docs/bench/issue15/trigsplit.py $p writer
  done
  for p in shm tcp; do
    echo "--- trigger $p full $(date +%T)"
    run new 200 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/fourteenth.log"
