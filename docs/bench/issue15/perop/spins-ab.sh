#!/usr/bin/env bash
# Device: a tcp target that stays awake 4 x spin_us after an arrival seen through the wait
# object (new, f47c85e) against one spin_us (old, 75aef96), alternated twice: the target's
# naps per 2,000 awaited 8 B writes (one process) and `bench p2p`'s tcp latency row.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1
  run "$w" 60 docs/bench/issue15/naps.py tcp
  run "$w" 60 -m afabric.cli bench p2p --quick --sizes 4K --repeat 1 --provider tcp | grep "^awaited"
}
ab_rounds spins-ab.log one_round
