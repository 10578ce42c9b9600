#!/usr/bin/env bash
# Device: finished transfers reused through a lock-free cache (new) against calloc/free per
# transfer (old, 6c25a25), alternated twice: perop.py (64 lanes, 8 B; shm, cma, tcp) and
# bench p2p --fabtests at 4 KiB and 64 KiB (shm, tcp).
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm cma tcp; do run "$w" 60 docs/bench/issue15/perop/perop.py $p; done
  for p in shm tcp; do
    echo "=== p2p $p $w $(date +%T)"
    run "$w" 100 -m afabric.cli bench p2p --quick --sizes 4K,64K --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
  done
}
ab_rounds cache-ab.log one_round
