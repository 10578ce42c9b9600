#!/usr/bin/env bash
# Device: the sixth session's tree (the loop polls the ring) against fi_rma_bw, fi_rma_bw's
# access pattern: shm, tcp, cma; perop.py; bench trigger; latsplit.py; idle engines.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
run() { PYTHONPATH=/tmp/site-new timeout "$1" "$PY" -P "${@:2}"; }
{
  for p in shm tcp cma; do
    echo "=== p2p $p $(date +%T)"
    run 170 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests "$ROOT/.fabtests" --provider $p
  done
  for p in shm cma; do run 60 docs/bench/issue15/perop/perop.py $p; done
  for p in shm tcp; do echo "=== trigger $p"; run 120 -m afabric.cli bench trigger --quick --provider $p; done
  for p in shm cma tcp; do run 60 docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  for p in shm tcp cma; do run 30 docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/final2.log"
