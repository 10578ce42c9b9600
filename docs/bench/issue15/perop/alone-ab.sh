#!/usr/bin/env bash
# Device: the awaited write's path with _alone's look accounting inlined and its arguments
# passed as they are (new) against the tuple and method call (old), alternated twice:
# alone.py (one process; cma, shm, tcp) and perop.py (64 lanes; shm).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in cma shm tcp; do run "$w" 60 docs/bench/issue15/alone.py $p; done
  run "$w" 60 docs/bench/issue15/perop/perop.py shm
}
ab_rounds alone-ab.log one_round
