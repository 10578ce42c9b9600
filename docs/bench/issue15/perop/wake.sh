#!/usr/bin/env bash
# Device: libfabric 1.17 shm wake-ups, main before (old: 3be86c9) and after (new: 52cdd42),
# alternated: idle engines, `bench p2p --pattern fixed --fabtests` on shm, perop.py on shm.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do
    echo "=== $w round $r $(date +%T)"
    for i in 1 2; do PYTHONPATH=/tmp/site-$w timeout 30 "$PY" docs/bench/issue15/idle.py shm; done
    PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py shm
    PYTHONPATH=/tmp/site-$w timeout 170 "$PY" -P -m afabric.cli bench p2p --provider shm --quick \
      --sizes 4K,64K,1M,16M --repeat 3 --fabtests "$ROOT/.fabtests" 2>&1 | grep -E "^write|^many|^read|^awaited|^pattern"
  done; done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/wake.log"
