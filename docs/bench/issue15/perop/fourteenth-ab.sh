#!/usr/bin/env bash
# Device: the worker posts what a watcher fired in the same turn (new) against posting it
# after the turn's provider call (old, 6221393), alternated twice: trigsplit.py (1000 bumps
# from a long-lived writer thread, timing=True) and `bench trigger` at 2000 iterations.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do
    for w in old new; do
      for p in shm tcp; do
        echo "--- $w $p $(date +%T)"
        # not -P: trigsplit.py imports latsplit.py from its directory
        PYTHONPATH=/tmp/site-$w timeout 90 "$PY" docs/bench/issue15/trigsplit.py $p writer
        run "$w" 200 -m afabric.cli bench trigger --provider $p | grep -E "^triggered"
      done
    done
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/fourteenth-ab.log"
