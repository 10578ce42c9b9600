#!/usr/bin/env bash
# Device: the inline first look (new) against main before it (old, 1055e49): inline.py's
# in-process A/B (shm, tcp, cma); latsplit.py and perop.py, old and new alternated twice;
# then the new tree: bench p2p against fi_rma_bw (shm, tcp) and cma, bench trigger, idle.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for p in shm tcp cma; do run new 120 docs/bench/issue15/perop/inline.py $p 4 3000; done
  for r in 1 2; do for w in old new; do
    for p in shm cma tcp; do echo "--- $w"; run $w 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
    for p in shm cma; do echo "--- $w"; run $w 60 docs/bench/issue15/perop/perop.py $p; done
  done; done
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/tenth.log"
