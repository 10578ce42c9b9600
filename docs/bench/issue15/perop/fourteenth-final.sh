#!/usr/bin/env bash
# Device: the fourteenth session's final tree (.whl-ab/new) alone: perop.py and latsplit.py
# (shm, cma), floor.py, `bench trigger` at 2000 iterations (shm, tcp), then the usual rows.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs $("$PY" -V)"
  run new 120 docs/bench/issue15/floor.py
  for p in shm cma; do run new 90 docs/bench/issue15/perop/perop.py $p; done
  for p in shm cma tcp; do run new 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  for p in shm tcp; do
    echo "--- trigger $p full $(date +%T)"
    run new 200 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
  done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/fourteenth-final.log"
