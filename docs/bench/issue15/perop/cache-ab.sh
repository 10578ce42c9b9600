#!/usr/bin/env bash
# Device: finished transfers reused through a lock-free cache (new) against calloc/free per
# transfer (old, 6c25a25), alternated twice: perop.py (64 lanes, 8 B; shm, cma, tcp) and
# bench p2p --fabtests at 4 KiB and 64 KiB (shm, tcp).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm cma tcp; do run "$w" 60 docs/bench/issue15/perop/perop.py $p; done
  p2p_rows "$w" 4K,64K
}
ab_rounds cache-ab.log one_round
