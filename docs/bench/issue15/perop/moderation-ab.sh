#!/usr/bin/env bash
# Signal moderation (shim/ring.c HOLD_*) A/B, one call: .whl-ab/old (24dea20, without) and
# .whl-ab/new (with), alternated twice: woken.py (64 lanes, shm 8 B and 4 KiB, tcp and cma
# 4 KiB), then bench p2p shm and tcp against fi_rma_bw (.fabtests) at 4K,64K,1M,16M.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh

rows() {
  local w=$1 p s
  for ps in "shm 8" "shm 4096" "tcp 4096" "cma 4096"; do
    set -- $ps
    run "$w" 60 docs/bench/issue15/perop/woken.py "$1" "$2" 150000
  done
  p2p_rows "$w" 4K,64K,1M,16M | grep -E "^===|^op|^write|^awaited"
}

ab_rounds "${LOG:-moderation-ab.log}" rows
