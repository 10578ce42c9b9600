#!/usr/bin/env bash
# Device: the fifteenth session's final tree alone (.whl-ab/new): bench p2p --fabtests for shm
# and tcp (fi_rma_bw and fi_rma_bw -U columns), bench trigger --quick, perop.py (shm, cma).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for p in shm tcp; do
    echo "=== p2p $p $(date +%T)"
    run new 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
  done
  for p in shm tcp; do
    echo "--- trigger $p $(date +%T)"
    run new 60 -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered"
  done
  for p in shm cma; do run new 60 docs/bench/issue15/perop/perop.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/fifteenth-final.log"
