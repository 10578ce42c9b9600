#!/usr/bin/env bash
# Device: the per-operation calls with prebuilt addresses and the look's slice (new) against
# main before (old), alternated; then the new tree against fi_rma_bw (shm, tcp) and cma.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do
    for p in shm cma tcp; do
      echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/latsplit.py $p adaptive uvloop
    done
    for p in shm cma; do echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py $p; done
    echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P -m afabric.bench.submit shm 200
    echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/hotcalls.py cma
  done; done
  for p in shm cma tcp; do PYTHONPATH=/tmp/site-new timeout 60 "$PY" -P docs/bench/issue15/perop/slice.py $p; done
  for p in shm tcp; do
    echo "=== p2p $p new $(date +%T)"
    PYTHONPATH=/tmp/site-new timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p'
  done
  echo "=== p2p cma new $(date +%T)"
  PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
    --pattern fixed --provider cma | sed -n '/^op /,/^awaited/p'
  for p in shm tcp cma; do echo "--- new"; PYTHONPATH=/tmp/site-new timeout 30 "$PY" -P docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/final4.log"
