#!/usr/bin/env bash
# Device, one call: the session's final tree (wheel `new`): resumed.py (shm, cma), the
# standard rows (wheels.sh: bench p2p --fabtests shm and tcp, cma, bench trigger, idle).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for p in shm cma; do run new 60 docs/bench/issue15/perop/resumed.py $p; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/sixteenth-last.log"
