#!/usr/bin/env bash
# Device, one call: the completion signal held back while many operations are in flight,
# with an experiment build (not landed: shim/ring.c read AFS_HOLD_* from the environment):
# off / gap 2 us max 16 us / gap 5 us max 30 us, alternated twice: perop.py shm, tcp, cma
# and bench p2p shm 4K,64K,1M --fabtests.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do
    for cfg in "1000000 2000 16000" "8 2000 16000" "8 5000 30000"; do
      set -- $cfg
      export AFS_HOLD_MIN=$1 AFS_HOLD_GAP=$2 AFS_HOLD_MAX=$3
      echo "--- hold min $1 gap $2 max $3 $(date +%T)"
      for p in shm tcp cma; do run new 90 docs/bench/issue15/perop/perop.py $p; done
      run new 200 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M --repeat 3 \
        --fabtests "$ROOT/.fabtests" --provider shm | sed -n '/^op /,/^write  *1 MiB/p'
    done
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/hold-ab.log"
