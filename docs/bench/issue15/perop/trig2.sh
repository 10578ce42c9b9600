#!/usr/bin/env bash
# Device: triggered writes, main before (old: c9ce787) and after (new) the worker fires what is
# armed on a watcher itself; bench trigger alternated twice; trigsplit.py (new only: old has
# no "seen" stamp); latsplit.py (new).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  for r in 1 2; do for w in old new; do for p in shm tcp; do
    echo "--- $w $p"
    PYTHONPATH=/tmp/site-$w timeout 120 "$PY" -P -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered|^python "
  done; done; done
  for p in shm tcp; do for m in thread loop; do
    PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P docs/bench/issue15/trigsplit.py $p $m
  done; done
  for p in shm cma tcp; do PYTHONPATH=/tmp/site-new timeout 60 "$PY" -P docs/bench/issue15/latsplit.py $p adaptive uvloop; done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/trig2.log"
