#!/usr/bin/env bash
# Device: the write awaited alone that must let the loop run is looked for too and then
# yields once (new) against submitted without a look and awaited on a future (old),
# alternated twice: latdist.py (p50 / p90 / p99 / mean of awaited 8 B writes; shm, cma, tcp).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm cma tcp; do run "$w" 60 docs/bench/issue15/perop/latdist.py $p; done
}
ab_rounds yield-ab.log one_round
