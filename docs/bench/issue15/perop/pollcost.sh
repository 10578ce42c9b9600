#!/usr/bin/env bash
# Device: pollcost.py (64 lanes, the loop's polling on / off) for shm, cma and tcp.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  # not -P: pollcost.py imports perop.py from its directory
  for p in shm cma tcp; do PYTHONPATH=/tmp/site-new timeout 200 "$PY" docs/bench/issue15/perop/pollcost.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/pollcost.log"
