#!/usr/bin/env bash
# Device: bench trigger, the watcher thread yielding every look (new) vs every 64th (pause).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels new pause
{
  for r in 1 2; do for p in shm tcp; do for w in new pause; do
    echo "=== $w $p $(date +%T)"
    PYTHONPATH=/tmp/site-$w timeout 120 "$PY" -P -m afabric.cli bench trigger --provider $p 2>&1 | grep -E "^triggered|^python |^mode"
  done; done; done
  for w in new pause; do echo "=== idle $w"; for p in shm tcp; do PYTHONPATH=/tmp/site-$w timeout 30 "$PY" docs/bench/issue15/idle.py $p; done; done
} 2>&1 | tee "$OUT/trig.log"
