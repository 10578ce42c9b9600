#!/usr/bin/env bash
# Device: the ninth session's tree (new) against ac3d8a1 (old), alternated twice: idle
# engines, pbench.py's raw C loop and Python lanes (shm, one buffer; 64 KiB, 1 MiB, 16 MiB;
# awaited 8 B); then bench p2p against fi_rma_bw (old once, new for shm and tcp), the
# triggered write's split (trigsplit.py) and perop.py with the new tree.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
p2p() {  # WHEEL PROVIDER
  echo "=== p2p $2 $1 $(date +%T)"
  PYTHONPATH=/tmp/site-$1 timeout 200 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
    --fabtests "$ROOT/.fabtests" --provider "$2" | sed -n '/^op /,/^awaited/p'
}
{
  for r in 1 2; do for w in old new; do
    for p in shm tcp cma; do echo "--- $w"; PYTHONPATH=/tmp/site-$w timeout 30 "$PY" -P docs/bench/issue15/idle.py $p; done
    echo "--- $w $(date +%T)"
    PYTHONPATH=/tmp/site-$w timeout 120 "$PY" -P docs/bench/issue15/pbench.py shm adaptive 65536,1048576,16777216 one lat
  done; done
  p2p old shm
  p2p new shm
  p2p new tcp
  for m in writer loop; do
    echo "--- new trigsplit shm $m"
    PYTHONPATH=/tmp/site-new timeout 120 "$PY" docs/bench/issue15/trigsplit.py shm $m  # not -P: imports latsplit
  done
  echo "--- new"; PYTHONPATH=/tmp/site-new timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py shm
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/ninth.log"
