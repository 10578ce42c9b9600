#!/usr/bin/env bash
# Device: a write awaited alone looked for for one poll slice against up to spin_us
# (window.py, in one process: shm, tcp, cma; tcp also with 64 KiB writes); latsplit.py;
# then bench p2p against fi_rma_bw (shm, tcp) and cma, bench trigger, idle — all of the
# new tree (.whl-ab/new).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for p in tcp shm cma; do run new 150 docs/bench/issue15/perop/window.py $p 4 3000; done
  run new 150 docs/bench/issue15/perop/window.py tcp 4 2000 uvloop 65536
  for p in shm cma tcp; do run new 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/eleventh.log"
