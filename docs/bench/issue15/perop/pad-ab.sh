#!/usr/bin/env bash
# Device, one call: an experiment build (not landed) with the engine's hot fields on cache
# lines of their own (new) against main (old), alternated twice (wheels.sh ab_rounds): takesplit.py (the awaited write's C part),
# perop.py and latdist.py, shm / cma / tcp.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
rows() {
  local w=$1 p
  for p in shm cma tcp; do
    run "$w" 60 docs/bench/issue15/perop/takesplit.py $p | grep -E "take|raw|await" | tail -4 | sed "s/^/$p /"
    run "$w" 60 docs/bench/issue15/perop/perop.py $p
    run "$w" 60 docs/bench/issue15/perop/latdist.py $p | tail -2
  done
}
ab_rounds pad-ab.log rows
