#!/usr/bin/env bash
# Device: bench p2p --fabtests with the fi_rma_bw -U column (delivery complete, the completion
# afabric's writes ask for) beside plain fi_rma_bw, shm and tcp, twice; then tcp with both
# workers spinning (--polling spin: whether the target's naps cost the 64 KiB rate).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do
    for p in shm tcp; do
      echo "=== p2p $p $(date +%T)"
      run new 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
        --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
    done
  done
  echo "=== p2p tcp, polling spin $(date +%T)"
  run new 150 -m afabric.cli bench p2p --quick --sizes 64K,1M --repeat 3 --polling spin \
    --fabtests "$ROOT/.fabtests" --provider tcp | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/dc.log"
