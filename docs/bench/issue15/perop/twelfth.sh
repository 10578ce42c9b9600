#!/usr/bin/env bash
# Device: reads awaited alone taken where submitted (new) against ae02bfb (old): readlat.py
# (awaited 8 B reads) and latsplit.py (awaited 8 B writes: the shared path must not cost),
# old and new alternated twice; then window.py tcp (new).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do for w in old new; do
    for p in shm cma tcp; do echo "--- $w"; run $w 90 docs/bench/issue15/perop/readlat.py $p 3 3000; done
    for p in shm cma; do echo "--- $w"; run $w 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  done; done
  run new 150 docs/bench/issue15/perop/window.py tcp 4 3000
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/twelfth.log"
