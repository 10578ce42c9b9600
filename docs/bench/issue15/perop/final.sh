#!/usr/bin/env bash
# Device: the session's final tree (7f53d31) against fi_rma_bw, fi_rma_bw's access pattern
# (the default with --fabtests): cma, shm, tcp; shm with spin polling; perop.py; idle engines.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
p2p() { PYTHONPATH=/tmp/site-new timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests "$ROOT/.fabtests" "$@"; }
{
  for p in shm tcp cma; do echo "=== p2p $p $(date +%T)"; p2p --provider $p; done
  echo "=== p2p shm, spin polling $(date +%T)"; p2p --provider shm --polling spin
  for p in shm cma; do PYTHONPATH=/tmp/site-new timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py $p; done
  for p in shm shm tcp cma; do PYTHONPATH=/tmp/site-new timeout 30 "$PY" docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/final.log"
