#!/usr/bin/env bash
# Device: the session's final tree against fi_rma_bw in the same run (shm, tcp), fixed pattern.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  for p in shm tcp; do
    echo "=== p2p $p $(date +%T)"
    PYTHONPATH=/tmp/site-new timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M \
      --repeat 3 --fabtests "$ROOT/.fabtests" --provider $p
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/final3.log"
