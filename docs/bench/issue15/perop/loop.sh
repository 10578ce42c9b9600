#!/usr/bin/env bash
# Device: the event loop polling the completion ring (old: main before; new: after),
# alternated: latsplit.py (awaited 8 B, where the time goes), perop.py, bench p2p (shm).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do
    for p in shm cma tcp; do for l in asyncio uvloop; do
      echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/latsplit.py $p adaptive $l
    done; done
    for p in shm cma; do echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py $p; done
  done; done
  for w in old new; do
    echo "=== p2p shm $w $(date +%T)"
    PYTHONPATH=/tmp/site-$w timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M --repeat 3 --fabtests "$ROOT/.fabtests" --provider shm
  done
  for w in old new; do for p in shm tcp; do echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 30 "$PY" -P docs/bench/issue15/idle.py $p; done; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/loop.log"
