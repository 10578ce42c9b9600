#!/usr/bin/env bash
# Device: the ninth session's final tree (new): bench trigger with the writer's plain stores
# (shm, tcp, twice), trigsplit.py (store and add bumps), bench p2p against fi_rma_bw (shm,
# tcp, and cma with --pattern fixed), latsplit.py's awaited 8 B and perop.py, idle engines.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
run() { PYTHONPATH=/tmp/site-new timeout "$1" "$PY" -P "${@:2}"; }
{
  for r in 1 2; do for p in shm tcp; do
    echo "--- trigger $p $(date +%T)"
    run 120 -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered|^python "
  done; done
  for p in shm tcp; do for m in writer loop; do for b in store add; do
    echo "--- trigsplit $p $m $b"
    PYTHONPATH=/tmp/site-new timeout 120 "$PY" docs/bench/issue15/trigsplit.py $p $m $b  # not -P: imports latsplit
  done; done; done
  for p in shm tcp; do
    echo "=== p2p $p $(date +%T)"
    run 200 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests "$ROOT/.fabtests" \
      --provider $p | sed -n '/^op /,/^awaited/p'
  done
  echo "=== p2p cma $(date +%T)"
  run 120 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 --pattern fixed --provider cma \
    | sed -n '/^op /,/^awaited/p'
  for p in shm cma tcp; do echo "--- latsplit"; run 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  for p in shm cma; do echo "--- perop"; run 60 docs/bench/issue15/perop/perop.py $p; done
  for p in shm tcp cma; do run 30 docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/ninth2.log"
