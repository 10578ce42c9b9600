#!/usr/bin/env bash
# Device: the worker's 100 ms idle sleep (new, e9a4c45) against 5c885d5 (old), alternated
# twice: idle engines (shm, tcp, cma), awaited 8 B (latsplit.py shm), bench trigger shm;
# then bench p2p against fi_rma_bw with the new tree (shm, tcp).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do
    for p in shm tcp cma; do echo -n "$w "; PYTHONPATH=/tmp/site-$w timeout 30 "$PY" -P docs/bench/issue15/idle.py $p; done
    echo -n "$w "; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/latsplit.py shm adaptive uvloop
    echo "--- $w trigger shm"
    PYTHONPATH=/tmp/site-$w timeout 120 "$PY" -P -m afabric.cli bench trigger --quick --provider shm | grep -E "^triggered"
  done; done
  for p in shm tcp; do
    echo "=== p2p $p new $(date +%T)"
    PYTHONPATH=/tmp/site-new timeout 200 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p' | grep -E "^write|^many|^awaited"
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/ninth3.log"
