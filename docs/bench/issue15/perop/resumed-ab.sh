#!/usr/bin/env bash
# Device: writes of tasks resumed together by one drain are not alone (new) against the tree
# before (old, 1ac1f89), alternated twice: resumed.py (64 lanes: how many writes went alone,
# time per write; shm, cma, tcp) and bench p2p --fabtests at 4 KiB and 64 KiB (shm, tcp).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm cma tcp; do run "$w" 60 docs/bench/issue15/perop/resumed.py $p; done
  p2p_rows "$w" 4K,64K
}
ab_rounds resumed-ab.log one_round
