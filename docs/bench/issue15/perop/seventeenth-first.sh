#!/usr/bin/env bash
# Device, one call: the sixteenth session's final tree (wheel `new`, 43ab132's code), which had
# been measured only on the 2-core machine: perop.py, latdist.py and resumed.py per provider,
# then the standard rows (wheels.sh).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for p in shm cma tcp; do
    echo "--- perop $p $(date +%T)"; run new 90 docs/bench/issue15/perop/perop.py $p
    echo "--- latdist $p $(date +%T)"; run new 120 docs/bench/issue15/perop/latdist.py $p
  done
  for p in shm cma; do run new 60 docs/bench/issue15/perop/resumed.py $p; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/seventeenth-first.log"
