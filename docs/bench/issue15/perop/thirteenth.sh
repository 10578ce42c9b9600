#!/usr/bin/env bash
# Device: the eleventh session's final tree (.whl-ab/new) alone: perop.py (shm, cma, twice),
# readlat.py (shm, cma, tcp), window.py tcp, latsplit.py, then the usual rows.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do for p in shm cma; do run new 90 docs/bench/issue15/perop/perop.py $p; done; done
  for p in shm cma tcp; do run new 90 docs/bench/issue15/perop/readlat.py $p 3 3000; done
  run new 150 docs/bench/issue15/perop/window.py tcp 4 3000
  for p in shm cma tcp; do run new 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/thirteenth.log"
