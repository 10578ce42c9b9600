#!/usr/bin/env bash
# Device: the per-operation path's ctypes and Python cost (old: main before; new: after),
# alternated: latsplit.py (awaited 8 B), perop.py (64 lanes), then bench p2p against
# fi_rma_bw for shm and tcp.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do
    for p in shm cma tcp; do
      echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/latsplit.py $p adaptive uvloop
    done
    for p in shm cma; do echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py $p; done
  done; done
  for p in shm tcp; do for w in old new; do
    echo "=== p2p $p $w $(date +%T)"
    PYTHONPATH=/tmp/site-$w timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p'
  done; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/hot.log"
